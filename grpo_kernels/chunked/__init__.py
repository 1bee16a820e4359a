"""The chunked PyTorch path (`launchers.py`, its per-tile operations in `tiles.py`): the same four
launchers as the Triton kernels, for CPU tensors and float64, holding one [chunk, V] block of
logits at a time; `softcap.py` takes the calls with a logit soft cap (or, for logits input, a
logit scale). Its backend name is "chunked" (`ops/backends.py`)."""
