"""The chunked PyTorch path: the same four launchers as the Triton kernels, for CPU tensors and
float64, holding one [chunk, V] block of logits at a time. The linear head's are in
`linear_launchers.py`, those of given logits in `logits_launchers.py`, their per-tile operations
in `tiles.py`; `softcap.py` takes the calls with a logit soft cap (or, for logits input, a logit
scale). This package is the "chunked" backend (`ops/backends.py`): it holds the four launchers
under the names the Triton backend gives its own."""

from .linear_launchers import linear_logprob_backward, linear_logprob_forward
from .logits_launchers import logits_logprob_backward, logits_logprob_forward

__all__ = [
    "linear_logprob_backward",
    "linear_logprob_forward",
    "logits_logprob_backward",
    "logits_logprob_forward",
]
