"""The losses as PyTorch custom operators (torch.library), so that torch.compile traces a training
step that calls them (fullgraph=True) and treats each kernel call as one opaque node.

    grpo_kernels::linear_logprobs / linear_logprobs_backward        selective_logprobs
    grpo_kernels::logits_logprobs / logits_logprobs_backward[_]     logprobs_from_logits
    grpo_kernels::linear_grpo_loss                                   fused_linear_grpo_loss
    grpo_kernels::logits_grpo_loss                                   grpo_loss

The loss ops serve the fused token-level Triton path (GRPO epilogue inside the forward kernel).
Sequence-level ratios and the chunked backend call the selective log-prob op and run
`grpo_math` on [B, T] as ordinary (traceable) PyTorch around it.

The public functions keep the checks that need only shapes and dtypes in Python (traceable);
value checks (token ids in range, finite advantages) run inside the ops' eager implementations
(or, for code traced around them, as in-graph assertions), so nothing reads a tensor's value
while tracing. Hyperparameters are plain float/int/bool/str op arguments, metrics come back as
one float32 tensor [K] (names: `metric_names`).

The eager implementations run the launchers through `autograd.LinearHeadOp`/`LogitsOp` (with the
fallback of `fallback.py`). A loss op returns, besides the loss, the per-token statistics and the
loss' derivatives w.r.t. each token's logp and entropy (the "coefficients"); its backward is the
selective log-prob backward driven by g_loss × coefficients, as before (never logits saved).
"""

from __future__ import annotations

import importlib

import torch

from . import autograd, fallback
from .autograd import LinearHeadOp, LogitsOp
from .grpo_math import grpo_loss_from_logps, grpo_metrics, token_weights
from .params import GRPOParams
from .validation import LossInputs, check_finite_advantages, check_token_id_values

# GRPOParams fields, in the order the loss ops take them (schema below).
HYPER_NAMES = ("beta", "epsilon_low", "epsilon_high", "delta", "temperature", "loss_type",
               "importance_sampling_level", "max_completion_length", "use_bias_correction_kl",
               "entropy_coef", "sapo_temperature_pos", "sapo_temperature_neg")
HYPER_SCHEMA = ("float beta, float epsilon_low, float? epsilon_high, float? delta, "
                "float temperature, str loss_type, str importance_sampling_level, "
                "int? max_completion_length, bool use_bias_correction_kl, float entropy_coef, "
                "float sapo_temperature_pos, float sapo_temperature_neg")
GRPO_INPUTS = ("Tensor mask, Tensor advantages, Tensor? old_logps, Tensor? ref_logps, "
               "Tensor? importance_sampling_ratio, Tensor? num_items_tensor, "
               "float? num_items_value")
LOSS_OUT = "(Tensor loss, Tensor metrics, Tensor lse, Tensor entropy, Tensor coef_logp, " \
           "Tensor coef_entropy)"
F32 = torch.float32
OPS = torch.ops.grpo_kernels  # the operators defined below


def hyper_args(params: GRPOParams) -> tuple:
    return tuple(getattr(params, name) for name in HYPER_NAMES)


def metric_names(params: GRPOParams) -> tuple[str, ...]:
    """Keys of `grpo_metrics` for these hyperparameters, in order (tests/test_torch_compile.py
    checks them against grpo_metrics for every loss type)."""
    names = ["entropy"] + (["kl"] if params.beta != 0.0 else [])
    if params.is_clipped:
        names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    elif params.loss_type == "cispo":
        names.append("cispo_clip_ratio")
    return tuple(names)


def _impl(backend: str):
    # late import: selective_logprobs (the dispatch) imports this module
    return importlib.import_module(f"{__package__}.selective_logprobs").IMPLS[backend]


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


# ---- selective log-prob of a linear head ------------------------------------------------------

torch.library.define(
    "grpo_kernels::linear_logprobs",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, float temperature, "
    "float? grad_filter, str backend, str ids_name) -> (Tensor logp, Tensor entropy, Tensor lse)")
torch.library.define(
    "grpo_kernels::linear_logprobs_backward",
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor lse, Tensor entropy, "
    "Tensor g_logp, Tensor? g_entropy, float temperature, float? grad_filter, str backend, "
    "bool[] needs) -> (Tensor d_hidden, Tensor d_weight, Tensor d_bias)")


