"""Which route a linear-head GRPO loss call or selective log-prob call takes, and one log line
that says which and why.

    three-pass   the loss is a scalar with a gradient and each token's loss reads its own
                 log-prob: per chunk of whole vocabulary rows, the logits, their statistics, the
                 GRPO math, the d-logits and the two gradient products, all in the forward
                 (`three_pass.py`); three [N, V, D] matrix products. Between forward and backward
                 it holds the input gradients, which the backward only scales.
    four-pass    the token-terms op (Triton) or the selective log-prob op and `grpo_math`
                 (chunked): the forward keeps per-token statistics and the backward recomputes
                 the logits; four products, and only [N] statistics held between the passes.
                 It is the minimum-memory setting: GRPO_KERNELS_THREE_PASS=0. A selective
                 log-prob call with a gradient runs the same forward and backward (its op).
    forward-only no gradient wanted, on the Triton backend: the three-pass route's first half,
                 per chunk of rows the library GEMM (cuBLAS on CUDA) into a float32 [C, V]
                 logits buffer, then the Triton row forward (with the GRPO epilogue for a loss):
                 `kernels.linear_loss_grad.linear_logprob_forward_gemm`. A library GEMM runs
                 near the GPU's matmul peak where the fused forward kernel's GEMM does not (a
                 model estimate for an 8B head: about half the fused forward's time). The
                 chunked backend keeps its four-pass forward, and so does a selective log-prob
                 call that something may need to see as the operator (torch.compile, a dispatch
                 mode, a tensor subclass) and a vocabulary-parallel head.

The chunks of the three-pass route are whole rows [C, V] within a memory budget: the backend's
default (`chunked.loss_grad.CPU_BUDGET_BYTES`, `kernels.linear_loss_grad.CUDA_BUDGET_BYTES`) or
GRPO_KERNELS_CHUNK_MIB. Each backend turns the budget into rows (its `chunk_rows`); the
forward-only route's chunks follow the same budget (on Triton the same rows: the three-pass
route writes its d-logits over its logits).

The decision reads only what a trace sees as constant (shapes, dtypes, requires_grad, grad mode,
the environment), so torch.compile traces it; the log line is written by `_log_route`, which
dynamo runs as a constant function at trace time instead of tracing it (a logger call inside a
fullgraph trace is an error). One INFO line per (call, route, reason) per process, on the
"grpo_kernels" logger.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from ..chunked import loss_grad as chunked_loss_grad
from ..kernels import linear_loss_grad as triton_loss_grad
from ..params import GRPOParams

ENV = "GRPO_KERNELS_THREE_PASS"  # "0": the four-pass route everywhere (minimum memory)
CHUNK_ENV = "GRPO_KERNELS_CHUNK_MIB"  # the three-pass route's chunk budget, MiB

_LOG = logging.getLogger("grpo_kernels")
_LOGGED: set = set()  # the (route, reason) pairs already logged in this process


THREE_PASS, FOUR_PASS, FORWARD_ONLY = "three-pass", "four-pass", "forward-only"  # the routes
LOSS, LOGPROBS = "linear-head loss", "selective log-probs"  # the calls that take a route


class Route(NamedTuple):
    path: str  # THREE_PASS, FOUR_PASS or FORWARD_ONLY
    reason: str

    @property
    def three_pass(self) -> bool:
        return self.path == THREE_PASS

    @property
    def forward_only(self) -> bool:
        return self.path == FORWARD_ONLY


def chunk_budget_bytes(backend: str) -> int:
    """The three-pass route's chunk budget in bytes: GRPO_KERNELS_CHUNK_MIB if set, else the
    backend's default."""
    text = os.environ.get(CHUNK_ENV, "").strip()
    if not text:
        return (chunked_loss_grad.CPU_BUDGET_BYTES if backend == "chunked"
                else triton_loss_grad.CUDA_BUDGET_BYTES)
    try:
        mib = float(text)
    except ValueError:
        mib = float("nan")
    if not mib > 0 or mib == float("inf"):
        raise ValueError(f"{CHUNK_ENV} must be a number of MiB > 0 (the three-pass route's chunk "
                         f"budget), got {text!r}")
    return int(mib * 2**20)


def linear_loss_route(hidden, weight, bias, backend: str, params: GRPOParams, softcap=None,
                      grad_filter=None, per_token_outputs: bool = False, vocab_parallel=None,
                      logit_scale=None) -> Route:
    """Which route a linear-head GRPO loss call takes (three-pass, four-pass or forward-only),
    and why. hidden [N, D], weight [V, D], bias [V] | None: the tensors the head's op would get.
    The route is logged once per (route, reason). vocab_parallel: a vocabulary-parallel head's
    `parallel.VocabShard` (this rank's weight is one shard): see `_vocab_parallel`."""
    if vocab_parallel is not None:
        route = _vocab_parallel(hidden, weight, bias, backend, params, softcap, grad_filter,
                                per_token_outputs, vocab_parallel, logit_scale)
    else:
        route = _decide(hidden, weight, bias, backend, params, softcap, grad_filter,
                        per_token_outputs)
    _log_route(LOSS, route.path, route.reason)
    return route


def logprobs_route(hidden, weight, bias, backend: str, direct: bool) -> Route:
    """Which route a selective log-prob call (`functional.selective_logprobs`, a whole head)
    takes: forward-only when no gradient is wanted on the Triton backend, else its op (the
    four-pass forward and backward). hidden [N, D], weight [V, D], bias [V] | None. direct:
    may the call skip the operator (`custom_ops.direct`: not traced, no dispatch mode, plain
    tensors or nn.Parameter)? Logged once per (route, reason)."""
    route = _logprobs(hidden, weight, bias, backend, direct)
    _log_route(LOGPROBS, route.path, route.reason)
    return route


