"""Value checks: every token id inside the vocabulary, every advantage and mask entry finite, a
normalizer positive. A check of a value reads it, and on a GPU reading a value on the host waits
for the whole queue of work before it (the model's forward, the loss's kernels), so there are
three ways to check:

- on the CPU, or where a host read is paid anyway (the four-pass ops' bodies): read it now and
  raise the error that names the argument (`check_token_id_values`, `check_finite_advantages`);
- under torch.compile: an in-graph assertion (no host read, no graph break);
- on CUDA where nothing else reads the device (the three-pass route, a normalizer given as a
  CUDA tensor, a CUDA completion mask): a device check (`defer`). Its flag is copied without
  blocking into pinned host memory behind an event; the next loss call and the loss's backward
  raise its error once the event says the copy has landed (`raise_ready`, which never waits
  unless asked to), and the call that computed it makes its loss NaN where it can (`poison`),
  so a bad batch never gives a number that looks right. The kernels it feeds clamp the ids
  they load, so nothing reads out of bounds meanwhile.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from .params import in_float32_range

# device checks in flight: (pinned flag, event behind its copy, the error's message)
_PENDING: deque = deque()
NAN_NOTE = " (found by a device check of an earlier call; that call's loss was NaN)"


def check_token_id_values(name: str, ids: torch.Tensor, vocab_size: int,
                          vocab_from: str = "weight.shape[0]") -> None:
    """Every id in [0, vocab_size): an out-of-range id would read out of bounds. Under
    torch.compile (code traced around the ops, e.g. the reference) an in-graph assertion."""
    if torch.compiler.is_compiling():
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(),
                            f"{name} has a token id outside [0, {vocab_size}) ({vocab_from})")
        return
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        lo, hi = int(lo), int(hi)  # one host sync
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            hint = ("; padded positions need a valid id such as the pad token, not -100"
                    if bad < 0 else "")
            raise ValueError(f"{name} has token id {bad} outside [0, {vocab_size}) (vocabulary "
                             f"size = {vocab_from}){hint}")


def check_finite_advantages(advantages: torch.Tensor) -> None:
    """No NaN/inf; under torch.compile an in-graph assertion (no graph break)."""
    if torch.compiler.is_compiling():
        torch._assert_async(torch.isfinite(advantages).all(),
                            "advantages contain NaN or inf (docs/semantics.md: nan_to_num)")
        return
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages contain NaN or inf; use 0 for completions that could not be "
                         "scored (docs/semantics.md: nan_to_num)")


def check_finite_mask(mask: torch.Tensor) -> torch.Tensor:
    """completion_mask [B, T] (or [N]) float32 without NaN or ±inf; returns it. A non-finite
    entry would reach every token through the normalizers (Σ mask), and the gradient at padded
    positions through 0·NaN on the routes that compute those rows, so it is refused.

    On the CPU a host read (free); under torch.compile an in-graph assertion; on CUDA a device
    check (`defer`), the mask then made all NaN (no host read) so that the call's loss is NaN
    as the error's note says."""
    message = ("completion_mask contains NaN or inf; it must hold finite token weights (1 for a "
               "real completion token, 0 for padding)")
    finite = torch.isfinite(mask).all()
    if torch.compiler.is_compiling():
        torch._assert_async(finite, message)
        return mask
    if mask.device.type == "cuda":
        defer(~finite, message)
        return torch.where(finite, mask, torch.full_like(mask, float("nan")))
    if not bool(finite):
        raise ValueError(message)
    return mask


def defer(failed: torch.Tensor, message: str) -> None:
    """Queue a device check: `failed` is a 0-dim bool CUDA tensor, True when the check failed;
    `message` is the error raised for it (by `raise_ready`)."""
    raise_ready()  # an earlier call's failure first
    if failed.device.type != "cuda":  # (a CPU flag is ready at once: how the tests drive it)
        _PENDING.append((failed.detach().clone(), None, message))
        return
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(failed, non_blocking=True)
    done = torch.cuda.Event()  # on the stream the copy ran on: the flag's device's, which is
    done.record(torch.cuda.current_stream(failed.device))  # not the current one under device_map
    _PENDING.append((host, done, message))