@torch.library.impl("grpo_kernels::linear_logprobs", "default")
def _linear_logprobs(hidden, weight, bias, targets, temperature, grad_filter, backend, ids_name):
    """hidden [N, D], weight [V, D], bias [V] | None, targets [N] int64 (contiguous)
    -> float32 (logp, entropy, lse), each [N]."""
    check_token_id_values(ids_name, targets, weight.shape[0], "weight.shape[0]")
    op = LinearHeadOp(_impl(backend), temperature, grad_filter)
    return op.forward(targets, None, hidden, weight, bias)


@torch.library.register_fake("grpo_kernels::linear_logprobs")
def _linear_logprobs_fake(hidden, weight, bias, targets, *args):
    return tuple(hidden.new_empty(hidden.shape[0], dtype=F32) for _ in range(3))


@torch.library.impl("grpo_kernels::linear_logprobs_backward", "default")
def _linear_logprobs_backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent,
                              temperature, grad_filter, backend, needs):
    """(d hidden, d weight, d bias) in the inputs' dtypes; an empty tensor where not needed."""
    op = LinearHeadOp(_impl(backend), temperature, grad_filter)
    grads = op.backward((hidden, weight, bias), targets, lse, ent, g_logp, g_ent, needs)
    return tuple(_empty(hidden) if g is None else g for g in grads)


@torch.library.register_fake("grpo_kernels::linear_logprobs_backward")
def _linear_logprobs_backward_fake(hidden, weight, bias, targets, lse, ent, g_logp, g_ent,
                                   temperature, grad_filter, backend, needs):
    wanted = (needs[0], needs[1], bias is not None and needs[2])
    return tuple(torch.empty_like(x) if want else _empty(hidden)
                 for x, want in zip((hidden, weight, bias), wanted))


# ---- selective log-prob from logits -----------------------------------------------------------

torch.library.define(
    "grpo_kernels::logits_logprobs",
    "(Tensor logits, Tensor targets, float temperature, str backend, str ids_name, "
    "bool inplace) -> (Tensor logp, Tensor entropy, Tensor lse)")
LOGITS_BWD_ARGS = ("Tensor targets, Tensor lse, Tensor entropy, Tensor g_logp, "
                   "Tensor? g_entropy, float temperature, str backend")
torch.library.define("grpo_kernels::logits_logprobs_backward",
                     f"(Tensor logits, {LOGITS_BWD_ARGS}) -> Tensor")
# in place: d logits overwrites the logits (inplace=True of the public functions, eager only)
torch.library.define("grpo_kernels::logits_logprobs_backward_",
                     f"(Tensor(a!) logits, {LOGITS_BWD_ARGS}) -> ()")


@torch.library.impl("grpo_kernels::logits_logprobs", "default")
def _logits_logprobs(logits, targets, temperature, backend, ids_name, inplace):
    """logits [B, T, V] (unit last stride), targets [B·T] int64 -> float32 (logp, ent, lse)."""
    check_token_id_values(ids_name, targets, logits.shape[-1], "logits.shape[-1]")
    return LogitsOp(_impl(backend), temperature).forward(targets, None, logits)


@torch.library.register_fake("grpo_kernels::logits_logprobs")
def _logits_logprobs_fake(logits, targets, *args):
    return tuple(logits.new_empty(targets.shape[0], dtype=F32) for _ in range(3))


def _logits_backward(logits, targets, lse, ent, g_logp, g_ent, temperature, backend, inplace):
    op = LogitsOp(_impl(backend), temperature, inplace)
    return op.backward((logits,), targets, lse, ent, g_logp, g_ent, (True,))[0]


@torch.library.impl("grpo_kernels::logits_logprobs_backward", "default")
def _logits_logprobs_backward(logits, *args):
    return _logits_backward(logits, *args, inplace=False)


@torch.library.impl("grpo_kernels::logits_logprobs_backward_", "default")
def _logits_logprobs_backward_inplace(logits, *args):
    _logits_backward(logits, *args, inplace=True)


@torch.library.register_fake("grpo_kernels::logits_logprobs_backward")
def _logits_logprobs_backward_fake(logits, *args):
    return torch.empty_like(logits)


@torch.library.register_fake("grpo_kernels::logits_logprobs_backward_")
def _logits_logprobs_backward_inplace_fake(logits, *args):
    return None


# ---- GRPO losses ------------------------------------------------------------------------------

torch.library.define(
    "grpo_kernels::linear_grpo_loss",
    f"(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, {GRPO_INPUTS}, "
    f"{HYPER_SCHEMA}, float? grad_filter, str backend) -> {LOSS_OUT}")
