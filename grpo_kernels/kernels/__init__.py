"""Triton kernels and their launchers: the linear-head selective log-prob forward (with the fused
GRPO epilogue, `linear_logprobs.py`) and its two backwards (`linear_backward_gemm.py` with
`accumulate_mm.py`; `linear_backward_atomic.py`; their d-logits tiles in `dlogits.py`), the
logits-input kernels (`logits_logprobs.py`), the per-token GRPO epilogue (`epilogue.py`, the
Triton twin of `grpo_math`), the optional logit soft cap and scale (`logit_transform.py`),
precision helpers and tile configurations."""