def raise_ready(wait: bool = False) -> None:
    """Raises the error of the oldest device check that failed and whose flag has landed;
    checks still in flight stay queued (with wait=True, they are waited for)."""
    while _PENDING:
        host, done, message = _PENDING[0]
        if done is not None:
            if not wait and not done.query():
                return
            done.synchronize()
        _PENDING.popleft()
        if bool(host):
            raise ValueError(message + NAN_NOTE)


def poison(value: torch.Tensor, failed: torch.Tensor | None) -> torch.Tensor:
    """value, or NaN where a device check failed (no host read)."""
    if failed is None:
        return value
    return torch.where(failed, torch.full_like(value, float("nan")), value)


def check_ids_and_advantages(ids: torch.Tensor, vocab_size: int, advantages: torch.Tensor,
                             ids_name: str = "completion_ids",
                             vocab_from: str = "weight.shape[0]") -> torch.Tensor | None:
    """ids [N] int64 in [0, vocab_size) and finite advantages. On the CPU: the host checks
    (raise now). On CUDA: device checks (`defer`); returns their combined flag, a 0-dim bool
    tensor on the device, for `poison`."""
    if ids.device.type != "cuda":
        check_token_id_values(ids_name, ids, vocab_size, vocab_from)
        check_finite_advantages(advantages)
        return None
    bad_ids = ((ids < 0) | (ids >= vocab_size)).any()
    bad_advantages = ~torch.isfinite(advantages).all()
    defer(bad_ids, f"{ids_name} has a token id outside [0, {vocab_size}) (vocabulary size = "
                   f"{vocab_from}); padded positions need a valid id such as the pad token, "
                   "not -100")
    defer(bad_advantages, "advantages contain NaN or inf; use 0 for completions that could not "
                          "be scored (docs/semantics.md: nan_to_num)")
    return bad_ids | bad_advantages


def check_normalizer(name: str, value, device) -> torch.Tensor | None:
    """A count or normalizer that the caller passes (num_items_in_batch): None, a Python number
    or a one-element tensor on any device, finite and > 0. Returns None or the value as a 0-dim
    float32 tensor on `device` (one form for the formulas downstream).

    A CPU tensor's value is read to the host (free). A CUDA tensor's is checked on the device
    (`defer`: reading it would wait for the device's queue; the error comes at the
    next loss call or backward). Under torch.compile the check is an in-graph assertion, as for
    the other value checks (no host read, no graph break)."""
    if value is None:
        return None
    expected = f"{name} must be a positive finite number"
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
        # a symbolic int under torch.compile; float32 must hold it (1e300 would be inf: loss 0)
        if not (in_float32_range(value) and value > 0):
            raise ValueError(f"{expected} (at most 3.4e38, float32's largest), got {value!r}")
        return torch.tensor(value, device=device, dtype=torch.float32)
    if value.numel() != 1:
        raise ValueError(f"{name} must be a number or a one-element tensor, "
                         f"got shape {tuple(value.shape)}")
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise TypeError(f"{name} must be a real-valued tensor, got {value.dtype}")
    if torch.compiler.is_compiling():
        out = value.reshape(()).to(device=device, dtype=torch.float32)
        torch._assert_async((out > 0) & torch.isfinite(out), f"{expected} (> 0, not NaN or inf)")
        return out
    if value.device.type == "cuda":  # a device check: reading it would wait for the queue
        out = value.reshape(()).to(device=device, dtype=torch.float32)
        defer(~((out > 0) & torch.isfinite(out)), f"{expected} (> 0, not NaN or inf)")
        return out
    number = float(value)  # a CPU tensor: a free host read (float64 1e300 is inf in float32)
    if not (math.isfinite(number) and number > 0 and in_float32_range(number)):
        raise ValueError(f"{expected} (at most 3.4e38, float32's largest), got {number!r} "
                         f"(a tensor on {value.device})")
    return value.reshape(()).to(device=device, dtype=torch.float32)