torch.library.define(
    "grpo_kernels::logits_grpo_loss",
    f"(Tensor logits, Tensor targets, {GRPO_INPUTS}, {HYPER_SCHEMA}, str backend, "
    f"bool inplace) -> {LOSS_OUT}")


def _loss_inputs(grpo_inputs) -> LossInputs:
    mask, adv, old, ref, isr, num_items_tensor, num_items_value = grpo_inputs
    check_finite_advantages(adv)
    num_items = num_items_tensor if num_items_tensor is not None else num_items_value
    return LossInputs(mask, adv, old, ref, isr, num_items)


def _loss_outputs(loss, metrics, lse, ent, coef_logp, coef_ent, like):
    values = list(metrics.values())
    stacked = torch.stack(values) if values else like.new_empty(0, dtype=F32)
    return (loss.detach().float().clone(), stacked.float(), lse, ent, coef_logp.contiguous(),
            _empty(lse) if coef_ent is None else coef_ent.contiguous())


@torch.library.impl("grpo_kernels::linear_grpo_loss", "default")
def _linear_grpo_loss(hidden, weight, bias, targets, *rest):
    """hidden [N, D], targets [N]; per-token inputs [B, T] (B·T = N), validated and float32."""
    grpo_inputs, hyper, (grad_filter, backend) = rest[:7], rest[7:19], rest[19:]
    check_token_id_values("completion_ids", targets, weight.shape[0], "weight.shape[0]")
    params = GRPOParams(**dict(zip(HYPER_NAMES, hyper)))
    op = LinearHeadOp(_impl(backend), params.temperature, grad_filter)
    terms = grpo_loss_terms(op, targets, (hidden, weight, bias), _loss_inputs(grpo_inputs),
                            params, backend == "triton")
    return _loss_outputs(*terms, like=hidden)


@torch.library.impl("grpo_kernels::logits_grpo_loss", "default")
def _logits_grpo_loss(logits, targets, *rest):
    """logits [B, T, V] (unit last stride), targets [B·T]."""
    grpo_inputs, hyper, (backend, inplace) = rest[:7], rest[7:19], rest[19:]
    check_token_id_values("completion_ids", targets, logits.shape[-1], "logits.shape[-1]")
    params = GRPOParams(**dict(zip(HYPER_NAMES, hyper)))
    op = LogitsOp(_impl(backend), params.temperature, inplace)
    terms = grpo_loss_terms(op, targets, (logits,), _loss_inputs(grpo_inputs), params,
                            backend == "triton")
    return _loss_outputs(*terms, like=logits)


def _loss_fake(targets, rest):
    params = GRPOParams(**dict(zip(HYPER_NAMES, rest[7:19])))
    n = targets.shape[0]
    new = lambda *shape: targets.new_empty(shape, dtype=F32)  # noqa: E731
    return (new(), new(len(metric_names(params))), new(n), new(n), new(n),
            new(n if params.entropy_coef != 0.0 else 0))


@torch.library.register_fake("grpo_kernels::linear_grpo_loss")
def _linear_grpo_loss_fake(hidden, weight, bias, targets, *rest):
    return _loss_fake(targets, rest)


@torch.library.register_fake("grpo_kernels::logits_grpo_loss")
def _logits_grpo_loss_fake(logits, targets, *rest):
    return _loss_fake(targets, rest)


def grpo_loss_terms(op, targets, tensors, inputs: LossInputs, params: GRPOParams, fused: bool):
    """Eager GRPO loss on a selective log-prob op: (loss 0-dim, metrics dict, lse [N],
    entropy [N], dloss/dlogp [N], dloss/dentropy [N] or None when entropy_coef == 0).

    fused (token level on Triton): the epilogue inside the forward kernel gives weight·ℓ and
    weight·dℓ/dlogp per token. Otherwise (a loss op called on the torch backend, or the fused
    kernel failed and fell back) `grpo_math` runs on [B, T] and torch.func.grad gives the
    coefficients (the operations autograd would record). That branch runs eagerly only: under
    AOTAutograd's tracing modes torch.func cannot see through the op's inputs, which is why
    the public functions route every unfused case around the loss ops."""
    fused = fused and params.importance_sampling_level == "token"
    if fused and op.failed(tensors[0]):
        op, fused = op.on_torch(), False  # the Triton kernels failed earlier (fallback.py)
    if fused:
        try:
            return _fused_terms(op, targets, tensors, inputs, params)
        except Exception as exc:
            # the epilogue runs only inside the Triton forward: a kernel that fails to compile
            # or launch re-runs unfused on the chunked PyTorch backend
            x = tensors[0]
            if not fallback.note_failure(exc, op.family, x.device, x.dtype,
                                         f"{op.family} forward with the GRPO epilogue"):
                raise
        op = op.on_torch()
    B, T = inputs.mask.shape
    logp, ent, lse = op.forward(targets, None, *tensors)

    def loss_of(logp, ent):
        return grpo_loss_from_logps(
            logp.reshape(B, T), ent.reshape(B, T), inputs.mask, inputs.advantages,
            inputs.old_logps, inputs.ref_logps, params, inputs.num_items_in_batch,
            inputs.importance_sampling_ratio)

    loss, metrics = loss_of(logp, ent)  # the values, outside the transform
    coef_logp, coef_ent = torch.func.grad(lambda lp, h: loss_of(lp, h)[0], (0, 1))(logp, ent)
    return loss, metrics, lse, ent, coef_logp, coef_ent if params.entropy_coef != 0.0 else None


