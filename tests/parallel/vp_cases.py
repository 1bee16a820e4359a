"""The cases of the vocabulary-parallel tests: what each computes on every rank with its shard,
and through PyTorch's reference on the whole head in float64 (the truth) and in float32 (the
yardstick), whose errors the tests bound. Imported by the worker (`vp_worker.py`, run under
torchrun) and by the tests (for their parameters)."""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import torch

from grpo_kernels import force_backend, fused_linear_grpo_loss, reference, selective_logprobs
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


def shard_sizes(tp: int, rows: int = V) -> list[int]:
    """torch.chunk's split of V (DTensor's Shard(0)): every rank but the last ceil(V / tp)."""
    return [len(c) for c in torch.arange(rows).chunk(tp)]


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
    """This rank's rows of a whole head's [V, ...] tensor (None stays None)."""
    if tensor is None:
        return None
    sizes = shard_sizes(tp, tensor.shape[0])
    start = sum(sizes[:rank])
    return tensor[start:start + sizes[rank]]


def _loss(batch, weight, bias, opts, fn=fused_linear_grpo_loss, **kw):
    hyper = dict(loss_type=opts["loss_type"], importance_sampling_level=opts["level"],
                 beta=opts.get("beta", 0.0), temperature=opts.get("temperature", 1.0),
                 entropy_coef=opts.get("entropy_coef", 0.0), max_completion_length=T,
                 epsilon_high=5.0 if opts["loss_type"] == "cispo" else 0.28)
    if opts.get("return_terms"):
        kw["return_terms"] = True
    return fn(batch["hidden"], weight, batch["ids"], batch["adv"], batch["mask"], batch["old"],
              batch["ref"] if hyper["beta"] else None, bias, cu_seqlens=batch["cu_seqlens"],
              **hyper, **kw)


def _reference_terms(hidden, weight, ids, adv, mask, old, ref, bias, *, cu_seqlens,
                     return_terms, **hyper):
    """What the return_terms case reads of `GRPOTerms` (policy_loss, entropy, logp, ratio; a
    token-level loss on a padded batch, entropy_coef 0), from PyTorch's reference."""
    assert cu_seqlens is None and hyper["importance_sampling_level"] == "token"
    policy = reference.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, ref, bias,
                                              **hyper)[0]
    logp, ent = reference.selective_logprobs(hidden, weight, ids, bias,
                                             temperature=hyper["temperature"],
                                             return_entropy=True)
    ratio = torch.where(mask > 0, torch.exp(logp - old), 1.0)  # 1 at padding, as GRPOTerms
    return argparse.Namespace(policy_loss=policy, entropy=ent, logp=logp, ratio=ratio)


def run_loss(opts: dict, head=None, batch=None, **kw) -> dict:
    """Loss, metrics and gradients of one case; head = (weight, bias) as this rank passes them
    (default: the whole head, on one process); batch: `make_inputs(opts)` made beforehand.
    kw: vocab_group= for the local form, fn= another implementation (`reference_of`)."""
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


def run_logprobs(opts: dict, head=None, batch=None, fn=selective_logprobs, **kw) -> dict:
    """Selective log-probs, entropies and the gradients of a weighted sum of them; arguments
    as `run_loss`'s (the batch: `make_inputs(dict(opts, bias=True))`)."""
    batch = make_inputs(dict(opts, bias=True)) if batch is None else batch
    hidden = batch["hidden"].clone().requires_grad_()
    weight, bias = head if head is not None else (batch["weight"], batch["bias"])
    if not _is_dtensor(weight):
        weight, bias = (torch.nn.Parameter(x.detach().clone()) for x in (weight, bias))
    with force_backend(opts["backend"]):
        logp, ent = fn(hidden, weight, batch["ids"], bias, temperature=0.8,
                       return_entropy=True, **kw)
        g = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)
        (logp * g + 0.1 * ent).sum().backward()
    return dict(logp=logp.detach(), entropy=ent.detach(), d_hidden=hidden.grad,
                d_weight=_local(weight.grad), d_bias=_local(bias.grad))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def reference_of(opts: dict, float64: bool, draw: int = 0) -> dict:
    """The case through PyTorch's reference (`grpo_kernels.reference`: [N, V] logits and
    torch's log_softmax) on the whole head, in float32 (the yardstick: PyTorch's own float32
    error) or float64 (the truth). A mixed head's 16-bit hidden states are read as float32
    (the same values, as the mixed head reads them).

    draw > 0: the same head with its hidden and vocabulary dimensions in another (seeded)
    order, the results put back in the case's order. In exact arithmetic nothing changes; in
    float32 every sum over D and over V is taken in another order: another equally valid
    float32 result, whose error against the truth is as much PyTorch's as draw 0's.

    A mixed head on Triton reads its float32 weight with about 16 significant bits
    (`kernels.precision.split_dot`: w = hi + lo + r, hi = bf16(w), lo = bf16(w - hi), the dot
    takes hi + lo): PyTorch's yardstick there is its float32 error on the weight as that head
    reads it, hi + lo."""
    logprobs = "loss_type" not in opts  # a `logprob_cases` case
    batch = make_inputs(dict(opts, float64=float64, mixed=False, bias=logprobs or opts.get(
        "bias")))
    if opts.get("mixed"):
        batch["hidden"] = batch["hidden"].bfloat16().to(batch["weight"].dtype)
        if opts["backend"] == "triton" and not float64:
            hi = batch["weight"].bfloat16().float()
            batch["weight"] = hi + (batch["weight"] - hi).bfloat16().float()
    fn = _reference_terms if opts.get("return_terms") else reference.fused_linear_grpo_loss
    run = functools.partial(run_loss, fn=fn)
    if logprobs:
        run = functools.partial(run_logprobs, fn=reference.selective_logprobs)
    return in_another_order(lambda b: run(dict(opts, backend="chunked"), batch=b), batch, draw)


