"""The cases of the vocabulary-parallel tests: what each computes on one process with the whole
head and on every rank with its shard, and the differences the tests bound. Imported by the
worker (`vp_worker.py`, run under torchrun) and by the tests (for their parameters)."""

from __future__ import annotations

import itertools
import os

import torch

from grpo_kernels import force_backend, fused_linear_grpo_loss, selective_logprobs
from grpo_kernels.loss_specs import spec_of
from grpo_kernels.params import ALL_LOSS_TYPES

B, T, D, V = 3, 6, 16, 37  # V = 37: uneven shards for every tp (19/18, 10/9/9/9)
TYPE_LEVELS = [(t, lv) for t in ALL_LOSS_TYPES for lv in spec_of(t).levels]


def loss_cases(tp: int) -> dict[str, dict]:
    """{name: options}: every loss type at every level it has, on both routes, chunked backend;
    Triton (the interpreter on a CPU) at every type's first level on both routes. Options
    rotate through packed rows, the entropy bonus, a temperature, a bias, beta, the mixed head
    and the DTensor form, so that each appears on both backends and routes."""
    cases = {}
    rotation = itertools.cycle([
        dict(packed=True, entropy_coef=0.01, temperature=0.7, bias=True, beta=0.04),
        dict(packed=False, entropy_coef=0.0, temperature=1.0, bias=False, beta=0.0,
             form="dtensor"),
        dict(packed=False, entropy_coef=0.02, temperature=1.3, bias=True, beta=0.04,
             mixed=True),
        dict(packed=True, entropy_coef=0.0, temperature=0.9, bias=False, beta=0.0,
             form="dtensor", mixed=True),
        dict(packed=True, entropy_coef=0.01, temperature=1.1, bias=True, beta=0.0,
             form="dtensor"),
    ])  # five: each meets both routes (which alternate)
    for backend in ("chunked", "triton"):
        levels = TYPE_LEVELS if backend == "chunked" else [
            (t, spec_of(t).levels[0]) for t in ALL_LOSS_TYPES]
        if tp > 2:  # fewer cases with more processes on the same cores
            levels = levels[::3] if backend == "chunked" else levels[:2]
        for (loss_type, level), three in itertools.product(levels, (False, True)):
            opts = dict(next(rotation), backend=backend, loss_type=loss_type, level=level,
                        three_pass=three)
            cases[f"{backend}-{loss_type}-{level}-{'three' if three else 'four'}"] = opts
    cases["chunked-return_terms"] = dict(backend="chunked", loss_type="dapo", level="token",
                                         three_pass=True, return_terms=True, bias=True)
    return cases


def logprob_cases() -> dict[str, dict]:
    return {f"{backend}-{form}{'-mixed' if mixed else ''}": dict(backend=backend, form=form,
                                                                 mixed=mixed)
            for backend in ("chunked", "triton") for form in ("local", "dtensor")
            for mixed in (False, True)}


def shard_sizes(tp: int) -> list[int]:
    """torch.chunk's split of V (DTensor's Shard(0)): every rank but the last ceil(V / tp)."""
    return [len(c) for c in torch.arange(V).chunk(tp)]


