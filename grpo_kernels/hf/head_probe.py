"""The linear-map probe of an output head, and its verdict kept between calls.

`probe_map` runs a head's forward on a fixed input and compares it with x·Wᵀ + b (its weight
[V, D] and bias [V] | None): one small forward and one host read. `head_adapters` asks it for
every output embedding that is not a plain `nn.Linear` (a class with a forward of its own, or
not an `nn.Linear` at all), on every fused call. The verdict is kept per module (weakly: it
goes with the module) together with a key of everything the verdict can depend on that is cheap
to read without touching the tensors' values, and the probe runs again when any of it changes:

- the class of each module in the head's tree, its class-level `forward` and `__call__`, an
  instance-level `forward` (by identity) and its training flag;
- the probed weight and bias: identity, version counter (`_version`: every in-place change
  made through the tensor, not its `.data`, bumps it, an optimizer step among them), dtype, device,
  shape, strides and storage address;
- every plain attribute of each module (numbers, strings, None, dtypes, devices) by value;
- the probe's input shape and the autocast state of the weight's device.

With a trained head the version counter moves at each optimizer step, so a head is probed once
per optimizer step instead of once per micro-batch (and per forward of the reference model or
of the old policy); a frozen head once every `REPROBE_AFTER` calls (below).

Writes that bypass the version counter are not in the key: `tensor.data` writes and fused
optimizer kernels (`torch.optim.AdamW(fused=True)` leaves `_version` as it was). A verdict that
depends on the weight's or bias's values (a forward that drops a bias that is still zero)
could go stale then, so a kept verdict is used at most `REPROBE_AFTER` times before the probe
runs again whatever the key says; `clear_probe_cache` drops every kept verdict. The same bound
covers state the forward reads from outside the head's tree (a closure's variables, a global,
another module's tensors), which the key does not follow either.

No verdict is kept (the probe runs on every call, as it would without the cache) where the key
cannot see what the forward reads: a module in the tree with tensors besides the probed weight
and bias (a learned scale: its values decide the verdict and a fused optimizer changes them
unseen), with an attribute that is not plain data (a config object, a list, an accelerate
hook), with forward hooks or pre-hooks (or global ones); a weight or bias that is a tensor
subclass (DTensor, FakeTensor) or an inference tensor; and under tracing (torch.compile, a
dispatch mode such as FakeTensorMode), where tensor identity and versions mean something else;
a head class with an equality or hash of its own (the verdicts are kept by module identity).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["REPROBE_AFTER", "clear_probe_cache", "probe_map"]

# A kept verdict is used this many times at most before the probe runs again: a bound on how
# long a write the key cannot see (a .data write, a fused optimizer step) goes unchecked
REPROBE_AFTER = 64

# nn.Module's own bookkeeping attributes (parameters, buffers, submodules, hooks, training):
# the key reads what they hold through their own entries, not as attributes
_MODULE_STATE = frozenset(vars(nn.Module()))
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, nn.Parameter)

# module -> (plain key, weak references to the objects whose identity counts, verdict, uses)
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_probe_cache() -> None:
    """Forget every kept verdict: the next fused call probes its head again (after changing
    a head's tensors through `.data`, or state its forward reads from outside the module)."""
    _VERDICTS.clear()


def probe_map(layer: nn.Module, weight: torch.Tensor, bias, shape: tuple):
    """(what, error): what = None if `layer` computes x·Wᵀ + b (weight [V, D], bias [V] |
    None) on a fixed input of `shape` (last dimension D), else what it gave instead (its
    output's shape or type); error = the message of what the forward raised (what is None
    then), else None. Kept between calls while the key (module docstring) is unchanged."""
    try:
        key = _key(layer, weight, bias, shape)
    except RuntimeError:  # a tensor without a storage address or version (XLA, lazy): no key
        key = None
    if key is None:
        return _run_probe(layer, weight, bias, shape)
    plain, objects = key
    kept = _VERDICTS.get(layer)
    if (kept is not None and kept[0] == plain and kept[3] < REPROBE_AFTER
            and len(kept[1]) == len(objects)
            and all(ref() is obj for ref, obj in zip(kept[1], objects))):
        kept[3] += 1
        return kept[2]
    verdict = _run_probe(layer, weight, bias, shape)
    try:
        refs = [weakref.ref(obj) for obj in objects]
    except TypeError:  # an instance forward that takes no weak reference: keep nothing
        return verdict
    _VERDICTS[layer] = [plain, refs, verdict, 0]
    return verdict


def _run_probe(layer: nn.Module, weight: torch.Tensor, bias, shape: tuple):
    """The probe itself: one forward of `layer` on a fixed input and one comparison."""
    try:
        with torch.no_grad():  # fixed values, no random draw: the caller's RNG stream stays
            x = torch.linspace(-1.0, 1.0, math.prod(shape), device=weight.device)
            x = x.to(weight.dtype).view(shape)
            y, want = layer(x), nn.functional.linear(x, weight, bias)
            if isinstance(y, torch.Tensor) and y.shape == want.shape and torch.allclose(
                    y.float(), want.float(), rtol=1e-3, atol=1e-5):
                return None, None
    except Exception as exc:  # noqa: BLE001  (the callers decide what a failing forward means)
        return None, str(exc)
    return (type(y).__name__ if not isinstance(y, torch.Tensor) else f"{tuple(y.shape)}"), None


def _key(layer: nn.Module, weight: torch.Tensor, bias, shape: tuple):
    """(plain, objects): a tuple of plain values and the objects whose identity counts, that
    together decide the probe's verdict; None where that cannot be read (module docstring)."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or _module._global_forward_hooks or _module._global_forward_pre_hooks):
        return None
    cls = type(layer)  # kept by identity: a class with an equality of its own is not
    if cls.__hash__ is not object.__hash__ or cls.__eq__ is not object.__eq__:
        return None
    probed = [t for t in (weight, bias) if t is not None]
    if any(type(t) not in _TENSOR_TYPES or t.is_inference() for t in probed):
        return None
    device = weight.device.type
    plain: list = [tuple(shape), torch.is_autocast_enabled(device),
                   torch.get_autocast_dtype(device), bias is None]
    for t in probed:
        plain.append((t._version, t.dtype, t.device, tuple(t.shape), t.stride(), t.data_ptr()))
    objects: list = list(probed)
    for m in layer.modules():
        state = _module_key(m, probed, objects)
        if state is None:
            return None
        plain.append(state)
    return tuple(plain), objects


def _module_key(m: nn.Module, probed: list, objects: list):
    """One module's part of the key (appending an instance forward to `objects`), or None
    where it holds what the key cannot follow."""
    if m._forward_hooks or m._forward_pre_hooks:
        return None
    for t in (*m._parameters.values(), *m._buffers.values()):
        if t is not None and not any(t is p for p in probed):
            return None
    cls = type(m)
    attrs = []
    for name, value in vars(m).items():
        if name in _MODULE_STATE:
            continue
        if name == "forward":  # replaced on the instance: its identity counts
            objects.append(value)
            attrs.append((name, None))
        elif type(value) in _PLAIN:
            attrs.append((name, type(value), value))
        else:
            return None
    return cls, cls.forward, cls.__call__, m.training, tuple(attrs)
