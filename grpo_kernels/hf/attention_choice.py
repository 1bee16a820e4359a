"""Which attention implementation the scoring and loss forwards run, per device and row layout.

The row layout (`row_layout.RowLayout`: padded, packed or shared rows) is chosen first
(`row_plan.choose_layout`); this module then picks the attention implementation those forwards
run, by a written rule: `ATTENTION_RULES`, keyed by (device kind, layout), holds the
implementations in order of preference, each entry with what set it (a measurement, or a
placeholder that names the measurement it awaits). The first one that runs here is chosen:

    implementation      what it needs                                    layouts
    sdpa                the model class supports it                      padded, packed, shared
    eager               nothing                                          padded, packed, shared
    flex_attention      torch's flex attention, the model supports it;   padded, packed, shared
                        a backward on this device (none on CPU)
    torch_varlen_flash  PyTorch's bundled FlashAttention varlen kernel   packed (reads no mask)
                        (`torch_varlen.py`: CUDA, sm80+); a model of
                        full-attention layers that takes flash kwargs

An implementation other than the model's own must also compute the same function: no config
feature that only some implementations apply (attention logit soft-capping: eager and flex;
sliding windows, non-attention layers: not the varlen kernel), the same logits as the model's
own implementation on a short sequence, and the layout's exactness check run under it
(`check_packed_attention`, `check_shared_prompt`). What does not run is skipped with its reason;
if nothing in the rule runs, the model's own implementation stays. A model whose own
implementation the rule does not know (flash_attention_2, a Hub kernel) keeps it.

`choose_attention` returns an `AttentionChoice` and logs one INFO line on the
"grpo_kernels.hf.attention" logger per (choice, reason) in a process; a caller asking for one
implementation (`requested`) gets it or a ValueError saying why not. `using_attention` sets the
choice on the models' configs for a block (scoring and loss forwards) and restores them after:
generation keeps the model's own implementation. A caller that sets it for the whole model,
generation included, passes scoped=False: only sdpa and eager are then considered.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch

from . import torch_varlen
from .packed_rows import agreement_atol, check_packed_attention, logits_disagree
from .row_layout import RowLayout, parse_row_layout
from .shared_prompt import check_shared_prompt
from .unwrap import text_config, text_vocab_size, unwrap_model

__all__ = ["ATTENTION_RULES", "IMPLEMENTATIONS", "AttentionChoice", "AttentionRule",
           "attention_refusal", "choose_attention", "using_attention"]

IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", torch_varlen.NAME)
WHOLE_MODEL = ("sdpa", "eager")  # also fit for generation (left-padded batches, a KV cache)
_ALL = (RowLayout.PADDED, RowLayout.PACKED, RowLayout.SHARED)
_LAYOUTS = {"sdpa": _ALL, "eager": _ALL, "flex_attention": _ALL,
            torch_varlen.NAME: (RowLayout.PACKED,)}
_SUPPORT_FLAG = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                 torch_varlen.NAME: "_supports_flash_attn"}
_LOG = logging.getLogger("grpo_kernels.hf.attention")
_LOGGED: set = set()  # (implementation, layout, device kind, reason) already logged


@dataclass(frozen=True)
class AttentionRule:
    """prefer: implementations in order of preference; source: what set the order (the
    measurement, with device, benchmark and figures); placeholder: True while no measurement on
    this device kind compared them (the order is then today's behaviour)."""

    prefer: tuple[str, ...]
    source: str
    placeholder: bool = False


_CPU_SOURCE = ("2-core AMD EPYC, torch 2.13: sdpa on packed rows holds a bool [R, 1, W, W] mask "
               "(58 MiB for one 3,504-position row), eager float32 [R, heads, W, W] weights "
               "(656 MiB); flex attention has no CPU backward")
# the CUDA rows' measurement: warm steps (lengths replayed by a warm-up step) of grpo_train's
# step on synthetic completions (scoring + loss + optimizer)
_STEP = ("H200, torch 2.11, python -m benchmarks.trainer_step --synthetic (Qwen2.5-0.5B shape, "
         "float32 weights, bf16 autocast, gradient checkpointing, G = 8, lognormal lengths, "
         "cap 1,024): ")
ATTENTION_RULES: dict[tuple[str, RowLayout], AttentionRule] = {
    ("cpu", RowLayout.PADDED): AttentionRule(("sdpa", "eager"), _CPU_SOURCE),
    ("cpu", RowLayout.PACKED): AttentionRule(("sdpa", "eager"), _CPU_SOURCE),
    ("cpu", RowLayout.SHARED): AttentionRule(("sdpa", "eager"), _CPU_SOURCE),
    ("cuda", RowLayout.PADDED): AttentionRule(("sdpa",), _STEP + (
        "padded rows 0.229 s a step at a 64-token prompt, 0.337 s at a 1,024-token prompt; "
        "the one implementation timed on padded rows")),
    ("cuda", RowLayout.PACKED): AttentionRule(("sdpa", torch_varlen.NAME), _STEP + (
        "packed sdpa 0.223 s a step against padded 0.229 s at a 64-token prompt; "
        "torch_varlen_flash not timed: the packed-row check held its bf16 rounding (0.016 "
        "from separate forwards) to the float32 bound then")),
    ("cuda", RowLayout.SHARED): AttentionRule(("sdpa", "flex_attention"), _STEP + (
        "shared sdpa 0.250 s a step against padded 0.337 s at a 1,024-token prompt; "
        "flex_attention refused by the shared-prompt check with transformers 5.17 (logits "
        "1.8 from the model's own)")),
}


@dataclass(frozen=True)
class AttentionChoice:
    """implementation: the attention the scoring and loss forwards run; layout: the rows they
    run; device_kind: the rule's key ("cpu", "cuda"); reason: why, a phrase for a log line."""

    implementation: str
    layout: RowLayout
    device_kind: str
    reason: str

    def log_once(self) -> AttentionChoice:
        """One INFO line on the "grpo_kernels.hf.attention" logger per (choice, reason)."""
        key = (self.implementation, self.layout, self.device_kind, self.reason)
        if key not in _LOGGED:
            _LOGGED.add(key)
            _LOG.info("grpo_kernels: attention %s for %s rows on %s: %s", self.implementation,
                      self.layout, self.device_kind, self.reason)
        return self


def choose_attention(model, layout: RowLayout | str, device=None, *, requested: str = "auto",
                     training: bool = True, scoped: bool = True, autocast=None
                     ) -> AttentionChoice:
    """The attention implementation of `model`'s scoring and loss forwards on `layout` rows
    (module docstring), logged once. device: where they run (default: the model's);
    requested: "auto" (the rule) or one implementation, which is checked and returned or
    refused with a ValueError naming it; training: the forwards run a backward; scoped: the
    caller switches the implementation around those forwards only (`using_attention`), else
    for the whole model; autocast: the context the forwards run in (checks run in it)."""
    layout = parse_row_layout(layout)
    inner = unwrap_model(model)
    device = torch.device(device) if device is not None else next(inner.parameters()).device
    kind = device.type
    own = getattr(inner.config, "_attn_implementation", None)
    context = autocast if autocast is not None else contextlib.nullcontext()
    if requested != "auto":
        why = attention_refusal(inner, requested, layout, device, training=training,
                                scoped=scoped, autocast=context)
        if why is not None:
            raise ValueError(f"attention implementation {requested!r} cannot run the scoring "
                             f"and loss forwards of {layout} rows here: {why}")
        return AttentionChoice(requested, layout, kind, "asked for").log_once()
    rule = ATTENTION_RULES.get((kind, layout))
    if rule is None:
        reason = f"the model's own (no rule for {kind}/{layout} rows)"
        return AttentionChoice(own, layout, kind, reason).log_once()
    if own not in IMPLEMENTATIONS:
        reason = f"the model's own ({own!r} is not one the rule orders)"
        return AttentionChoice(own, layout, kind, reason).log_once()
    skipped = []
    tag = "placeholder until measured here" if rule.placeholder else "measured"
    for impl in rule.prefer:
        why = attention_refusal(inner, impl, layout, device, training=training, scoped=scoped,
                                autocast=context)
        if why is None:
            reason = f"rule {kind}/{layout}: {', '.join(rule.prefer)} ({tag})"
            if skipped:
                reason += f"; skipped {'; '.join(skipped)}"
            return AttentionChoice(impl, layout, kind, reason).log_once()
        skipped.append(f"{impl}: {why}")
    reason = (f"the model's own: nothing in rule {kind}/{layout} runs here "
              f"({'; '.join(skipped)})")
    return AttentionChoice(own, layout, kind, reason).log_once()


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: reason}


