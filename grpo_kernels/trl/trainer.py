"""TRL integration: a `GRPOTrainer` that computes its GRPO loss from hidden states, no logits.

    from grpo_kernels.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer

or patched in, `trl.GRPOTrainer = GRPOTrainer`: the same trainer either way (TRL's class and
module are bound at import, nothing is looked up through trl.GRPOTrainer later).

Everything else (GRPOConfig, generation, rewards, advantages, logging) is TRL's. What changes:

- The training loss (`_compute_loss`) runs the model body only, takes the hidden states of the
  completion positions ([B, T, D]) and gets log-probs and entropies from the fused linear kernels
  (Triton on CUDA, chunked PyTorch on CPU), then ratios, clipping, KL and aggregation from
  `grpo_math` on [B, T]: prompt positions are never projected to the vocabulary and no
  [B, T, V] logits exist.
- Old- and reference-policy scoring (`_get_per_token_logps_and_entropies`) goes through the same
  hidden-state path (`grpo_kernels.hf.completion_logprobs`), without logits.
- A PEFT LoRA adapter on lm_head (`peft_config` with "lm_head" in target_modules) is trained:
  TRL 1.16 refuses one (its fused head reads lm_head.weight), ours folds it into the fused call
  (`head_adapters`); other adapter types on the head raise, naming the module.
- cast_lm_head_to_fp32: the float32 head takes the bf16/fp16 hidden states as they are (mixed
  head precision in the kernels), giving the float32 head's logits as TRL's cast does.

The numbers are TRL 1.16's, and the same as the standalone loss's: both follow docs/semantics.md,
which is TRL 1.16's `_compute_loss`, through one implementation (`grpo_math`: per-token loss,
aggregation weights, entropy bonus, metric sums and clip flags). Tested against TRL's own
`_compute_loss` to float32 precision (tests/test_trl.py, tests/test_semantics_trl.py).
What the trainer adds is TRL's bookkeeping: per-micro-batch losses / current accumulation steps;
dapo/cispo divide by num_items_in_batch / num_processes · accumulation steps / steps_per_generation;
metrics (`entropy`, `kl`, `clip_ratio/*` with its per-sequence low_min/high_max, `cispo_clip_ratio`,
`policy_loss`, `entropy_coef`) are reduced across processes as TRL does.

Fallbacks (a one-time warning at the caller's line names the reason and what runs instead):
- TRL's loss math on our log-probs (still no logits): loss_type "vespo" or any type we lack,
  top_entropy_quantile < 1, off_policy_mask_threshold, use_adaptive_entropy.
- TRL's own implementation entirely: MoE auxiliary loss, multimodal inputs (pixel_values, ...),
  logit soft-capping/scaling models, output heads with their own transform (BERT-style),
  heads sharded by DeepSpeed ZeRO-3 or FSDP1.
Under FSDP2 (`fully_shard`) the fused path stays on: it runs as a registered FSDP forward method
of the root (`run_as_forward`), so FSDP itself unshards the head for the forward and the backward
and reduce-scatters its gradient.
use_liger_kernel needs no fallback: in TRL >= 1.16 it only swaps layer kernels, which the model
body runs as usual.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings

import torch

try:
    import accelerate
    import transformers
    import trl as _trl
    from trl.trainer import grpo_trainer as _trl_grpo_trainer
    from trl.trainer.utils import nanmax, nanmin
except ImportError as exc:  # TRL is an optional dependency
    raise ImportError(
        "grpo_kernels.trl needs TRL (>= 1.16): pip install grpo-kernels[trl]"
    ) from exc

from ..functional import selective_logprobs
from ..grpo_math import clip_indicators, entropy_bonus, metric_sums, policy_loss
from ..hf import (
    check_output_head,
    completion_hidden_states,
    completion_logprobs,
    has_tuner_adapter,
    head_for,
    unwrap_model,
)
from ..params import LOSS_TYPES, GRPOParams
from ..validation import check_grad_filter, check_loss_inputs
from .compat import trl_checked

# `_compute_loss` below mirrors the conventions of this TRL release (its parity is tested on it)
TESTED_TRL = (1, 16)
_trl_version = tuple(int(x) for x in _trl.__version__.split(".")[:2] if x.isdigit())
if _trl_version < TESTED_TRL:
    raise ImportError(f"grpo_kernels.trl needs TRL >= 1.16, found {_trl.__version__}: "
                      "pip install -U grpo-kernels[trl]")
if _trl_version > TESTED_TRL:
    warnings.warn(f"grpo_kernels.trl was checked against TRL 1.16; TRL {_trl.__version__} may "
                  "normalize or log differently (tests/test_trl.py checks it)", stacklevel=2)

__all__ = ["GRPOTrainer", "policy_terms"]

# TRL's trainer module and its GRPOTrainer, bound once here. Training frameworks patch TRL with
# `trl.GRPOTrainer = grpo_kernels.trl.GRPOTrainer` (and trl.trainer.GRPOTrainer): a lookup through
# those names at call time would then find this class and this module instead of TRL's.
_TRLGRPOTrainer = _trl_grpo_trainer.GRPOTrainer

# A fallback warning names the user's line: the first frame outside these packages. TRL reaches
# our methods through different paths (Trainer.train -> training_step -> compute_loss ->
# _compute_loss, generation -> scoring, or a direct call), so no fixed stacklevel fits them all.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (
    _trl, transformers, accelerate, torch, sys.modules[__name__.partition(".")[0]]))


def _warn_at_user_frame(message: str) -> None:
    """warnings.warn(message), attributed to the first caller outside _LIBRARY_DIRS."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, stacklevel=2, skip_file_prefixes=_LIBRARY_DIRS)
        return
    # stacklevel n names sys._getframe(n - 1) of this function: count the library frames
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


