"""What every provider of the kernel sweep shares: the loss configuration (`LossConfig`), the
inputs drawn for a shape (`fused_inputs`, `logits_inputs`: hidden states and weight with O(1)
logits, random ids and advantages, ~25 % padding at the end of the sequences, old/ref log-probs
within ~0.1 nats of the policy's; never zeros), the `Case` a provider builds (a loss call to
time and the tensors that receive gradients) and the `Provider` record. `providers.py` and
`peer_providers.py` build on it.

The head's weight is a `torch.nn.Parameter`, as every model's lm_head weight is: a library that
treats tensor subclasses apart (a dispatch route, a type check) meets the case users run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from . import Shape

GRADED = ("backward", "fwd+bwd")  # modes that produce gradients


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "dapo"
    beta: float = 0.04
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    inplace: bool = False  # logits path: may the backward overwrite the logits with their grad?
    backend: str | None = None  # ours, fused linear: force "chunked" / "triton"; None = dispatch

    def ours(self) -> dict:
        return dict(beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                    temperature=self.temperature, loss_type=self.loss_type)


@contextlib.contextmanager
def env_vars(values: Mapping[str, str | None]) -> Iterator[None]:
    """Sets each variable to its value (None: unsets it) for the block, then puts back what it
    found, so that one provider's setting never reaches the next provider's calls."""
    found = {k: os.environ.get(k) for k in values}

    def apply(vals):
        for k, v in vals.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    apply(values)
    try:
        yield
    finally:
        apply(found)


@contextlib.contextmanager
def routes_taken(into: list[str]) -> Iterator[None]:
    """Appends to `into` the route (three-pass, four-pass, forward-only) of every linear-head
    loss call made in the block, as the call itself decides it: the library's
    `route.linear_loss_route`, which each call consults (its log line is written once per
    process, so it cannot say what a given row ran)."""
    from grpo_kernels.ops import route

    decide = route.linear_loss_route

    def spy(*args, **kwargs):
        taken = decide(*args, **kwargs)
        into.append(taken.path)
        return taken

    route.linear_loss_route = spy
    try:
        yield
    finally:
        route.linear_loss_route = decide


class NotMeasured(Exception):
    """A mode a case cannot time honestly (the message says why); its row reads "n/a: ..."."""


@dataclass
class Case:
    """Inputs built for one (provider, shape) and the loss call on them. `env`: environment
    variables set (a str) or unset (None) around every loss call and every backward of the
    case, and restored after each (the library reads them at each call, some in the backward)."""

    loss: Callable[[], torch.Tensor]  # returns the 0-dim loss, with an autograd graph
    leaves: list[torch.Tensor]  # tensors that receive gradients
    input_bytes: int
    note: str = ""
    keep: list = field(default_factory=list)  # the other inputs, kept alive with the case
    # Modes whose time covers the work the FLOP/byte accounting assumes. Liger's fused linear
    # loss computes the gradients inside forward, so only its fwd+bwd gets a rate.
    rated_modes: tuple[str, ...] = ("score", "forward", "backward", "fwd+bwd")
    # False where the CPU memory tracker (a dispatch mode) cannot run the call: torch.compile
    # skips frames under a dispatch mode, and a fullgraph compile then raises
    cpu_memory: bool = True
    env: dict[str, str | None] = field(default_factory=dict)
    # mode -> why this case has no time for it: `step(mode)` raises NotMeasured, and the row
    # says "n/a: <why>" instead of a time that is not the mode's cost
    unmeasured: dict[str, str] = field(default_factory=dict)
    # the positions the loss reads (the unmasked ones): the rows the work is counted on
    # (`benchmarks.head_flops`); None: every position
    positions: int | None = None
    # mode -> the route its loss calls must take (ours); `routes` holds what they took, seen in
    # the first call of each step (`routes_taken`); a row whose route differs is not "ok"
    expect_route: dict[str, str] = field(default_factory=dict)
    routes: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self):
        if self.env:  # every call of `loss`, also one made outside `step`, sees the variables
            inner = self.loss

            def loss() -> torch.Tensor:
                with env_vars(self.env):
                    return inner()

            self.loss = loss

    @property
    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def step(self, mode: str) -> Callable[[], None]:
        """The callable to time for `mode` (for "backward", the forward runs here, untimed, and
        each call is a backward of that one graph, kept with retain_graph). The routes of the
        loss calls made here and in its first call go to `routes[mode]`."""
        taken = self.routes.setdefault(mode, [])
        with routes_taken(taken):
            inner = self._step(mode)
        first = [True]

        def call() -> None:
            if first:
                first.clear()
                with routes_taken(taken):
                    return inner()
            return inner()

        return call

    def route_check(self, mode: str) -> tuple[str | None, str | None]:
        """(the note naming the routes `mode`'s calls took, or None if they took none; the
        status of a row whose route is not `expect_route[mode]`, else None)."""
        taken = sorted(set(self.routes.get(mode, ())))
        note = f"route: {', '.join(taken)}" if taken else None
        want = self.expect_route.get(mode)
        if want is None or taken == [want]:
            return note, None
        return note, f"wrong route: took {', '.join(taken) or 'none'}, expected {want}"

    def _step(self, mode: str) -> Callable[[], None]:
        if mode in self.unmeasured:
            raise NotMeasured(self.unmeasured[mode])
        if mode == "forward":
            def forward():
                self.loss()  # the graph (saved activations) is built, then dropped

            return forward
        if mode == "score":
            def score():
                with torch.no_grad():  # no graph: the routes a scoring call takes
                    self.loss()

            return score
        if mode == "fwd+bwd":
            def fwd_bwd():
                with env_vars(self.env):
                    self.loss().backward()

            return fwd_bwd
        if mode == "backward":
            loss = self.loss()

            def backward():
                with env_vars(self.env):
                    loss.backward(retain_graph=True)

            return backward
        raise ValueError(f"unknown mode {mode!r}")

    def timed_fresh_step(self, mode: str) -> Callable[[], float]:
        """`step(mode)` with the leaves' gradients cleared first (a fresh accumulation, as in a
        training step); each call returns the step's wall time in seconds (the clearing
        untimed). For CPU timings: a device step needs a synchronize."""
        step = self.step(mode)

        def call() -> float:
            for t in self.leaves:
                t.grad = None
            t0 = time.perf_counter()
            step()
            return time.perf_counter() - t0

        return call


@dataclass(frozen=True)
class Provider:
    kernel: str  # "fused_linear" | "logits"
    name: str  # one of NAMES
    build: Callable[[Shape, torch.dtype, torch.device, LossConfig], Case]
    unavailable: Callable[[torch.device], str | None]  # reason it cannot run here, or None
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.kernel}/{self.name}"


# ---- inputs ---------------------------------------------------------------------------------


def _batch(shape: Shape, device, seed: int):
    """ids, advantages [B], int64 mask [B, T] with 0-50% trailing padding per sequence."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, T = shape.B, shape.T
    ids = torch.randint(0, shape.V, (B, T), device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    keep = torch.randint(T // 2, T + 1, (B,), device=device, generator=g)
    mask = (torch.arange(T, device=device)[None, :] < keep[:, None]).long()
    return g, ids, adv, mask


def _near(logp: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A log-prob within ~0.1 nats of logp (ratios straddle the clip range), still <= 0."""
    noise = torch.randn(logp.shape, device=logp.device, generator=g)
    return (logp + 0.1 * noise).clamp(max=0.0).contiguous()


@torch.no_grad()
def _logp_blocks(blocks: Iterable[tuple[int, torch.Tensor]], ids: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """Policy log-probs [B, T] from (first row, logits [rows, V]) blocks (never [N, V])."""
    flat = ids.reshape(-1)
    out = torch.empty(flat.numel(), device=ids.device, dtype=torch.float32)
    for i, rows in blocks:
        z = rows.float() / temperature
        j = i + z.shape[0]
        out[i:j] = z.gather(1, flat[i:j, None]).squeeze(1) - z.logsumexp(1)
    return out.reshape(ids.shape)


def _chunk(V: int) -> int:
    return max(1, 2**27 // V)  # [chunk, V] float32 scratch of at most 512 MiB


def fused_inputs(shape: Shape, dtype, device, cfg: LossConfig, seed: int = 0):
    """hidden [B, T, D] (a leaf tensor) and weight [V, D] (an nn.Parameter, as a model's
    lm_head.weight), ids, adv, mask, old, ref ([B, T])."""
    g, ids, adv, mask = _batch(shape, device, seed)
    hidden = torch.randn(shape.B, shape.T, shape.D, device=device, dtype=dtype, generator=g)
    weight = torch.randn(shape.V, shape.D, device=device, dtype=dtype, generator=g)
    weight.mul_(2.0 / shape.D**0.5)  # logits ~ N(0, 4): softmax neither flat nor one-hot
    h2, c = hidden.reshape(shape.N, shape.D), _chunk(shape.V)
    blocks = ((i, h2[i:i + c] @ weight.T) for i in range(0, shape.N, c))
    logp = _logp_blocks(blocks, ids, cfg.temperature)
    old, ref = _near(logp, g), _near(logp, g)
    del logp
    return hidden.requires_grad_(), torch.nn.Parameter(weight), ids, adv, mask, old, ref


def logits_inputs(shape: Shape, dtype, device, cfg: LossConfig, seed: int = 0, extra: int = 0):
    """logits [B, T + extra, V] (leaf), ids, adv, mask, old, ref. Liger's logits kernel takes
    one more position per sequence (the model's last logit, ignored): extra=1."""
    g, ids, adv, mask = _batch(shape, device, seed)
    logits = torch.randn(shape.B, shape.T + extra, shape.V, device=device, dtype=dtype,
                         generator=g)
    logits.mul_(2.0)
    T, c = shape.T, _chunk(shape.V)
    blocks = ((b * T + t, logits[b, t:min(t + c, T)]) for b in range(shape.B)
              for t in range(0, T, c))  # only the first T positions of each sequence
    logp = _logp_blocks(blocks, ids, cfg.temperature)
    old, ref = _near(logp, g), _near(logp, g)
    del logp
    return logits.requires_grad_(), ids, adv, mask, old, ref


def fused_case(loss: Callable[[], torch.Tensor], inputs: tuple, note: str = "", **kw) -> Case:
    """The Case of a fused linear provider: `inputs` as `fused_inputs` returns them (hidden and
    weight receive gradients), the work counted on the unmasked positions."""
    h, w, ids, adv, mask, old, ref = inputs
    return Case(loss, [h, w], nbytes(*inputs), note, [ids, adv, mask, old, ref],
                positions=int(mask.sum()), **kw)


def logits_case(loss: Callable[[], torch.Tensor], inputs: tuple, note: str = "", **kw) -> Case:
    """The Case of a logits-path provider: `inputs` as `logits_inputs` returns them (the logits
    receive gradients), the bytes counted on the unmasked positions."""
    logits, ids, adv, mask, old, ref = inputs
    return Case(loss, [logits], nbytes(*inputs), note, [ids, adv, mask, old, ref],
                positions=int(mask.sum()), **kw)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
