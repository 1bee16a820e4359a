"""grpo-kernels: fused Triton GRPO losses with TRL semantics, without full-vocabulary logits.

The public API lives in this package's root modules: `functional` (the losses and selective
log-probs), `modules` (their nn.Module forms), `params` (GRPOParams), `loss_specs` (the loss
types: an objective and a normalizer each), `objectives` (each objective's formulas),
`grpo_math` (the shared PyTorch math), `token_layouts` (the padded and packed token layouts),
`reference` (the pure-PyTorch twin that materializes logits) and `validation` (with
`option_checks`, the checks of the scalar options).
Subpackages hold the layers beneath (`kernels`: the Triton kernels, `chunked`: the chunked
PyTorch path, for CPU tensors and float64, `ops`: the custom operators and backends), the
integrations (`hf`, `trl`) and the static GPU tools (`compile_check`). `fallback_counts()` says
how many kernel calls ran on the chunked path because their Triton kernel failed to build
(`ops.fallback`).

Importing the package loads only `params` (no torch, no Triton), so that command lines can read
the hyperparameters' names and choices quickly; the functions and modules load on first use.
"""

from .params import ALL_LOSS_TYPES, LOSS_TYPES, GRPOParams

__all__ = [
    "ALL_LOSS_TYPES",
    "FusedLinearGRPOLoss",
    "GRPOLoss",
    "GRPOParams",
    "GRPOTerms",
    "LOSS_TYPES",
    "fallback_counts",
    "force_backend",
    "fused_linear_grpo_loss",
    "grpo_loss",
    "logprobs_from_logits",
    "selective_logprobs",
]
__version__ = "0.1.0"

_FUNCTIONAL = ("GRPOTerms", "fused_linear_grpo_loss", "grpo_loss", "logprobs_from_logits",
               "selective_logprobs")


def __getattr__(name: str):
    # PEP 562: the heavy modules (torch, Triton, the custom operators) load on first access
    if name in _FUNCTIONAL:
        from . import functional

        return getattr(functional, name)
    if name in ("FusedLinearGRPOLoss", "GRPOLoss"):
        from . import modules

        return getattr(modules, name)
    if name == "force_backend":
        from .ops.backends import force_backend

        return force_backend
    if name == "fallback_counts":
        from .ops.fallback import fallback_counts

        return fallback_counts
    raise AttributeError(f"module 'grpo_kernels' has no attribute {name!r}")
