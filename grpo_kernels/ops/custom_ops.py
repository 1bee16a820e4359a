"""The kernels as PyTorch custom operators (torch.library), so that torch.compile traces a training
step that calls them (fullgraph=True) and treats each kernel call as one opaque node.

    grpo_kernels::linear_logprobs / linear_logprobs_backward        selective_logprobs
    grpo_kernels::logits_logprobs / logits_logprobs_backward[_]     logprobs_from_logits
    grpo_kernels::linear_grpo_terms                                  the GRPO losses' token terms
    grpo_kernels::logits_grpo_terms                                  (functional.grpo_terms)

A token-terms op is the selective log-prob op plus, per token, the GRPO epilogue's weight·ℓ
(differentiable), weight·dℓ/dlogp, kl and the ratio: the fused token-level path. Aggregation
(Σ weight·ℓ, the entropy bonus, metrics) stays in PyTorch (`functional.py`, `grpo_math`).
Sequence-level ratios and the chunked backend call the selective log-prob op and run
`grpo_math` around it as ordinary (traceable) PyTorch.

Every op ends with the logit transform, `Tensor? softcap=None, Tensor? logit_scale=None`
(z = cap(s·y) before the temperature, kernels/logit_transform.py): defaults, so that a call
without them is the call it was before they existed. The temperature, the transform's values and
the float hyperparameters are 0-d float64 CPU tensors (`op_scalars.py`: a compiled step takes a
new value without a recompile); the bodies read them back as Python floats.

The public functions keep the checks that need only shapes and dtypes in Python (traceable);
value checks (token ids in range, finite advantages) run inside the ops' eager implementations
(or, for code traced around them, as in-graph assertions), so nothing reads a tensor's value
while tracing. A token-terms op's hyperparameters are only what the per-token loss reads, the
str/float/bool fields of `params.TokenLossArgs` (its `op_schema`), which the public
function builds once from its GRPOParams; the temperature is the op's own argument, as in the
selective log-prob ops.

The eager implementations run the launchers through `launch.LinearHeadOp`/`LogitsOp` (with the
fallback of `fallback.py`) on the backend the public function chose (`backends.py`). Backward
needs only per-token statistics (`autograd.py`; never logits saved; see `_LinearLogprobs` for
the eager chunked call that keeps a small problem's logits tile).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ..params import TokenLossArgs
from ..value_checks import check_finite_advantages, check_token_id_values
from . import autograd
from .backends import IMPLS
from .launch import LinearHeadOp, LogitsOp, grpo_token_terms
from .op_scalars import WithScalars, of_op

F32 = torch.float32
TRANSFORM_ARGS = "Tensor? softcap=None, Tensor? logit_scale=None"  # every op's last arguments


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


# ---- selective log-prob of a linear head ------------------------------------------------------

torch.library.define(
    "grpo_kernels::linear_logprobs",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor temperature, "
    f"float? grad_filter, str backend, str ids_name, {TRANSFORM_ARGS}) "
    "-> (Tensor logp, Tensor entropy, Tensor lse, Tensor lse_sum)")
torch.library.define(
    "grpo_kernels::linear_logprobs_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor lse, Tensor entropy, "
    "Tensor g_logp, Tensor? g_entropy, Tensor temperature, float? grad_filter, str backend, "
    f"bool[] needs, {TRANSFORM_ARGS}, Tensor? logp=None, Tensor? lse_sum=None) "
    "-> (Tensor d_hidden, Tensor d_weight, Tensor d_bias)")


def _linear_logprobs(hidden, weight, bias, targets, temperature, grad_filter, backend, ids_name,
                     softcap=None, logit_scale=None, keep=None):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64 (contiguous)
    -> float32 (logp, entropy, lse, lse_sum), each [N]. lse_sum: the chunked forward's
    S = Σ 2^(z - lse·log2(e)) (`chunked.tiles.reference_sums`), with which the chunked backward
    reads p to float32's precision (the lse alone, rounded at its magnitude, gives p to 2e-6
    at |lse| ≈ 40); 1 where the chunked launcher does not write it (a Triton forward, a soft
    cap): p through the lse alone. keep: see `_LinearLogprobs`."""
    check_token_id_values(ids_name, targets, weight.shape[0], "weight.shape[0]")
    op = LinearHeadOp(IMPLS[backend], temperature, grad_filter, softcap, logit_scale)
    lse_sum = hidden.new_ones(hidden.shape[0], dtype=F32)
    return (*op.forward(targets, None, hidden, weight, bias, keep=keep, lse_sum=lse_sum),
            lse_sum)


