"""Static GPU tools: compile every kernel variant the launchers can launch for one CUDA
architecture without a GPU (`check.py`, run as `python -m grpo_kernels.compile_check`), the
variants themselves (`all_variants.py`: the linear head's in `kernel_variants.py`, the row
kernels' in `row_variants.py`), the SASS-based static report (`static_report.py`) and
its occupancy and time model (`perf_model.py`, a model, never a measurement)."""

from .check import main

__all__ = ["main"]
