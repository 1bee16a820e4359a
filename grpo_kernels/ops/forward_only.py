"""The selective log-prob of a linear head on the forward-only route (`route.py`): a call that
wants no gradient (scoring old or reference log-probs) on the Triton backend.

Per chunk of rows the library GEMM (cuBLAS on CUDA, `kernels/gemm.py`) writes the raw logits
into one float32 [C, V] buffer, then the Triton row forward gives (logp, entropy, lse) of those
rows: `kernels.linear_loss_grad.linear_logprob_forward_gemm`, the first half of the three-pass
route. The fused forward kernel of the four-pass route computes the same values with its GEMM
inside Triton. Nothing is saved for a backward (there is none). The chunks follow the route's
budget (`route.chunk_budget_bytes`).

A kernel that fails to build runs the chunked PyTorch forward instead (`fallback.py`, under its
own variant key "forward-only").
"""

from __future__ import annotations

import torch

from ..kernels import linear_loss_grad as triton_loss_grad
from ..value_checks import check_token_id_values
from . import fallback
from .backends import IMPLS
from .launch import LinearHeadOp
from .route import chunk_budget_bytes


def linear_logprobs(hidden, weight, bias, targets, temperature: float, ids_name: str,
                    softcap=None, logit_scale=None) -> tuple:
    """hidden [N, D], weight [V, D], bias [V] | None (contiguous), targets [N] int64
    (contiguous) -> float32 (logp, entropy, lse), each [N], none of them differentiable.
    ids_name: the targets' argument name for the range check's error."""
    check_token_id_values(ids_name, targets, weight.shape[0], "weight.shape[0]")
    head = (hidden, weight, bias)
    op = LinearHeadOp(IMPLS["triton"], temperature, softcap=softcap, logit_scale=logit_scale)
    budget = chunk_budget_bytes("triton")

    def on_triton():
        return triton_loss_grad.linear_logprob_forward_gemm(
            hidden, weight, bias, targets, temperature, budget_bytes=budget, softcap=softcap,
            logit_scale=logit_scale)

    def on_torch():
        return op.on_torch().forward(targets, None, *head)

    with torch.no_grad():
        return fallback.run(op.variant("forward-only", head), hidden.device, on_triton, on_torch)