torch.library.impl("grpo_kernels::linear_logprobs", "default", _linear_logprobs)


@torch.library.register_fake("grpo_kernels::linear_logprobs")
def _linear_logprobs_fake(hidden, weight, bias, targets, *args):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=F32) for _ in range(4))


def _linear_logprobs_backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent,
                              temperature, grad_filter, backend, needs, softcap=None,
                              logit_scale=None, logp=None, lse_sum=None, kept=None):
    """(d hidden, d weight, d bias) in the inputs' dtypes; an empty tensor where not needed.
    logp: the forward's log-probs [N] or None; lse_sum: its S [N] or None
    (`LinearHeadOp.backward`)."""
    op = LinearHeadOp(IMPLS[backend], temperature, grad_filter, softcap, logit_scale)
    grads = op.backward((hidden, weight, bias), targets, lse, ent, g_logp, g_ent, needs,
                        kept=kept, logp=logp, lse_sum=lse_sum)
    return tuple(_empty(hidden) if g is None else g for g in grads)


torch.library.impl("grpo_kernels::linear_logprobs_backward", "default", _linear_logprobs_backward)


@torch.library.register_fake("grpo_kernels::linear_logprobs_backward")
def _linear_logprobs_backward_fake(hidden, weight, bias, targets, lse, ent, g_logp, g_ent,
                                   temperature, grad_filter, backend, needs, *transform):
    wanted = (needs[0], needs[1], bias is not None and needs[2])
    return tuple(torch.empty_like(x) if want else _empty(hidden)
                 for x, want in zip((hidden, weight, bias), wanted))


# ---- selective log-prob from logits -----------------------------------------------------------

torch.library.define(
    "grpo_kernels::logits_logprobs",
    "(Tensor logits, Tensor targets, Tensor temperature, str backend, str ids_name, "
    f"bool inplace, {TRANSFORM_ARGS}) "
    "-> (Tensor logp, Tensor entropy, Tensor lse, Tensor lse_terms)")
LOGITS_BWD_ARGS = ("Tensor targets, Tensor lse, Tensor entropy, Tensor g_logp, "
                   f"Tensor? g_entropy, Tensor temperature, str backend, {TRANSFORM_ARGS}, "
                   "Tensor? logp=None, Tensor? lse_terms=None")
torch.library.define("grpo_kernels::logits_logprobs_backward",
                     f"(Tensor logits, {LOGITS_BWD_ARGS}) -> Tensor")
# in place: d logits overwrites the logits (inplace=True of the public functions, eager only)
torch.library.define("grpo_kernels::logits_logprobs_backward_",
                     f"(Tensor(a!) logits, {LOGITS_BWD_ARGS}) -> ()")


def _logits_logprobs(logits, targets, temperature, backend, ids_name, inplace, softcap=None,
                     logit_scale=None, keep=None):
    """logits [B, T, V] (unit last stride), targets [B·T] int64 -> float32 (logp, ent, lse)
    [B·T] each and lse_terms [2, B·T]: the Triton forward's m and log s (lse = m + log s), for
    its backward to read p as it formed it; (lse, 0) from the chunked launcher
    (`LogitsOp.forward`). keep: see `_LogitsLogprobs`."""
    check_token_id_values(ids_name, targets, logits.shape[-1], "logits.shape[-1]")
    op = LogitsOp(IMPLS[backend], temperature, softcap=softcap, logit_scale=logit_scale)
    return op.forward(targets, None, logits, keep=keep)


