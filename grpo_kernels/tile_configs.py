"""Tile shapes and launch options of every Triton kernel, in one place.

The launchers ask here for their meta-parameters; `compile_check` asks the same functions, so the
variants it compiles are the ones that launch. CPU tensors (the Triton interpreter) get small
tiles so that tests cover several tiles per dimension quickly.
"""

from __future__ import annotations

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _small(device: torch.device) -> bool:
    return INTERPRET or device.type != "cuda"


def linear_fwd(N: int, V: int, D: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Forward of the linear-head log-prob (`linear_logprobs._linear_logprob_fwd_kernel`)."""
    if _small(device):
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=32, GROUP_N=2, num_warps=4, num_stages=1)
    # Tile shapes chosen from the sm_90 resource report (python -m grpo_kernels.compile_check):
    # the largest tiles whose softmax temporaries fit in registers without spilling.
    if dtype == torch.float32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=16, num_warps=8, num_stages=3)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=32, GROUP_N=16, num_warps=8, num_stages=3)


def num_splits(n_blocks: int, n_tiles: int, group_n: int, device: torch.device) -> int:
    """Vocabulary splits: enough that GROUP_N token blocks × splits fill the GPU (the grouped
    order of the forward), and more for small N so that there are two programs per SM."""
    if _small(device):
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(triton.cdiv(sms, group_n), triton.cdiv(2 * sms, n_blocks))
    return max(1, min(want, n_tiles // 4, 64))


def linear_bwd_atomic(dtype: torch.dtype, device: torch.device) -> dict:
    """Atomic backward (`linear_logprobs._linear_logprob_bwd_kernel`)."""
    if _small(device):
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=32, GROUP_N=4, num_warps=4, num_stages=1)
    # No-spill shapes on sm_90; the dz tile and two dot results are live at once.
    if dtype == torch.float32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=16, GROUP_N=8, num_warps=8, num_stages=2)
    return dict(BLOCK_N=128, BLOCK_V=64, BLOCK_D=32, GROUP_N=8, num_warps=8, num_stages=2)


def linear_dz(dtype: torch.dtype, device: torch.device) -> dict:
    """d-logits kernel of the GEMM backward (`linear_backward_gemm._linear_dz_kernel`)."""
    if _small(device):
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=32, GROUP_N=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, GROUP_N=8, num_warps=8, num_stages=3)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=32, GROUP_N=8, num_warps=8, num_stages=3)


def logits(V: int, device: torch.device) -> dict:
    """Logits-input kernels (`logits_logprobs`)."""
    if _small(device):
        return dict(ROWS=4, BLOCK_V=64, num_warps=4)
    # one row per program streams V in 16-byte-per-thread chunks; small V packs rows together
    block = min(triton.next_power_of_2(V), 8192)
    rows = max(1, min(16, 8192 // triton.next_power_of_2(V)))
    return dict(ROWS=rows, BLOCK_V=block, num_warps=8 if rows * block >= 4096 else 4)
