"""TRL integration: a `GRPOTrainer` that computes its GRPO loss from hidden states, no logits.

    from grpo_kernels.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer

or patched in, `trl.GRPOTrainer = GRPOTrainer`: the same trainer either way (TRL's class and
module are bound at import, nothing is looked up through trl.GRPOTrainer later).

Everything else (GRPOConfig, generation, rewards, advantages, logging) is TRL's. What changes:

- The training loss (`_compute_loss`) runs the model body only, takes the hidden states of the
  completion positions ([B, T, D]) and takes the route of every grpo-kernels loss
  (`fused_linear_grpo_loss(..., return_token_values=True)`): TRL's loss type, normalizer and
  entropy bonus are computed inside it, so that token-level losses take the three-pass route
  (the gradient formed in the forward, on Triton and on the chunked CPU path alike), and the
  per-token values TRL's metrics read come back detached. Sequence-level ratios and the
  sequence and batch options take the four-pass route. Prompt positions are never projected to
  the vocabulary and no [B, T, V] logits exist.
- Old- and reference-policy scoring (`_get_per_token_logps_and_entropies`) goes through the same
  hidden-state path (`grpo_kernels.hf.completion_logprobs`), without logits.
- A PEFT LoRA adapter on lm_head (`peft_config` with "lm_head" in target_modules) is trained:
  TRL 1.16 refuses one (its fused head reads lm_head.weight), ours folds it into the fused call
  (`head_adapters`); other adapter types on the head raise, naming the module.
- cast_lm_head_to_fp32: the float32 head takes the bf16/fp16 hidden states as they are (mixed
  head precision in the kernels), giving the float32 head's logits as TRL's cast does.
- Vision-language models: the batch's pixel_values, image_grid_thw, ... go to the model body,
  cut per micro-batch as TRL cuts them; the body places the image features and computes its
  positions, and only the completion positions' hidden states reach the fused head.
- Mixture-of-Experts models (TRL's aux_loss_enabled): the body returns its router logits and
  the model's own load-balancing loss is added as TRL adds it, and logged as `aux_loss`
  (`model_inputs.py`).

The numbers are TRL 1.16's, and the same as the standalone loss's: both follow docs/semantics.md,
which is TRL 1.16's `_compute_loss`, through one implementation (`grpo_math`: per-token loss,
aggregation weights, entropy bonus, metric sums and clip flags). Tested against TRL's own
`_compute_loss` to float32 precision (tests/trl/test_trl.py, tests/api/test_semantics_trl.py,
tests/api/test_loss_options.py, tests/trl/test_trl_loss_options.py).
What the trainer adds is TRL's bookkeeping (`bookkeeping.py`): per-micro-batch losses / current
accumulation steps; dapo/cispo/vespo divide by num_items_in_batch / num_processes · accumulation
steps / steps_per_generation; metrics (`entropy`, `kl`, `clip_ratio/*` with its per-sequence
low_min/high_max, `cispo_clip_ratio`, `vespo/phi_seq_mean`, `policy_loss`, `entropy_coef`) are
reduced across processes as TRL does.
Every loss option of TRL 1.16 runs on this route: vespo, top_entropy_quantile < 1 (the quantile
over the entropies of all processes), off_policy_mask_threshold (on the sampler's log-probs when
the batch has them) and use_adaptive_entropy (`grpo_options.EntropyController`; its state stays
in TRL's attributes entropy_coef and _last_world_entropy, which TRL's checkpoints save).

Fallbacks (a one-time warning at the caller's line names the reason and what runs instead):
- TRL's loss math on our log-probs (still no logits): a loss_type grpo-kernels lacks (none in
  TRL 1.16), or a configuration GRPOParams rejects.
- TRL's own implementation entirely, where the body's output under the head and the logit
  transform its config names is not the model's logits, the full head weight is not there
  (FSDP1; a PEFT adapter on a ZeRO-3-sharded head), or the MoE auxiliary loss is not known:
  `model_support.py` lists each model-family quirk with its detection and its check.
Under DeepSpeed ZeRO-3 the fused path stays on: `hf/zero3.py` gathers the head's weight (and bias)
for the fused call and hands its full gradient to DeepSpeed's gradient hook, which reduce-scatters
it; a model loaded under deepspeed.zero.Init gets its one-forward head and packing checks on the
first batch, inside DeepSpeed's engine. Tested against TRL's own trainer under ZeRO-3 with two
CPU processes (tests/trl/test_trl_zero3.py).
Under FSDP2 (`fully_shard`) the fused path stays on: it runs as a registered FSDP forward method
of the root (`run_as_forward`), so FSDP itself unshards the head for the forward and the backward
and reduce-scatters its gradient.
use_liger_kernel needs no fallback: in TRL >= 1.16 it only swaps layer kernels, which the model
body runs as usual.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import torch

try:
    import accelerate
    import transformers
    import trl as _trl
    from trl.trainer import grpo_trainer as _trl_grpo_trainer
except ImportError as exc:  # TRL is an optional dependency
    raise ImportError(
        "grpo_kernels.trl needs TRL (>= 1.16): pip install grpo-kernels[trl]"
    ) from exc

from ..grpo_options import EntropyController
from ..hf import (
    RowLayout,
    completion_logprobs,
    has_tuner_adapter,
    head_for,
    logit_transform,
    run_as_forward,
    unwrap_model,
)
from ..loss_specs import LOSS_SPECS, TRL_LOSS_TYPES, spec_of
from ..params import GRPOParams
from ..validation import check_grad_filter
from .bookkeeping import LossBookkeeping
from .compat import trl_checked
from .losses import packed_grpo_loss, padded_grpo_loss, policy_terms
from .model_inputs import MULTIMODAL_KEYS, ModelInputs
from .model_support import ModelSupport
from .padding_free import equal_count_across, packed_completion_hidden, packed_scores

# `_compute_loss` below mirrors the conventions of this TRL release (its parity is tested on it)
TESTED_TRL = (1, 16)
_trl_version = tuple(int(x) for x in _trl.__version__.split(".")[:2] if x.isdigit())
if _trl_version < TESTED_TRL:
    raise ImportError(f"grpo_kernels.trl needs TRL >= 1.16, found {_trl.__version__}: "
                      "pip install -U grpo-kernels[trl]")
if _trl_version > TESTED_TRL:
    warnings.warn(f"grpo_kernels.trl was checked against TRL 1.16; TRL {_trl.__version__} may "
                  "normalize or log differently (tests/trl/test_trl.py checks it)", stacklevel=2)

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


class GRPOTrainer(LossBookkeeping, ModelInputs, _TRLGRPOTrainer):
    """`trl.GRPOTrainer` with grpo-kernels' fused, logits-free loss and log-prob scoring.

    Same constructor and config as TRL's; see the module docstring for what changes. Three
    optional extra keywords: padding_free (default True: scoring and loss forwards run packed
    rows wherever the model's attention gives exact results on them, see `padding_free.py`;
    False keeps TRL's padded batches), share_prompt (default True, with padding_free: rows
    hold each group's prompt once, where the model takes a 4-D mask) and grad_filter (None =
    exact; "auto" or eps: approximate gradient filtering in the Triton backward, see
    `selective_logprobs`).
    """

    _tag_names = ["trl", "grpo", "grpo-kernels"]

    def __init__(self, *args, padding_free: bool = True, share_prompt: bool = True,
                 grad_filter: float | str | None = None, **kwargs):
        for name, value in (("padding_free", padding_free), ("share_prompt", share_prompt)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        check_grad_filter(grad_filter, torch.bfloat16)  # fail before TRL loads the model
        self._grad_filter = grad_filter
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        loss_type = getattr(config, "loss_type", None)
        if loss_type in LOSS_SPECS and not LOSS_SPECS[loss_type].in_trl:
            raise ValueError(f"loss_type={loss_type!r} is not one of TRL 1.16's loss types "
                             f"{TRL_LOSS_TYPES}; grpo_kernels computes it in its functions and "
                             f"in grpo_train (--loss_type {loss_type}), not in TRL's trainer")
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
        self._entropy_control: EntropyController | None = None
        self._grpo_params, self._loss_fallback = self._build_params()
        self._support = ModelSupport(self.model, aux_loss_enabled=self.aux_loss_enabled,
                                     padding_free=padding_free, share_prompt=share_prompt)
        head = unwrap_model(self.model).get_output_embeddings()
        if has_tuner_adapter(head) and self._support.fallback is not None:
            # TRL's own head path would leave the adapter untrained; refuse, as TRL does
            raise ValueError(f"the output embedding carries a PEFT adapter ({type(head).__name__})"
                             f" and {self._support.fallback}: that case would run TRL's own "
                             "lm_head code, which ignores the adapter. Remove the head from "
                             "target_modules")

    def _build_params(self) -> tuple[GRPOParams | None, str | None]:
        """Our hyperparameters from TRL's, or (None, why the loss must be TRL's); sets the
        adaptive entropy controller when use_adaptive_entropy is on."""
        if self.loss_type not in TRL_LOSS_TYPES:  # (a TRL release's type we do not have)
            return None, f"loss_type={self.loss_type!r} is not implemented by grpo-kernels"
        try:
            # the trainer's resolved attributes (epsilon_low, epsilon_high, top_entropy_quantile,
            # ...) first, then its config's fields (delta, sapo and vespo parameters, ...); the
            # bonus is added by the trainer
            params = GRPOParams.from_config(self, self.args, entropy_coef=0.0)
            if self.use_adaptive_entropy:
                self._entropy_control = EntropyController.from_config(self.args)
        except (TypeError, ValueError) as exc:
            return None, f"grpo-kernels rejects this configuration ({exc})"
        return params, None

    def _fallback(self, reason: str, instead: str) -> None:
        """One warning per reason, at the user's line, saying what runs instead."""
        if reason not in self._warned:
            self._warned.add(reason)
            _warn_at_user_frame(f"grpo_kernels.trl.GRPOTrainer: {reason}; {instead}")

    def _batch_unsupported(self, model) -> str | None:
        return self._support.at_batch(model, self.is_fsdp_enabled)

    @property
    def _layout(self) -> RowLayout:
        """The row layout of scoring and loss forwards (`grpo_kernels.hf.RowLayout`)."""
        return self._support.layout

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        """TRL's old/ref scoring (and the policy's, on loss fallbacks) from hidden states:
        (logps [B, T], entropies [B, T] or None, MoE aux loss or None), zero at padded
        completion positions as TRL returns them. Differentiable when grad is enabled."""
        reason = self._batch_unsupported(model)
        if reason is not None:
            self._fallback(reason, _TRL_ENTIRELY)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        multimodal = {k: v for k, v in multimodal.items() if v is not None}
        if multimodal or compute_aux_loss:  # images / router logits: model_inputs.py
            return run_as_forward(model, lambda m: self._score_model_inputs(
                m, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, multimodal))
        T = logits_to_keep
        if self._support.packs(attention_mask, attention_mask[:, -T:], multimodal):
            def packed(model):
                with self.accelerator.autocast():
                    return packed_scores(
                        model, input_ids, attention_mask, T, batch_size=batch_size,
                        return_entropy=compute_entropy, temperature=self.temperature,
                        head_dtype=self._head_dtype, layout=self._layout,
                        equal_count_across=equal_count_across(self.accelerator, model))

            logps, ents = run_as_forward(model, packed)
            return logps, ents, None

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
        reason = self._batch_unsupported(model)
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
        # a sequence weight (vespo's φ) takes the rollout ratios whenever the batch has them
        if spec_of(self.loss_type).objective.sequence_weight:
            isr = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            isr = inputs["importance_sampling_ratio"]  # [B, T] or [B, 1]
        gather = self._gather_entropies if self.top_entropy_quantile < 1.0 else None
        multimodal = {k: inputs[k] for k in MULTIMODAL_KEYS if inputs.get(k) is not None}
        packs = self._support.packs(attention_mask, completion_mask, multimodal)
        params = self._loss_params(mode, scale, accumulation)
        aux = []  # the MoE auxiliary loss, when TRL adds one

        def loss_and_terms(model):
            packed = None
            with self.accelerator.autocast():
                if packs:  # the body on packed rows; the head on the kept tokens [N, D]
                    hidden, packed, aux_loss = packed_completion_hidden(
                        model, input_ids, attention_mask, completion_mask,
                        self._support.aux_loss if self.aux_loss_enabled else None,
                        self._layout)
                else:
                    hidden, aux_loss = self._body_hidden(model, input_ids, attention_mask, T,
                                                         multimodal, self.aux_loss_enabled)
                aux.append(aux_loss)
                hidden, weight, bias = head_for(hidden, model, self._head_dtype)
            grpo = (padded_grpo_loss if packed is None
                    else functools.partial(packed_grpo_loss, packed))
            with torch.autocast(hidden.device.type, enabled=False):
                return grpo(
                    hidden, weight, bias, completion_ids.to(hidden.device), mask, advantages,
                    inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"),
                    params, num_items, isr, self._grad_filter,
                    inputs.get("sampling_per_token_logps"), gather, **logit_transform(model),
                )

        loss, t = run_as_forward(model, loss_and_terms)
        loss = loss * scale  # TRL's normalization; the bonus inside is pre-divided by it
        maskf = mask.to(t.entropy.dtype)
        if self._entropy_bonus_enabled:
            self._entropy_bookkeeping(mode, t, maskf, scale)
        if self.aux_loss_enabled:
            loss = self._add_aux_loss(loss, aux[-1], mode)
        self._log_metrics(mode, maskf, t.entropy, t.ratio, t.kl, advantages, t.vespo_phi)
        return loss
