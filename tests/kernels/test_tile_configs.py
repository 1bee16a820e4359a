"""Launch-geometry choices of tile_configs that need no compiler: the forward's vocabulary split
count fills whole waves of the GPU's SMs."""

import pytest
import torch
import triton

from grpo_kernels.kernels import tile_configs


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


@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90, 100, 120])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16])
def test_atomic_backward_tiles_follow_a_float32_head(arch, hidden_dtype):
    # the mixed head (16-bit hidden, float32 weight) at the 16-bit tiles spilled 120-136 B on
    # sm_80 (compile_check): its tiles are the float32 ones
    mixed = tile_configs.linear_bwd_atomic(hidden_dtype, None, arch=arch,
                                           weight_dtype=torch.float32)
    # sm_90 compiles the 16-bit tiles spill-free for the mixed head (and keeps them)
    wide = hidden_dtype if arch == 90 else torch.float32
    assert mixed == tile_configs.linear_bwd_atomic(wide, None, arch=arch)
    same = tile_configs.linear_bwd_atomic(hidden_dtype, None, arch=arch, weight_dtype=hidden_dtype)
    assert same == tile_configs.linear_bwd_atomic(hidden_dtype, None, arch=arch)


def test_atomic_backward_launcher_passes_the_head_dtype(monkeypatch):
    from grpo_kernels.kernels import linear_backward_atomic

    seen = []
    real = tile_configs.linear_bwd_atomic

    def record(dtype, device, arch=None, weight_dtype=None):
        seen.append((dtype, weight_dtype))
        return real(dtype, device, arch, weight_dtype)

    monkeypatch.setattr(tile_configs, "linear_bwd_atomic", record)
    g = torch.Generator().manual_seed(0)
    N, D, V = 5, 16, 40
    hidden = torch.randn(N, D, generator=g).to(torch.float16)
    weight = torch.randn(V, D, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    z = hidden.double() @ weight.double().T
    log_p = z.log_softmax(-1)
    lse, ent = z.logsumexp(-1).float(), -(log_p.exp() * log_p).sum(-1).float()
    g_logp = torch.randn(N, generator=g)
    dh, dw, _ = linear_backward_atomic.linear_logprob_backward_atomic(
        hidden, weight, None, targets, lse, ent, g_logp, None, 1.0)
    assert seen == [(torch.float16, torch.float32)]
    # d logits = g (onehot - p): the gradients the tiles computed, against float64
    dz = g_logp.double()[:, None] * (torch.nn.functional.one_hot(targets, V) - log_p.exp())
    assert dh.dtype == torch.float16 and dw.dtype == torch.float32
    torch.testing.assert_close(dh.double(), dz @ weight.double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(dw.double(), dz.T @ hidden.double(), atol=1e-4, rtol=1e-4)
