"""Triton kernels and their launchers: the linear-head selective log-prob forward (with the fused
GRPO epilogue) and its two backwards (`linear_logprobs.py`, `linear_backward_gemm.py` with
`accumulate_mm.py`), the logits-input kernels (`logits_logprobs.py`), the per-token GRPO epilogue
(`epilogue.py`, the Triton twin of `grpo_math`), the optional logit soft cap and scale
(`logit_transform.py`), precision helpers and tile configurations."""
