"""pytest-benchmark suite: the same providers and inputs as `python -m benchmarks`.

    pytest benchmarks/ --benchmark-only                        # run and print the timings
    pytest benchmarks/ --benchmark-only --benchmark-autosave   # keep them for comparisons
    pytest benchmarks/ --benchmark-only --benchmark-compare    # against the last saved run

On CPU it times small shapes of the CPU paths: the chunked PyTorch backend of the fused linear
loss (its default route and the four-pass one), the reference, and one tiny case of the Triton
kernels through the interpreter (slow: one call is seconds). On CUDA (tests marked gpu) it times
a real head, Qwen2.5-0.5B at N=4096, bf16, both routes of ours, and Liger-Kernel when it is
installed. Each case also checks that the loss is finite, so a
regression run catches a kernel that got fast by getting wrong.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import flops, logits_bytes, make_shape
from benchmarks.providers import GRADED, PROVIDERS, LossConfig

CFG = LossConfig()  # dapo, beta 0.04, eps 0.2, old/ref log-probs given
TINY = make_shape("tiny", 256)  # D=128, V=4096, B=8, T=32 (synthetic head)
MICRO = make_shape("micro", 64, dims=(32, 256))  # interpreter-sized: D=32, V=256, B=8, T=8
GPU_HEAD = make_shape("qwen0.5b", 4096)  # D=896, V=151936, B=8, T=512


def _run(benchmark, device, kernel, name, shape, mode, dtype, cfg=CFG, rounds=5):
    provider = PROVIDERS[f"{kernel}/{name}"]
    reason = provider.unavailable(device)
    if reason is not None:
        pytest.skip(reason)
    case = provider.build(shape, dtype, device, cfg)
    loss = case.loss()
    assert torch.isfinite(loss).item(), f"{provider.key} gave a non-finite loss"
    del loss
    step = case.step(mode)
    grads = case.leaves if mode in GRADED else []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def setup():
        for t in grads:
            t.grad = None

    def target():
        step()
        sync()

    benchmark.group = f"{kernel} {shape.label} {mode}"
    benchmark.extra_info.update(
        provider=provider.key, shape=shape.detail, dtype=str(dtype), device=str(device),
        note=case.note,
        work=flops(shape, mode, case.positions) if kernel == "fused_linear"
        else logits_bytes(shape, mode, dtype.itemsize, case.positions),
        work_unit="FLOP" if kernel == "fused_linear" else "byte",
    )
    benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=1, iterations=1)
    route, wrong = case.route_check(mode)  # the route the calls took, as the sweep's rows say
    benchmark.extra_info["route"] = route
    assert wrong is None, f"{provider.key}: {wrong}"
    if grads:
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in grads)


# ---- CPU paths (also run on CUDA machines, where they time the CPU code on CPU tensors) ----

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["ours", "ours-4pass"])  # the default route, the four-pass one
@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_fused_linear_chunked_torch_cpu(benchmark, mode, name):
    cfg = LossConfig(backend="chunked")
    _run(benchmark, CPU, "fused_linear", name, TINY, mode, torch.bfloat16, cfg)


@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_fused_linear_reference_cpu(benchmark, mode):
    _run(benchmark, CPU, "fused_linear", "reference", TINY, mode, torch.bfloat16)


def test_logits_reference_cpu(benchmark):
    _run(benchmark, CPU, "logits", "reference", TINY, "fwd+bwd", torch.bfloat16)


def test_logits_ours_cpu(benchmark):
    # The logits-input API dispatches like the rest (interpreter here when it is switched on),
    # so it gets the interpreter-sized shape.
    _run(benchmark, CPU, "logits", "ours", MICRO, "fwd+bwd", torch.float32, rounds=2)


def test_fused_linear_triton_interpreter_cpu(benchmark):
    from grpo_kernels.kernels.tile_configs import INTERPRET

    if not INTERPRET:
        pytest.skip("Triton interpreter not enabled (TRITON_INTERPRET=1 before triton import)")
    cfg = LossConfig(backend="triton")
    _run(benchmark, CPU, "fused_linear", "ours", MICRO, "fwd+bwd", torch.float32, cfg, rounds=2)


# ---- CUDA: a real head ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ours", "ours-4pass", "reference", "liger"])
@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
def test_fused_linear_gpu(benchmark, device, name, mode):
    _run(benchmark, device, "fused_linear", name, GPU_HEAD, mode, torch.bfloat16, rounds=10)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ours", "reference", "liger"])
def test_logits_gpu(benchmark, device, name):
    _run(benchmark, device, "logits", name, GPU_HEAD, "fwd+bwd", torch.bfloat16, rounds=10)