def in_another_order(run, batch: dict, draw: int) -> dict:
    """run(batch) with the head's hidden and vocabulary dimensions in the order of `draw`
    (seeded; 0: as given), its d_hidden, d_weight and d_bias put back in the batch's order.
    batch: hidden [..., D], weight [V, D], bias [V] | None, ids [...]."""
    if not draw:
        return run(batch)
    (Vb, Db), g = batch["weight"].shape, torch.Generator().manual_seed(1000 + draw)
    pd, pv = torch.randperm(Db, generator=g), torch.randperm(Vb, generator=g)
    inv_v = torch.argsort(pv)  # new id of vocabulary entry v
    out = run(dict(batch, hidden=batch["hidden"][..., pd], weight=batch["weight"][pv][:, pd],
                   bias=None if batch["bias"] is None else batch["bias"][pv],
                   ids=inv_v[batch["ids"]]))
    inv_d = torch.argsort(pd)
    out.update(d_hidden=out["d_hidden"][..., inv_d], d_weight=out["d_weight"][inv_v][:, inv_d],
               d_bias=None if out.get("d_bias") is None else out["d_bias"][inv_v])
    return out


def torch_error(opts: dict, truth: dict, rank: int, tp: int, draws: int = 4) -> dict:
    """{quantity: PyTorch's float32 error}: the largest of `draws` equally valid float32
    results (`reference_of`) against the truth, so that the yardstick is PyTorch's error on
    this case and not one lucky rounding (one draw's error on a loss value varies tenfold)."""
    out = {}
    zero = _Zero()
    for d in range(draws):
        draw = reference_of(opts, False, d)
        draw.update({k: local_rows(draw[k], rank, tp) for k in ("d_weight", "d_bias")})
        for k, (err, _, _) in errors(draw, zero, truth, rank, tp).items():
            out[k] = max(out.get(k, 0.0), err)
    return out


class _Zero(dict):
    """{any quantity: 0.0}: `errors` without a yardstick."""

    def __missing__(self, key):
        return 0.0


def errors(mine: dict, torch32: dict, truth: dict, rank: int, tp: int) -> dict:
    """{quantity: (max |mine - truth|, PyTorch's float32 error, max |truth|)}: this rank's
    results (the shard's weight and bias gradients) against the float64 truth (the whole
    head's, cut to this rank's rows); torch32: `torch_error`'s."""
    out = {}
    for k, true in truth.items():
        if true is None:
            continue
        whole = k in ("d_weight", "d_bias") and mine[k].shape != true.shape
        cut = (lambda x: local_rows(x, rank, tp)) if whole else (lambda x: x)
        pairs = true.items() if isinstance(true, dict) else [(None, true)]
        for m, t in pairs:
            name = k if m is None else f"metric/{m}"
            t = cut(t)
            out[name] = (_diff(mine[k] if m is None else mine[k][m], t)[0], torch32[name],
                         float(t.double().abs().max()) if t.numel() else 0.0)
    return out


def _diff(got, want):
    return (float((got.double() - want.double()).abs().max()) if want.numel() else 0.0,
            float(want.double().abs().max()) if want.numel() else 0.0)


