"""Refuses a torch older than the admitted range, with one clear line (the op layer imports it
first, so the losses fail at import, not at a first call).

TORCH_RANGE is pyproject's torch requirement; docs/compatibility.md says what ran. Below 2.8:
torch 2.4-2.7 pin Triton 3.0-3.3 (their CUDA wheels cannot be installed next to Triton >= 3.4),
torch 2.6's torch.compile fails with Triton 3.4 (it imports triton's removed AttrsDescriptor),
and before 2.4 torch.library has no custom_op, which every op here is built with.
"""

from __future__ import annotations

import re

import torch

TORCH_RANGE = ">=2.8,<2.16"
OLDEST = (2, 8)


def check(version: str) -> None:
    """Raises ImportError when `version` (torch.__version__) is older than OLDEST."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) < OLDEST:
        raise ImportError(f"grpo-kernels needs torch{TORCH_RANGE}; found torch {version}")


check(torch.__version__)