# What runs instead, as the fallback warnings say it (the module docstring's Fallbacks)
_TRL_ENTIRELY = "TRL's own implementation runs instead, its model forward and lm_head included"
_TRL_LOSS = "TRL's loss math runs instead, on log-probs from grpo-kernels' fused kernels"

# Batch keys that only vision-language models produce; the hidden-state path does not take them.
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                   "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                   "mm_token_type_ids", "image_position_ids")


def policy_terms(hidden, weight, bias, completion_ids, mask, advantages, old_logps, ref_logps,
                 params: GRPOParams, num_items_in_batch=None, importance_sampling_ratio=None,
                 grad_filter=None):
    """The GRPO policy loss with the per-token values TRL's metrics need.

    Log-probs and entropies come from the fused linear kernels (`selective_logprobs`: Triton on
    CUDA, chunked PyTorch on CPU; no [N, V] logits), the per-token loss and aggregation from
    `grpo_math` on [B, T]; params.entropy_coef is ignored (the trainer adds TRL's bonus).
    hidden [B, T, D], weight [V, D], bias [V] | None, completion_ids/mask [B, T].
    Returns (Σ weight·ℓ: 0-dim float32, entropy [B, T] (differentiable), ratio [B, T] or [B, 1]
    (detached), kl [B, T] (detached) or None). grad_filter: see `selective_logprobs`.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, D], got {getattr(hidden, 'shape', hidden)}")
    B, T, _ = hidden.shape
    logp, entropy = selective_logprobs(hidden, weight, completion_ids, bias,
                                       temperature=params.temperature, return_entropy=True,
                                       grad_filter=grad_filter)
    inputs = check_loss_inputs(B, T, hidden.device, params, mask, advantages, old_logps,
                               ref_logps, importance_sampling_ratio, num_items_in_batch)
    loss, ratio, kl = policy_loss(logp, inputs, params)
    return loss, entropy, ratio, None if kl is None else kl.detach()


# Registered on an FSDP2 root as a forward method (`register_fsdp_forward_method`).
_FSDP_FORWARD_METHOD = "_grpo_kernels_forward"


def fsdp2_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP2 (`fully_shard`) module that owns the output head's parameters: the model or the
    transformers model inside its wrappers; None when the model is not sharded with FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    for candidate in (model, unwrap_model(model)):
        if isinstance(candidate, FSDPModule):
            return candidate
    return None


def _call_forward(_root, call, target):
    """The registered method: call(target), views among its outputs copied (FSDP2 hooks the
    outputs for its backward; a view would make that hook fragile and FSDP warns about it)."""
    out = call(target)
    fresh = lambda x: x.clone() if isinstance(x, torch.Tensor) and x._is_view() else x  # noqa: E731
    return tuple(fresh(x) for x in out) if isinstance(out, tuple) else fresh(out)


def run_as_forward(model: torch.nn.Module, fn):
    """fn(model), run as a forward of the model's FSDP2 root when it is sharded.

    The fused path reads lm_head.weight directly, which FSDP2 keeps as a shard outside a forward.
    As a registered FSDP forward method, FSDP unshards the root's parameters (embeddings, final
    norm, head) before fn and reshards after, the decoder layers unshard in their own forwards,
    and the backward through fn's outputs unshards the head again and reduce-scatters its
    gradient like any other. Without FSDP2 this is fn(model).
    """
    root = fsdp2_root(model)
    if root is None:
        return fn(model)
    if not hasattr(root, _FSDP_FORWARD_METHOD):
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(root, _FSDP_FORWARD_METHOD, types.MethodType(_call_forward, root))
        register_fsdp_forward_method(root, _FSDP_FORWARD_METHOD)
    return getattr(root, _FSDP_FORWARD_METHOD)(fn, model)


@contextlib.contextmanager
def _adapter_on_head_allowed(enabled: bool = True):
    """While TRL's __init__ runs: skip its refusal of a PEFT adapter on lm_head.

    TRL 1.16 refuses one because its own fused head reads lm_head.weight and would leave the
    adapter untrained; ours folds LoRA into the fused call (`head_adapters`) and raises for the
    adapters it cannot reproduce. The refusal is an isinstance test against the module global
    `BaseTunerLayer` of trl.trainer.grpo_trainer, swapped for a class nothing is an instance of
    for the duration of the constructor. enabled=False leaves TRL's checks alone.
    """
    module = _trl_grpo_trainer  # TRL's module even where trl.GRPOTrainer is rebound to ours
    if not enabled or not hasattr(module, "BaseTunerLayer"):  # no PEFT: TRL checks nothing
        yield
        return
    original = module.BaseTunerLayer
    module.BaseTunerLayer = type("_NoAdapterCheck", (), {})
    try:
        yield
    finally:
        module.BaseTunerLayer = original


class GRPOTrainer(_TRLGRPOTrainer):
    """`trl.GRPOTrainer` with grpo-kernels' fused, logits-free loss and log-prob scoring.

    Same constructor and config as TRL's; see the module docstring for what changes. One
    optional extra keyword: grad_filter (None = exact; "auto" or eps: approximate gradient
    filtering in the Triton backward, see `selective_logprobs`).
    """

    _tag_names = ["trl", "grpo", "grpo-kernels"]

    def __init__(self, *args, grad_filter: float | str | None = None, **kwargs):
        check_grad_filter(grad_filter, torch.bfloat16)  # fail before TRL loads the model
        self._grad_filter = grad_filter
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        cast_head = bool(getattr(config, "cast_lm_head_to_fp32", False))
        # TRL's float32 head cast replaces the head's forward: keep its refusal of an adapter there
        try:
            with _adapter_on_head_allowed(not cast_head), trl_checked(self, _TRLGRPOTrainer):
                super().__init__(*args, **kwargs)
        except ValueError as exc:
            if cast_head and "lm_head" in str(exc) and "PEFT" in str(exc):
                raise ValueError("cast_lm_head_to_fp32=True cannot be combined with a PEFT "
                                 "adapter on lm_head (TRL replaces the head's forward to cast "
                                 "it); set cast_lm_head_to_fp32=False to train a LoRA head"
                                 ) from exc
            raise
        self._warned: set[str] = set()
        # TRL's cast_lm_head_to_fp32: a float32 head on the (bf16) hidden states as they are
        self._head_dtype = torch.float32 if self.args.cast_lm_head_to_fp32 else None
        self._grpo_params, self._loss_fallback = self._build_params()
        self._model_fallback = self._model_unsupported()
        head = unwrap_model(self.model).get_output_embeddings()
        if has_tuner_adapter(head) and self._model_fallback is not None:
            # TRL's own head path would leave the adapter untrained; refuse, as TRL does
            raise ValueError(f"the output embedding carries a PEFT adapter ({type(head).__name__})"
                             f" and {self._model_fallback}: that case would run TRL's own lm_head "
                             "code, which ignores the adapter. Remove the head from target_modules")

    def _build_params(self) -> tuple[GRPOParams | None, str | None]:
        """Our hyperparameters from TRL's, or (None, why the loss must be TRL's)."""
        if self.loss_type not in LOSS_TYPES:
            return None, f"loss_type={self.loss_type!r} is not implemented by grpo-kernels"
        for flag, on in (("top_entropy_quantile < 1", self.top_entropy_quantile < 1.0),
                         ("off_policy_mask_threshold", self.off_policy_mask_threshold is not None),
                         ("use_adaptive_entropy", self.use_adaptive_entropy)):
            if on:
                return None, f"{flag} is not implemented by grpo-kernels"
        try:
            # the trainer's resolved attributes (epsilon_low, epsilon_high, ...) first, then its
            # config's fields (delta, sapo temperatures, ...); the bonus is added by the trainer
            params = GRPOParams.from_config(self, self.args, entropy_coef=0.0)
        except (TypeError, ValueError) as exc:
            return None, f"grpo-kernels rejects this configuration ({exc})"
        return params, None

    def _model_unsupported(self) -> str | None:
        """Why the hidden-state path cannot run this model at all (None if it can)."""
        if self.aux_loss_enabled:
            return "the MoE auxiliary loss needs the model's own forward"
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            # a GatheredParameters gather ends with the forward, but our backward recomputes
            # the logits from the full head weight and its gradient needs ZeRO's reduce hooks
            return ("DeepSpeed ZeRO-3 shards the lm_head weight, and the fused loss's backward "
                    "needs the full weight after the forward")
        try:  # one short forward: the head must take the body's output as is
            check_output_head(self.model)
        except (ValueError, NotImplementedError) as exc:
            return str(exc)
        return None

    def _fallback(self, reason: str, instead: str) -> None:
        """One warning per reason, at the user's line, saying what runs instead."""
        if reason not in self._warned:
            self._warned.add(reason)
            _warn_at_user_frame(f"grpo_kernels.trl.GRPOTrainer: {reason}; {instead}")

    def _batch_unsupported(self, batch: dict, compute_aux_loss: bool = False,
                           model=None) -> str | None:
        if self._model_fallback is not None:
            return self._model_fallback
        if self.is_fsdp_enabled and model is not None and fsdp2_root(model) is None:
            return ("FSDP1 (FullyShardedDataParallel) shards the lm_head weight; use FSDP2 "
                    "(fsdp_version: 2), whose unshard the fused path uses")
        if compute_aux_loss:
            return "the MoE auxiliary loss needs the model's own forward"
        present = [k for k in MULTIMODAL_KEYS if batch.get(k) is not None]
        return f"multimodal inputs ({', '.join(present)})" if present else None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        """TRL's old/ref scoring (and the policy's, on loss fallbacks) from hidden states:
        (logps [B, T], entropies [B, T] or None, None), zero at padded completion positions as
        TRL returns them. Differentiable when grad is enabled."""
        reason = self._batch_unsupported(multimodal, compute_aux_loss, model)
        if reason is not None:
            self._fallback(reason, _TRL_ENTIRELY)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        def score(model):
            with self.accelerator.autocast():
                return completion_logprobs(
                    model, input_ids, attention_mask, logits_to_keep,
                    temperature=self.temperature, batch_size=batch_size,
                    return_entropy=compute_entropy, head_dtype=self._head_dtype)

        out = run_as_forward(model, score)
        logps, ents = out if compute_entropy else (out, None)
        valid = attention_mask[:, -logits_to_keep:].to(logps.device, logps.dtype)
        return logps * valid, None if ents is None else ents * valid, None

    def _compute_loss(self, model, inputs):
        reason = self._batch_unsupported(inputs, model=model)
        if reason is not None:
            self._fallback(reason, _TRL_ENTIRELY)
            return super()._compute_loss(model, inputs)
        if self._loss_fallback is not None:
            self._fallback(self._loss_fallback, _TRL_LOSS)
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [B, P + T]
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        B, T = completion_ids.shape
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs[
            "tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:  # [B] -> [B, 1]; subclasses may pass [B, T]
            advantages = advantages.unsqueeze(1)
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items, scale = self._normalizer(inputs, mode, accumulation)
        isr = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            isr = inputs["importance_sampling_ratio"]  # [B, T] or [B, 1]

        def terms(model):
            with self.accelerator.autocast():
                hidden = completion_hidden_states(model, input_ids, attention_mask, T)
                hidden, weight, bias = head_for(hidden, model, self._head_dtype)
            with torch.autocast(hidden.device.type, enabled=False):
                return policy_terms(
                    hidden, weight, bias, completion_ids.to(hidden.device), mask, advantages,
                    inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"),
                    self._grpo_params, num_items, isr, self._grad_filter,
                )

        policy, entropy, ratio, kl = run_as_forward(model, terms)
        loss = policy * scale
        maskf = mask.to(entropy.dtype)
        if self._entropy_bonus_enabled:
            # the micro-batch's masked mean entropy, scaled only for accumulation
            loss = loss + entropy_bonus(entropy, maskf, self.entropy_coef) / accumulation
            token_count = self._grpo_params.normalizes_by_token_count
            logged = policy.detach() * (scale if token_count else 1)
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(logged).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        self._log_metrics(mode, maskf, entropy.detach(), ratio, kl, advantages)
        return loss

    def _normalizer(self, inputs, mode: str, accumulation: int):
        """(num_items_in_batch for our loss, factor applied to our loss) reproducing TRL's
        normalization of self.loss_type."""
        if self._grpo_params.normalizes_by_token_count:
            # num_items_in_batch counts the whole generation batch on all processes; TRL rescales
            # it to one accumulation window of this process
            n = torch.as_tensor(inputs["num_items_in_batch"], dtype=torch.float32)
            norm = n.clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                norm = norm * accumulation / self.args.steps_per_generation
            # our loss clamps its normalizer at 1 and TRL's rescaled one is not; undo our clamp
            return norm, norm.clamp(min=1.0) / norm
        return None, 1.0 / accumulation

    def _log_metrics(self, mode, maskf, entropy, ratio, kl, advantages) -> None:
        """TRL's loss metrics: `grpo_math.metric_sums` added up across processes, and the
        per-sequence min/max of the clip fractions."""
        metrics = self._metrics[mode]
        # TRL's per-token tensors are zero at padded positions; zero ours too (it matters only
        # where a [B, 1] completion makes a per-token value count as a per-sequence one)
        on_tokens = lambda x: x * maskf if x.shape == maskf.shape else x  # noqa: E731
        p = self._grpo_params
        A = advantages.to(ratio.device)
        sums = metric_sums(on_tokens(entropy.float()), ratio, None if kl is None else
                           on_tokens(kl.float()), A, maskf, p)
        names = list(sums)
        totals = self.accelerator.reduce(
            torch.stack([torch.stack(sums[k]) for k in names]), reduction="sum")  # [K, 2]
        means = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
        for name, value in zip(names, means):
            metrics[name].append(value)

        def per_sequence(x):  # [B]: NaN for a sequence without tokens (dropped by nanmin/max)
            return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

        flags = clip_indicators(ratio, A, p)
        if "clip_ratio/low_mean" in flags:
            gathered = self.accelerator.gather(per_sequence(flags["clip_ratio/low_mean"]))
            metrics["clip_ratio/low_min"].append(nanmin(gathered).item())
            gathered = self.accelerator.gather(per_sequence(flags["clip_ratio/high_mean"]))
            metrics["clip_ratio/high_max"].append(nanmax(gathered).item())