torch.library.impl("grpo_kernels::logits_logprobs", "default", _logits_logprobs)


@torch.library.register_fake("grpo_kernels::logits_logprobs")
def _logits_logprobs_fake(logits, targets, *args):
    n = targets.shape[0]
    return (*(logits.new_empty(n, dtype=F32) for _ in range(3)),
            logits.new_empty(2, n, dtype=F32))


def _logits_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, backend,
                     softcap=None, logit_scale=None, logp=None, lse_terms=None, *, inplace,
                     kept=None):
    """logp: the forward's log-probs [B·T] or None; lse_terms: its (m, log s) [2, B·T] or
    None (`LogitsOp.backward`)."""
    op = LogitsOp(IMPLS[backend], temperature, inplace, softcap, logit_scale)
    return op.backward((logits,), targets, lse, ent, g_logp, g_ent, (True,), kept=kept,
                       logp=logp, lse_terms=lse_terms)[0]


def _logits_logprobs_backward(logits, *args, kept=None, **kw):
    return _logits_backward(logits, *args, inplace=False, kept=kept, **kw)


def _logits_logprobs_backward_inplace(logits, *args, kept=None, **kw):
    _logits_backward(logits, *args, inplace=True, kept=kept, **kw)


torch.library.impl("grpo_kernels::logits_logprobs_backward", "default", _logits_logprobs_backward)
torch.library.impl("grpo_kernels::logits_logprobs_backward_", "default",
                   _logits_logprobs_backward_inplace)


@torch.library.register_fake("grpo_kernels::logits_logprobs_backward")
def _logits_logprobs_backward_fake(logits, *args):
    return torch.empty_like(logits)


@torch.library.register_fake("grpo_kernels::logits_logprobs_backward_")
def _logits_logprobs_backward_inplace_fake(logits, *args):
    return None


# ---- GRPO token terms -------------------------------------------------------------------------
# The GRPO arguments of a token-terms op, each [N] float32 in the kernels' token order, then the
# hyperparameters (TokenLossArgs' fields). Outputs, each [N] float32: logp and entropy
# (differentiable), lse, weight·ℓ (differentiable), weight·dℓ/dlogp, kl (0 when beta == 0) and
# the importance ratio; the logits op's also lse_terms [2, N] (`_logits_logprobs`).
TERMS_ARGS = ("Tensor weights, Tensor advantages, Tensor? old_logps, Tensor? ref_logps, "
              "Tensor? importance_sampling_ratio, " + TokenLossArgs.op_schema())
TERMS_OUT = ("(Tensor logp, Tensor entropy, Tensor lse, Tensor token_loss, Tensor coef_logp, "
             "Tensor kl, Tensor ratio)")
torch.library.define(
    "grpo_kernels::linear_grpo_terms",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor temperature, "
    f"float? grad_filter, str backend, {TERMS_ARGS}, {TRANSFORM_ARGS}) -> {TERMS_OUT}")
torch.library.define(
    "grpo_kernels::logits_grpo_terms",
    "(Tensor logits, Tensor targets, Tensor temperature, str backend, bool inplace, "
    f"{TERMS_ARGS}, "
    f"{TRANSFORM_ARGS}) -> {TERMS_OUT[:-1]}, Tensor lse_terms)")


def _terms(op, targets, tensors, grpo_args):
    weights, advantages, old, ref, isr, *values = grpo_args
    check_finite_advantages(advantages)
    rule = TokenLossArgs.of_op_args([of_op(v) for v in values])
    return grpo_token_terms(op, targets, tensors, rule, weights, advantages, old, ref, isr)