# ---- rows dominated by one token --------------------------------------------------------------

def dominated_cases() -> dict[str, dict]:
    """{name: options}: rows dominated by their target or by another token (p ≈ 1 - e^-12 ..
    1 - e^-40, `test_dominated_rows.dominated_head`), at τ = 1 and at τ = 0.01 with moderate raw
    logits; selective log-probs (the four-pass route) and the GRPO loss on both routes, chunked
    backend, V = 4096, and the three-pass route's second backward of a retained graph
    ("second": it runs the passes again and reads p against the statistics combined over its
    own logits); and the Triton three-pass route's row kernels (V = 64, in the interpreter),
    first and second backward, at rows dominated by their target or by another token: p read
    against the combined statistics, e^((z - m) - ln S), not e^(z - lse) through the float32
    lse, which gave 4.1-8.3x PyTorch's error at rows dominated by another token, and 18-62x
    on the second backward (then the Triton four-pass backward, which reads the lse),
    target or not. The loss: dapo with beta = 0.04 and the entropy bonus (`run_dominated`).
    The Triton four-pass cases ("logprobs", "four") run the linear-head kernels, whose forward
    logp and backward read the target and p through the lse: `through_lse`."""
    cases = {f"{who}-{what}-t{t:g}": dict(who=who, what=what, temperature=t, V=4096,
                                          backend="chunked")
             for who in ("target", "other")
             for what in ("logprobs", "four", "three", "second")
             for t in (1.0, 0.01)}
    cases.update({f"triton-{who}-{what}-t{t:g}": dict(who=who, what=what, temperature=t, V=64,
                                                      backend="triton")
                  for who in ("target", "other") for what in ("logprobs", "four", "three",
                                                              "second")
                  for t in (1.0, 0.01)})
    return cases


def through_lse(opts: dict) -> bool:
    """A dominated case whose route reads p through the float32 lse (the Triton linear-head
    kernels of the four-pass route; tests/api/test_dominated_rows_routes.py's strict xfail
    `test_triton_four_pass_at_dominated_rows` on a whole head): 8-140x PyTorch's float32
    error at these rows, V = 64, in the interpreter."""
    return opts["backend"] == "triton" and opts["what"] in ("logprobs", "four")


def dominated_head(opts: dict):
    """(hidden [2, 6, 16], weight [V, 16], ids [2, 6], g [2, 6]) of a dominated case; g: the
    per-token gradient of the log-probs (small, either sign, as a token-mean loss gives)."""
    from test_dominated_rows import dominated_head as head

    hidden, weight, ids = head(opts["V"], opts["temperature"])
    if opts["who"] == "other":  # a small logit: the former target dominates the row
        ids = (ids + 1) % opts["V"]
    g = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7)) * 1e-3
    return hidden, weight, ids, g


def run_dominated(opts: dict, module, hidden, weight, **kw) -> dict:
    """logp (selective log-probs only), d hidden and d weight of a dominated case through
    `module` (grpo_kernels or its reference) on the head given (the whole head, or this rank's
    shard with vocab_group=); hidden and weight in the dtype to compute in. The loss cases:
    dapo, beta = 0.04, entropy_coef = 0.01 (the entropy term's p·(ln p + H) as well)."""
    _, _, ids, g = dominated_head(opts)
    h, w = (x.detach().clone().requires_grad_(True) for x in (hidden, weight))
    t = opts["temperature"]
    os.environ["GRPO_KERNELS_THREE_PASS"] = "1" if opts["what"] in ("three", "second") else "0"
    out = {}
    with force_backend(opts["backend"]):
        if opts["what"] == "logprobs":
            logp = module.selective_logprobs(h, w, ids, temperature=t, **kw)
            out["logp"] = logp.detach()
            loss = (logp * g.to(logp.dtype)).sum()
        else:
            with torch.no_grad():  # the same reference log-probs in every call
                h64, w64 = (x.double() for x in dominated_head(opts)[:2])
                ref = reference.selective_logprobs(h64, w64, ids, temperature=t).float() + 0.1
            loss = module.fused_linear_grpo_loss(
                h, w, ids, torch.tensor([1.0, -0.7], dtype=h.dtype), loss_type="dapo",
                beta=0.04, temperature=t, ref_logps=ref.to(h.dtype), entropy_coef=0.01,
                **kw)[0]
            if opts["what"] == "second":  # the first backward's gradients are not measured
                torch.autograd.grad(loss, (h, w), retain_graph=True)
        loss.backward()
    return dict(out, d_hidden=h.grad, d_weight=_local(w.grad))