def attention_refusal(model, implementation: str, layout: RowLayout, device, *,
                      training: bool = True, scoped: bool = True, autocast=None
                      ) -> str | None:
    """Why `implementation` cannot run the scoring and loss forwards of `model` (unwrapped) on
    `layout` rows on `device`, or None (module docstring's table and checks). The forward checks
    run once per model, implementation, layout and precision."""
    if implementation not in IMPLEMENTATIONS:
        return f"not one of {', '.join(IMPLEMENTATIONS)}"
    if layout not in _LAYOUTS[implementation]:
        return {torch_varlen.NAME: "it reads no attention mask, and "
                f"{layout} rows need one"}.get(implementation, f"no {layout} rows")
    if not scoped and implementation not in WHOLE_MODEL:
        return ("the caller sets it for the whole model, generation too, where only "
                f"{' and '.join(WHOLE_MODEL)} are considered")
    why = _torch_refusal(implementation, device, training) or _model_refusal(
        model, implementation)
    own = getattr(model.config, "_attn_implementation", None)
    if why is not None or implementation == own:  # the model's own: choose_layout checked it
        return why
    seen = _CHECKED.setdefault(model, {})
    with autocast if autocast is not None else contextlib.nullcontext():
        # the bound the logits are compared at follows the precision (autocast, the dtype)
        key = (implementation, layout, training, device.type, agreement_atol(model))
        if key not in seen:
            seen[key] = _forward_refusal(model, implementation, layout)
    return seen[key]


