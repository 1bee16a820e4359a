"""The op layer between the kernels and the functional API: the backend registry and dispatch
(`backends.py`), the fallback safety net (`fallback.py`), a backend's launchers bound to an op's
options and the token-terms body (`launch.py`), the autograd formulas (`autograd.py`) and the
torch.library custom operators that tie them together (`custom_ops.py`; their float
hyperparameters as 0-d tensors, `op_scalars.py`)."""

from . import torch_check  # noqa: F401  (first: an unsupported torch fails here, in one line)