def _fused_terms(op, targets, tensors, inputs: LossInputs, params: GRPOParams):
    from .fused_linear_grpo import epilogue_args  # late: fused_linear_grpo imports this module

    B, T = inputs.mask.shape
    weights, ent_norm = token_weights(inputs.mask, params, inputs.num_items_in_batch)
    epilogue = epilogue_args(params, inputs, weights)
    _, ent, lse = op.forward(targets, epilogue, *tensors)
    lossw, coef_logp, kl, ratio = epilogue["tensors"][5:9]  # filled by the kernel, [N]
    loss = lossw.sum()
    coef_ent = None
    if params.entropy_coef != 0.0:
        mask = inputs.mask.reshape(-1)
        loss = loss - params.entropy_coef * (ent * mask).sum() / ent_norm
        coef_ent = -params.entropy_coef * mask / ent_norm
    metrics = grpo_metrics(
        ent.reshape(B, T), ratio.reshape(B, T), kl.reshape(B, T) if params.beta != 0.0 else None,
        inputs.advantages, inputs.mask, params,
    )
    return loss, metrics, lse, ent, coef_logp, coef_ent


# ---- autograd (formulas in autograd.py) ------------------------------------------------------

N_LOSS_ARGS = 7 + len(HYPER_NAMES)  # GRPO inputs and hyperparameters after the kernel tensors


def _setup_loss(ctx, n_tensors, inputs, output):
    """Saves (kernel tensors, targets, lse, ent, coef_logp, coef_ent) of a loss op."""
    _, metrics, lse, ent, coef_logp, coef_ent = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(metrics, lse, ent, coef_logp, coef_ent)
    hyper = dict(zip(HYPER_NAMES, inputs[n_tensors + 1 + 7:n_tensors + 1 + N_LOSS_ARGS]))
    ctx.has_entropy_grad = hyper["entropy_coef"] != 0.0
    ctx.save_for_backward(*inputs[:n_tensors + 1], lse, ent, coef_logp, coef_ent)
    return hyper, inputs[n_tensors + 1 + N_LOSS_ARGS:]


def _setup_linear_loss(ctx, inputs, output):
    hyper, (grad_filter, backend) = _setup_loss(ctx, 3, inputs, output)
    ctx.config = (hyper["temperature"], grad_filter, backend)


def _linear_loss_backward(ctx, g_loss, *_):
    grads = autograd.linear_grads(ctx, *autograd.loss_token_grads(ctx, g_loss))
    return (*grads, *[None] * (1 + N_LOSS_ARGS + 2))


def _setup_logits_loss(ctx, inputs, output):
    hyper, (backend, inplace) = _setup_loss(ctx, 1, inputs, output)
    ctx.config = (hyper["temperature"], backend, inplace)


def _logits_loss_backward(ctx, g_loss, *_):
    grad = autograd.logits_grads(ctx, *autograd.loss_token_grads(ctx, g_loss))
    return (grad, *[None] * (1 + N_LOSS_ARGS + 2))


torch.library.register_autograd("grpo_kernels::linear_logprobs", autograd.linear_backward,
                                setup_context=autograd.setup_linear)
torch.library.register_autograd("grpo_kernels::logits_logprobs", autograd.logits_backward,
                                setup_context=autograd.setup_logits)
torch.library.register_autograd("grpo_kernels::linear_grpo_loss", _linear_loss_backward,
                                setup_context=_setup_linear_loss)
torch.library.register_autograd("grpo_kernels::logits_grpo_loss", _logits_loss_backward,
                                setup_context=_setup_logits_loss)
