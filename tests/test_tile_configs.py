"""Launch-geometry choices of tile_configs that need no compiler: the forward's vocabulary split
count fills whole waves of the GPU's SMs."""

import pytest
import triton

from grpo_kernels import tile_configs


def _efficiency(programs: int, slots: int) -> float:
    return programs / (triton.cdiv(programs, slots) * slots)


@pytest.mark.parametrize("N", [512, 1024, 4096, 8192, 16384, 65536])
@pytest.mark.parametrize("V", [151936, 32000, 128256])
def test_split_count_fills_whole_waves(N, V):
    sms, block_n, block_v, group_n = 132, 128, 128, 16  # H100, the bf16 forward's tiles
    n_blocks, n_tiles = triton.cdiv(N, block_n), triton.cdiv(V, block_v)
    S = tile_configs.num_splits(n_blocks, n_tiles, group_n, None, sms=sms)
    # the launcher's own no-empty-split rule leaves it unchanged
    assert triton.cdiv(n_tiles, triton.cdiv(n_tiles, S)) == S
    assert 1 <= S <= min(n_tiles // 4, tile_configs.MAX_SPLITS)
    # never fewer programs than the old rule asked for (enough to fill the GPU)...
    want = min(max(triton.cdiv(sms, group_n), triton.cdiv(2 * sms, n_blocks)),
               n_tiles // 4, tile_configs.MAX_SPLITS)
    assert S >= triton.cdiv(n_tiles, triton.cdiv(n_tiles, want))
    # ...and within 5% of the best last-wave fill any allowed count reaches, in waves of two
    # programs per SM (whole ones are whole at one block per SM too)
    def realized(s):
        return triton.cdiv(n_tiles, triton.cdiv(n_tiles, s))

    best = max(_efficiency(n_blocks * realized(s), 2 * sms)
               for s in range(want, min(n_tiles // 4, tile_configs.MAX_SPLITS) + 1))
    assert _efficiency(n_blocks * S, 2 * sms) >= best - 0.05


def test_split_count_fixes_the_n4096_partial_wave():
    # the audit's case: 9 splits x 32 token blocks = 288 programs = 2.18 waves of 132 SMs
    S = tile_configs.num_splits(32, triton.cdiv(151936, 128), 16, None, sms=132)
    for slots in (132, 264):  # one or two blocks per SM
        assert _efficiency(32 * S, slots) > 0.95 > _efficiency(32 * 9, slots)
