"""Precision policy of the Triton dots: which `input_precision` a launch uses.

float32 inputs follow PyTorch's float32 matmul setting; 16-bit inputs always run the tensor
cores (their products are exact in float32, accumulation is float32).
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    # float32 follows PyTorch's own matmul setting (full precision unless tf32 was allowed)
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