def _torch_refusal(implementation: str, device, training: bool) -> str | None:
    """What this torch build and device lack for the implementation (None: nothing)."""
    if implementation == torch_varlen.NAME:
        if device.type != "cuda":
            return "PyTorch's varlen_attn runs on CUDA only"
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10+)"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "its FlashAttention kernels need compute capability 8.0 or newer"
    if implementation == "flex_attention":
        return _flex_refusal(device.type, training)
    return None


_FLEX: dict[tuple[str, bool], str | None] = {}


def _flex_refusal(device_type: str, training: bool) -> str | None:
    """Runs flex attention once on tiny inputs on the device (with a backward when training):
    torch 2.13 raises 'FlexAttention does not support backward on CPU'."""
    key = (device_type, training)
    if key not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            # fixed values, no random draw: the caller's RNG stream stays as it was
            q = torch.linspace(-1.0, 1.0, 256, device=device_type).view(1, 1, 16, 16)
            q.requires_grad_(training)
            out = flex_attention(q, q, q)
            if training:
                out.sum().backward()
            _FLEX[key] = None
        except Exception as exc:  # noqa: BLE001 - any failure: this torch cannot run it here
            _FLEX[key] = f"{type(exc).__name__}: {exc}".split("\n")[0]
    return _FLEX[key]


def _model_refusal(model, implementation: str) -> str | None:
    """What the model's class or config rules out (None: nothing)."""
    name = type(model).__name__
    flag = _SUPPORT_FLAG.get(implementation)
    if flag is not None and not getattr(model, flag, False):
        return f"{name} does not support it ({flag} is False)"
    text = text_config(model.config)
    if getattr(text, "attn_logit_softcapping", None) and implementation not in (
            "eager", "flex_attention"):
        return "the model soft-caps its attention logits, which only eager and flex apply"
    if implementation == torch_varlen.NAME:
        kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
        windowed = getattr(text, "sliding_window", None) and getattr(
            text, "use_sliding_window", True)
        if kinds or windowed:
            return "the model has sliding-window or non-attention layers; the kernel is causal"
    return None


def _forward_refusal(model, implementation: str, layout: RowLayout) -> str | None:
    """Runs the model under `implementation`: the same logits as under its own on a short
    sequence, and the layout's exactness check (None: both pass)."""
    vocab = text_vocab_size(model.config)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits.float()
            with using_attention(model, implementation):
                other = model(input_ids=ids, use_cache=False).logits.float()
        err = logits_disagree(model, other, own)
        if err is not None:
            return f"its logits differ by {err:.2g} from the model's own implementation's"
        with using_attention(model, implementation):
            if layout is RowLayout.PACKED:
                return check_packed_attention(model)
            if layout is RowLayout.SHARED:
                return check_packed_attention(model) or check_shared_prompt(model)
    except Exception as exc:  # noqa: BLE001 - any failure: the implementation does not run
        return f"a forward failed: {type(exc).__name__}: {exc}".split("\n")[0]
    finally:
        model.train(was_training)
    return None


def _configs(config):
    """The config and its sub-configs, depth first (each holds its own implementation)."""
    out = [config]
    for key in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, key, None)
        if sub is not None and sub is not config:
            out += _configs(sub)
    return out


@contextlib.contextmanager
def using_attention(models, implementation: str | None):
    """Inside the block, `models` (one model or several; None entries skipped; wrappers
    stripped) run `implementation` (registered first if it is torch_varlen_flash); each config
    and sub-config gets its own value back afterwards. None: nothing changes."""
    models = models if isinstance(models, (list, tuple)) else [models]
    configs = []
    for m in models:
        if m is not None and implementation is not None:
            configs += [c for c in _configs(unwrap_model(m).config)
                        if all(c is not seen for seen in configs)]
    saved = [(c, getattr(c, "_attn_implementation_internal", None)) for c in configs]
    if implementation == torch_varlen.NAME:
        torch_varlen.register()
    try:
        for c in configs:
            if c._attn_implementation != implementation:
                c._attn_implementation = implementation
        yield
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value