def vocab_parallel_logprobs_route(shard) -> Route:
    """The route of a vocabulary-parallel head's selective log-probs (`parallel.logprobs`):
    always four passes, with or without a gradient. Logged once per (route, reason)."""
    route = Route(FOUR_PASS, f"vocabulary-parallel head ({shard.form}, {shard.world} shards): "
                             "this rank's fused forward, the statistics combined over the group")
    _log_route(LOGPROBS, route.path, route.reason)
    return route


def _logprobs(hidden, weight, bias, backend, direct) -> Route:
    why = _no_gradient(hidden, weight, bias)
    if why is None:
        return Route(FOUR_PASS, "a gradient may be wanted: the op's fused forward, and a "
                                "backward that recomputes the logits")
    if os.environ.get(ENV, "1").strip() == "0":
        return Route(FOUR_PASS, f"{why}; {ENV}=0 (the minimum-memory setting): the fused "
                                "forward")
    if backend != "triton":
        return Route(FOUR_PASS, f"{why}; the {backend} backend's forward")
    if not direct:
        return Route(FOUR_PASS, f"{why}; a call seen as the operator (torch.compile, a dispatch "
                                "mode or a tensor subclass): the operator's fused forward")
    return _forward_only(why, backend, epilogue=False)


def _no_gradient(hidden, weight, bias) -> str | None:
    """Why a call wants no gradient, or None when it may want one."""
    if not torch.is_grad_enabled():
        return "no gradient: grad mode is off"
    if not any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return "no gradient: neither the hidden states nor the head require grad"
    return None


def _forward_only(why: str, backend: str, epilogue: bool) -> Route:
    budget = chunk_budget_bytes(backend)
    rows = "the Triton row forward with the GRPO epilogue" if epilogue else "the Triton row forward"
    return Route(FORWARD_ONLY, f"{why}; forward only: cuBLAS chunks + row kernel (per chunk of "
                               f"rows the library GEMM into float32 [C, V] logits, then {rows}; "
                               f"chunks within {budget / 2**20:g} MiB, {backend} backend)")


def _vocab_parallel(hidden, weight, bias, backend, params, softcap, grad_filter,
                    per_token_outputs, shard, logit_scale) -> Route:
    """The route of a vocabulary-parallel head (grpo_kernels/parallel): the whole head's rules
    at the largest shard (every rank of the group decides alike, `VocabShard.max_rows`), and a
    negative logit scale keeps the four-pass route (the parallel three-pass folds the scale into
    the temperature). The reason names the head's form and its shards."""
    prefix = f"vocabulary-parallel head ({shard.form}, {shard.world} shards): "
    if logit_scale is not None and logit_scale < 0:
        return Route(FOUR_PASS, prefix + "a negative logit scale")
    route = _decide(hidden, weight, bias, backend, params, softcap, grad_filter,
                    per_token_outputs, rows=shard.max_rows)
    if route.forward_only:  # the parallel three-pass computes gradients: the four-pass forward
        return Route(FOUR_PASS, prefix + _no_gradient(hidden, weight, bias) + "; the "
                     "vocabulary-parallel four-pass forward")
    return Route(route.path, prefix + route.reason)


def _decide(hidden, weight, bias, backend, params, softcap, grad_filter,
            per_token_outputs, rows=None) -> Route:
    """rows: the vocabulary rows to size the chunks by (default: weight.shape[0])."""
    def no(reason):
        return Route(FOUR_PASS, reason)

    if per_token_outputs:
        return no("per-token outputs asked for (return_terms): they stay differentiable")
    if os.environ.get(ENV, "1").strip() == "0":
        return no(f"{ENV}=0 (the minimum-memory setting)")
    if params.needs_whole_sequences:
        return no("sequence-level ratios, a per-sequence loss type or a sequence/batch option: "
                  "every token of a sequence is needed before any token's gradient, and a chunk "
                  "of rows does not hold whole sequences")
    if softcap is not None:
        return no("soft cap: the capped head keeps its four-pass route")
    why = _no_gradient(hidden, weight, bias)
    if why is not None:  # grad_filter concerns only a backward
        return no(why) if backend == "chunked" else _forward_only(why, backend, epilogue=True)
    if grad_filter is not None:
        return no("grad_filter: the four-pass backward filters its tiles")
    budget = chunk_budget_bytes(backend)
    if backend == "chunked":
        V, D = weight.shape
        V = V if rows is None else rows
        # a frozen head gets no d W accumulator from the launcher: budget none for it
        rows, why_not = chunked_loss_grad.chunk_rows(hidden.shape[0], V, D, weight.dtype, budget,
                                                     want_dw=weight.requires_grad)
        if rows is None:
            return no(why_not)
    return Route(THREE_PASS, f"scalar loss with a gradient, token-level loss: chunks of whole "
                       f"vocabulary rows within {budget / 2**20:g} MiB ({backend} backend)")


@torch.compiler.assume_constant_result
def _log_route(call: str, path: str, reason: str) -> str:
    """Logs a route of `call` (LOSS or LOGPROBS) the first time it is taken in this process.
    Dynamo calls it with constant arguments while tracing (assume_constant_result) rather than
    tracing the logger."""
    key = (call, path, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        _LOG.info("grpo_kernels: %s on the %s route: %s", call, path, reason)
    return path