@torch.library.impl("grpo_kernels::linear_grpo_terms", "default")
def _linear_grpo_terms(hidden, weight, bias, targets, temperature, grad_filter, backend, *args):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64 (contiguous)."""
    check_token_id_values("completion_ids", targets, weight.shape[0], "weight.shape[0]")
    grpo_args, softcap, logit_scale = autograd.split_terms_args(args)
    op = LinearHeadOp(IMPLS[backend], temperature, grad_filter, softcap, logit_scale)
    return _terms(op, targets, (hidden, weight, bias), grpo_args)


@torch.library.impl("grpo_kernels::logits_grpo_terms", "default")
def _logits_grpo_terms(logits, targets, temperature, backend, inplace, *args):
    """logits [B, T, V] (unit last stride), targets [B·T]."""
    check_token_id_values("completion_ids", targets, logits.shape[-1], "logits.shape[-1]")
    grpo_args, softcap, logit_scale = autograd.split_terms_args(args)
    op = LogitsOp(IMPLS[backend], temperature, inplace, softcap, logit_scale)
    return _terms(op, targets, (logits,), grpo_args)


def _terms_fake(targets):
    return tuple(targets.new_empty(targets.shape[0], dtype=F32) for _ in range(7))


@torch.library.register_fake("grpo_kernels::linear_grpo_terms")
def _linear_grpo_terms_fake(hidden, weight, bias, targets, *args):
    return _terms_fake(targets)


@torch.library.register_fake("grpo_kernels::logits_grpo_terms")
def _logits_grpo_terms_fake(logits, targets, *args):
    return (*_terms_fake(targets), targets.new_empty(2, targets.shape[0], dtype=F32))


torch.library.register_autograd("grpo_kernels::linear_logprobs", autograd.linear_backward,
                                setup_context=autograd.setup_linear)
torch.library.register_autograd("grpo_kernels::logits_logprobs", autograd.logits_backward,
                                setup_context=autograd.setup_logits)
torch.library.register_autograd("grpo_kernels::linear_grpo_terms",
                                autograd.linear_terms_backward,
                                setup_context=autograd.setup_linear_terms)
torch.library.register_autograd("grpo_kernels::logits_grpo_terms",
                                autograd.logits_terms_backward,
                                setup_context=autograd.setup_logits_terms)


# ---- eager calls of the selective log-prob ops ------------------------------------------------
# Called from Python, `torch.ops.grpo_kernels.linear_logprobs` (or logits_logprobs) reaches the
# eager body above through torch.library's Python autograd wrapper and a redispatch, and its
# backward through a second operator call: together about 0.13 ms per forward + backward on one
# core of an AMD EPYC (torch 2.13), which a small problem feels (the tiny benchmark head at
# N = 256: ~1.5 % of the fused loss, ~5 % of the logits loss, and a longer serial stretch between
# parallel regions, during which a busy machine may take the intra-op threads' cores). A plain
# eager call on the chunked backend runs the same bodies in a torch.autograd.Function with the
# same autograd formulas instead. Every call that something may need to see as the operator goes
# through the operator: under torch.compile or export, under a dispatch or function mode
# (FakeTensorMode, a tracer, a memory tracker), under a functorch transform, with tensor
# subclasses other than nn.Parameter (DTensor, FakeTensor), and on the Triton backend.


def direct(*tensors) -> bool:
    """May a call with these tensor arguments run as the autograd.Function (see above)?"""
    if torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    # an nn.Parameter (every model's lm_head.weight) is a plain tensor here: it only marks a
    # module attribute and disables __torch_function__; DTensor, FakeTensor and other
    # subclasses keep the operator
    return all(t is None or type(t) in _PLAIN for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _LinearLogprobs(torch.autograd.Function):
    """grpo_kernels::linear_logprobs in eager mode: same inputs, outputs, saved tensors and
    backward as the operator's registration, plus one thing the operator cannot do: when a
    gradient will be needed and the [N, V] logits fit one tile of the chunked path
    (`chunked.blocks.KEEP_ELEMENTS`, 32 MiB of float32), the forward keeps that tile on ctx and the
    backward starts from it instead of recomputing it, one GEMM fewer for small problems. The
    backward takes it off ctx (it overwrites the tile), so a second backward
    (retain_graph=True) recomputes."""

    @staticmethod
    def call(*inputs):
        hidden, weight, bias = inputs[:3]
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias))
        return _LinearLogprobs.apply(*inputs, grad)

    @staticmethod
    def forward(ctx, *args):
        *inputs, keep_tile = args  # the flag last: needs_input_grad[:3] stays the operator's
        ctx.kept = {} if keep_tile else None
        output = _linear_logprobs(*inputs, keep=ctx.kept)
        autograd.setup_linear(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable  # as the operator: its backward op has no autograd formula
    def backward(ctx, g_logp, g_ent, g_lse, g_lse_sum):
        kept, ctx.kept = ctx.kept, None
        grads = autograd.linear_backward(
            ctx, g_logp, g_ent, g_lse, g_lse_sum,
            backward=functools.partial(_linear_logprobs_backward, kept=kept))
        return *grads, None


class _LogitsLogprobs(torch.autograd.Function):
    """grpo_kernels::logits_logprobs in eager mode (see `_LinearLogprobs`): when a gradient will
    be needed, the forward keeps each token's softmax statistics in the chunked path's own
    units on ctx ([B·T] twice, `chunked.logits_launchers.logits_logprob_forward`), so that its
    backward reads p without the lse in nats, whose float32 rounding at a large |lse| the
    one-hot's cancellation (1 - p of a dominant token) would show. A second backward reads the
    lse."""

    @staticmethod
    def call(*inputs):
        grad = torch.is_grad_enabled() and inputs[0].requires_grad
        return _LogitsLogprobs.apply(*inputs, grad)

    @staticmethod
    def forward(ctx, *args):
        *inputs, keep = args  # the flag last: needs_input_grad[0] stays the operator's
        ctx.kept = {} if keep else None
        output = _logits_logprobs(*inputs, keep=ctx.kept)
        autograd.setup_logits(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent, g_lse, g_lse_terms):
        kept, ctx.kept = ctx.kept, None
        grads = autograd.logits_backward(
            ctx, g_logp, g_ent, g_lse, g_lse_terms,
            backward=(functools.partial(_logits_logprobs_backward, kept=kept),
                      functools.partial(_logits_logprobs_backward_inplace, kept=kept)))
        return *grads, None


class _EagerFirst:
    """An operator packet that a plain eager call on the chunked backend (args[backend_at] ==
    "chunked", `direct` on the first `tensors` arguments) runs as `function` instead; every
    attribute (`.default`, the schema) is the operator's."""

    def __init__(self, packet, function, backend_at: int, tensors: int):
        self.packet, self.function = packet, function
        self.backend_at, self.tensors = backend_at, tensors

    def __call__(self, *args):
        if args[self.backend_at] == "chunked" and direct(*args[:self.tensors]):
            return self.function.call(*args)
        return self.packet(*args)

    def __getattr__(self, name):
        return getattr(self.packet, name)


class _Operators:
    """`torch.ops.grpo_kernels` as the public functions call it: the selective log-prob ops
    through `_EagerFirst`, these four taking Python numbers for their hyperparameter tensors
    (`op_scalars.WithScalars`), every other name the operator itself."""

    def __init__(self, ops):
        self._ops = ops
        self.linear_logprobs = _EagerFirst(WithScalars(ops.linear_logprobs), _LinearLogprobs, 6,
                                           4)
        self.logits_logprobs = _EagerFirst(WithScalars(ops.logits_logprobs), _LogitsLogprobs, 3,
                                           2)
        self.linear_grpo_terms = WithScalars(ops.linear_grpo_terms)
        self.logits_grpo_terms = WithScalars(ops.logits_grpo_terms)

    def __getattr__(self, name):
        return getattr(self._ops, name)


OPS = _Operators(torch.ops.grpo_kernels)  # the operators defined above