def make_inputs(opts: dict, seed: int = 0) -> dict:
    """The same tensors on every rank (seeded): whole head, ids, the GRPO batch."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * (2.0 / D ** 0.5)
    bias = torch.randn(V, generator=g) * 0.5 if opts.get("bias") else None
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([T, 3, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        logits = hidden @ weight.T + (0 if bias is None else bias)
        logp = torch.log_softmax(logits / opts.get("temperature", 1.0), -1)
        logp = logp.gather(-1, ids[..., None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    batch = dict(hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, adv=adv, old=old,
                 ref=ref, cu_seqlens=None)
    if opts.get("packed"):
        keep = mask.bool()
        batch.update(hidden=hidden[keep], ids=ids[keep], old=old[keep], ref=ref[keep],
                     mask=None, cu_seqlens=torch.cat([torch.zeros(1), lengths.cumsum(0)]).long())
    if opts.get("mixed"):  # 16-bit hidden states with a float32 head
        batch["hidden"] = batch["hidden"].bfloat16()
    if opts.get("float64"):  # the truth: the same values in float64
        batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in batch.items()}
    return batch


def local_rows(tensor, rank: int, tp: int):
    sizes = shard_sizes(tp)
    start = sum(sizes[:rank])
    return None if tensor is None else tensor[start:start + sizes[rank]]


def _loss(batch, weight, bias, opts, **kw):
    hyper = dict(loss_type=opts["loss_type"], importance_sampling_level=opts["level"],
                 beta=opts.get("beta", 0.0), temperature=opts.get("temperature", 1.0),
                 entropy_coef=opts.get("entropy_coef", 0.0), max_completion_length=T,
                 epsilon_high=5.0 if opts["loss_type"] == "cispo" else 0.28)
    return fused_linear_grpo_loss(
        batch["hidden"], weight, batch["ids"], batch["adv"], batch["mask"], batch["old"],
        batch["ref"] if hyper["beta"] else None, bias, cu_seqlens=batch["cu_seqlens"],
        return_terms=opts.get("return_terms", False), **hyper, **kw)


def run_loss(opts: dict, head=None, batch=None, **kw) -> dict:
    """Loss, metrics and gradients of one case; head = (weight, bias) as this rank passes them
    (default: the whole head, on one process); batch: `make_inputs(opts)` made beforehand.
    kw: vocab_group= for the local form."""
    batch = dict(make_inputs(opts) if batch is None else batch)
    batch["hidden"] = batch["hidden"].clone().requires_grad_()
    weight, bias = head if head is not None else (batch["weight"], batch["bias"])
    weight = torch.nn.Parameter(weight.detach().clone()) if not _is_dtensor(weight) else weight
    if bias is not None and not _is_dtensor(bias):
        bias = torch.nn.Parameter(bias.detach().clone())
    os.environ["GRPO_KERNELS_THREE_PASS"] = "1" if opts.get("three_pass") else "0"
    with force_backend(opts["backend"]):
        out = _loss(batch, weight, bias, opts, **kw)
        if opts.get("return_terms"):
            loss, metrics = out.policy_loss + out.entropy.sum() * 0.01, {
                "logp": out.logp, "ratio": out.ratio}
        else:
            loss, metrics = out
        loss.backward()
    return dict(loss=loss.detach(), metrics={k: v.detach() for k, v in metrics.items()},
                d_hidden=batch["hidden"].grad, d_weight=_local(weight.grad),
                d_bias=None if bias is None else _local(bias.grad))


def run_logprobs(opts: dict, head=None, **kw) -> dict:
    batch = make_inputs(dict(opts, bias=True))
    hidden = batch["hidden"].clone().requires_grad_()
    weight, bias = head if head is not None else (batch["weight"], batch["bias"])
    if not _is_dtensor(weight):
        weight, bias = (torch.nn.Parameter(x.detach().clone()) for x in (weight, bias))
    with force_backend(opts["backend"]):
        logp, ent = selective_logprobs(hidden, weight, batch["ids"], bias, temperature=0.8,
                                       return_entropy=True, **kw)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp) + 0.1 * ent).sum().backward()
    return dict(logp=logp.detach(), entropy=ent.detach(), d_hidden=hidden.grad,
                d_weight=_local(weight.grad), d_bias=_local(bias.grad))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def truth_of(opts: dict) -> dict:
    """The case on the whole head in float64 (the chunked backend): what both are compared to
    where they differ by more than float32 rounding."""
    return run_loss(dict(opts, float64=True, mixed=False, backend="chunked"),
                    batch=make_inputs(dict(opts, float64=True)))


def differences(whole: dict, mine: dict, rank: int, tp: int, truth: dict | None = None) -> dict:
    """{quantity: (max |mine - whole|, max |whole|, max |whole - truth|, max |mine - truth|)}
    (the last two 0 without a truth); the whole head's weight and bias gradients are cut to
    this rank's rows."""
    out = {}
    for k, want in whole.items():
        if want is None:
            continue
        cut = (lambda x: local_rows(x, rank, tp)) if k in ("d_weight", "d_bias") else (
            lambda x: x)
        pairs = want.items() if isinstance(want, dict) else [(None, want)]
        for m, w in pairs:
            got = mine[k] if m is None else mine[k][m]
            true = None if truth is None else truth[k] if m is None else truth[k][m]
            w, got, true = cut(w), got, None if true is None else cut(true)
            out[k if m is None else f"metric/{m}"] = (
                *_diff(got, w), *((0.0, 0.0) if true is None else (_diff(w, true)[0],
                                                                   _diff(got, true)[0])))
    return out


def _diff(got, want):
    return (float((got.double() - want.double()).abs().max()) if want.numel() else 0.0,
            float(want.double().abs().max()) if want.numel() else 0.0)
