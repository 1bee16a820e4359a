"""The linear head's forward compiles once for every batch size: the launch arguments that
Triton specializes on (constexprs, integers equal to 1 or divisible by 16, pointer alignment)
do not change when only N changes.

No GPU is needed: the launcher runs with its kernels replaced by recorders, the tiles and
split count chosen as on an H100 (sm_90, 132 SMs), and each recorded launch is turned into the
key Triton's JITFunction would compile it under (`compile_check.specialization.signature_of`,
itself tested against Triton's own function in test_compile_check.py).
"""

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.compiler")

from grpo_kernels.compile_check import specialization  # noqa: E402
from grpo_kernels.kernels import linear_logprobs as lin  # noqa: E402
from grpo_kernels.kernels import tile_configs  # noqa: E402

ELEM = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
        torch.int64: "i64"}
# token counts of packed micro-batches as a trainer sees them step after step
TOKEN_COUNTS = (1031, 2048, 3000, 4096, 5555, 8192, 12289, 16384, 40000, 65536)


class Recorder:
    """Stands for a jitted kernel: `kernel[grid](...)` records the specialization key."""

    def __init__(self, kernel):
        if not hasattr(kernel, "params"):  # Triton's interpreter: the JITFunction it wraps
            from triton.runtime.jit import JITFunction

            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        self.kernel, self.keys, self.last = kernel, set(), {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args), **kwargs)
            named = {k: v for k, v in named.items() if k not in ("num_warps", "num_stages",
                                                                  "enable_fp_fusion", "maxnreg")}
            self.last = named
            sig, constexprs, attrs = specialization.signature_of(self.kernel, _as_ptrs(named))
            self.keys.add((tuple(sig.items()), tuple(sorted(constexprs.items())),
                           tuple(sorted(attrs))))
        return launch


def _as_ptrs(args: dict) -> dict:
    def ptr(x):
        if isinstance(x, torch.Tensor):
            return specialization.Ptr(ELEM[x.dtype], x.data_ptr() % 512)
        if isinstance(x, tuple):
            return tuple(ptr(y) for y in x)
        return x
    return {k: ptr(v) for k, v in args.items()}


def _launch_keys(monkeypatch, V=151936, D=64, follow_s=False):
    """(forward keys, combine keys) over TOKEN_COUNTS, splits chosen as on an H100."""
    fwd, comb = Recorder(lin._linear_logprob_fwd_kernel), Recorder(lin._combine_splits_kernel)
    monkeypatch.setattr(lin, "_linear_logprob_fwd_kernel", fwd)
    monkeypatch.setattr(lin, "_combine_splits_kernel", comb)
    num_splits, linear_fwd = tile_configs.num_splits, tile_configs.linear_fwd
    monkeypatch.setattr(tile_configs, "num_splits",
                        lambda n_blocks, n_tiles, group_n, device: num_splits(
                            n_blocks, n_tiles, group_n, None, sms=132))
    monkeypatch.setattr(tile_configs, "linear_fwd", lambda N, V, D, dtype, device: linear_fwd(
        N, V, D, dtype, None, arch=90))
    if follow_s:  # BLOCK_S from this launch's S (the forward's n_splits), as it once was
        combine = tile_configs.combine
        monkeypatch.setattr(tile_configs, "combine", lambda max_splits, device: combine(
            fwd.last["n_splits"], device))
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, D, generator=g).to(torch.bfloat16)
    splits = set()
    for N in TOKEN_COUNTS:
        hidden = torch.randn(N, D, generator=g).to(torch.bfloat16)
        targets = torch.randint(0, V, (N,), generator=g)
        cfg = tile_configs.linear_fwd(N, V, D, hidden.dtype, hidden.device)
        n_blocks = -(-N // cfg["BLOCK_N"])
        splits.add(tile_configs.num_splits(n_blocks, -(-V // cfg["BLOCK_V"]), cfg["GROUP_N"],
                                           None))
        lin.linear_logprob_forward(hidden, weight, None, targets, 1.0)
    return fwd.keys, comb.keys, splits


def test_forward_and_combine_compile_once_across_n(monkeypatch):
    fwd, comb, splits = _launch_keys(monkeypatch)
    assert len(splits) > 1, "the batch sizes should move the split count"
    assert len(fwd) == 1, fwd
    assert len(comb) == 1, comb


def test_a_block_that_follows_the_split_count_would_recompile(monkeypatch):
    # the check above can fail: with BLOCK_S taken from each launch's S the keys differ
    _, comb, splits = _launch_keys(monkeypatch, follow_s=True)
    assert len({1 << (s - 1).bit_length() for s in splits}) > 1
    assert len(comb) > 1
