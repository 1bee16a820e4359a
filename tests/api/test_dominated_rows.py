"""Rows where one token takes almost all the probability, at large |z/τ| (target logit z/τ = 40,
at τ = 1 and at τ = 0.01 with moderate raw logits), on the chunked backend: the gradients of
hidden and weight against a float64 truth stay within twice PyTorch's own float32 error (plus a
tiny floor), on the three-pass route and on the four-pass route (GRPO_KERNELS_THREE_PASS=0), for
the GRPO loss and for selective log-probs with and without an entropy term; and d logits of the
logits path (grpo_loss, logprobs_from_logits), whose eager op keeps the forward's per-token
statistics for its backward.

The four-pass backward runs on each of its ROUTES: from the forward's kept logits tile (N·V
within `chunked.blocks.KEEP_ELEMENTS`, eager), recomputing the logits (above it: every real
head; here KEEP_ELEMENTS = 0), recomputing them in vocabulary tiles (V above the tile budget of
a real head; here a small `chunked.blocks.TILE_ELEMENTS`), and as the custom operator (under a
dispatch mode, as torch.compile and other tracers call it), which recomputes too.

Such a row's d logits of the dominant token is g·(1 - p), a cancellation: p must come out of the
backward as the forward's statistics define it (2^(z - m) / s), not through the lse in nats,
whose float32 rounding at |lse| ≈ 40 (2e-6) would show as an error of that size in 1 - p. A
backward that recomputes the logits takes the target column's gradient from the forward's logp
(`chunked.tiles.target_column`), and every column's p as 2^(z - r) / S with r = lse·log2(e)
and the forward's S = Σ 2^(z - r) (`chunked.tiles.row_offset`), so rows dominated by a token
other than their target are covered too (`test_rows_dominated_by_another_token`).
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from grpo_kernels import reference

pytestmark = pytest.mark.usefixtures("one_thread")
MARGINS = [40.0, 30.0, 25.0, 20.0, 15.0, 12.0]  # target logit minus a rival's (z/τ), per token
ROUTES = ["kept", "recompute", "vocab tiles", "operator"]


class PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the public functions call the operator."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def on_route(route, monkeypatch):
    """A context for the call under test that puts the linear head's four-pass backward on
    `route` (ROUTES; the three-pass route does not look at it)."""
    from grpo_kernels.chunked import blocks, linear_launchers

    if route != "kept":
        monkeypatch.setattr(linear_launchers, "KEEP_ELEMENTS", 0)
    if route == "vocab tiles":  # [12, 512] forward and [12, 1024] backward tiles at N = 12
        monkeypatch.setattr(blocks, "TILE_ELEMENTS", 12 * 1024)
    return PassThrough() if route == "operator" else contextlib.nullcontext()


def dominated_head(V, temperature, D=16, B=2, T=6):
    """hidden [B, T, D] (orthogonal rows, |h| = 4), weight [V, D], ids [B, T]: each token's
    target logit z/τ is 40, one rival's 40 - margin (1 - p from e^-40 to about e^-12), the
    others small."""
    N = B * T
    g = torch.Generator().manual_seed(V)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    h = q[:N] * 4.0
    perm = torch.randperm(V, generator=g)
    ids, rivals = perm[:N], perm[N:2 * N]
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * (0.3 * temperature)
    w[ids] = h / 16.0 * (40.0 * temperature)  # h_n · w[target_n] = 40·τ
    margin = torch.tensor(MARGINS * B, dtype=torch.float64)
    w[rivals] = h / 16.0 * ((40.0 - margin) * temperature)[:, None]
    return h.float().view(B, T, D), w.float(), ids.view(B, T)


def grads(fn, hidden, weight):
    h, w = (x.detach().clone().requires_grad_(True) for x in (hidden, weight))
    fn(h, w).backward()
    return h.grad, w.grad


def errors(ours_fn, ref_fn, hidden, weight, route=None):
    """[(ours' error, PyTorch float32's error)] of d hidden and d weight, max abs against the
    float64 reference on the same values; ours under the context `route` (`on_route`)."""
    truth = grads(ref_fn, hidden.double(), weight.double())
    torch32 = grads(ref_fn, hidden, weight)
    with gk.force_backend("chunked"), route or contextlib.nullcontext():
        ours = grads(ours_fn, hidden, weight)
    return [((o.double() - t).abs().max().item(), (f.double() - t).abs().max().item())
            for o, f, t in zip(ours, torch32, truth)]


def check(pairs):
    for name, (ours, torch32) in zip(["d hidden", "d weight"], pairs):
        assert ours <= 2.0 * torch32 + 1e-9, (name, ours, torch32)


@pytest.mark.parametrize("three_pass,route", [("1", "kept"), *(("0", r) for r in ROUTES)])
@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V", [64, 4096])
def test_grpo_loss_at_dominated_rows(monkeypatch, three_pass, route, temperature, V):
    """fused_linear_grpo_loss (dapo, beta = 0.04) on both routes (the four-pass backward's fast
    mode; the general mode, with an entropy term, is selective_logprobs' below)."""
    monkeypatch.setenv("GRPO_KERNELS_THREE_PASS", three_pass)
    hidden, weight, ids = dominated_head(V, temperature)
    adv = torch.tensor([1.0, -0.7])
    with torch.no_grad():
        logp = reference.selective_logprobs(hidden.double(), weight.double(), ids,
                                            temperature=temperature).float()
    ref_logps = logp + 0.1
    kw = dict(loss_type="dapo", beta=0.04, temperature=temperature, ref_logps=ref_logps)
    check(errors(lambda h, w: gk.fused_linear_grpo_loss(h, w, ids, adv, **kw)[0],
                 lambda h, w: reference.fused_linear_grpo_loss(h, w, ids, adv, **kw)[0],
                 hidden, weight, on_route(route, monkeypatch)))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V,entropy", [(64, False), (4096, False), (64, True), (4096, True)])
def test_selective_logprobs_at_dominated_rows(monkeypatch, route, temperature, V, entropy):
    """selective_logprobs' backward (the four-pass route always), g_logp of either sign and of
    small magnitude (as a token-mean loss gives), with and without an entropy gradient."""
    hidden, weight, ids = dominated_head(V, temperature)
    g = torch.Generator().manual_seed(7)
    g_logp = torch.randn(ids.shape, generator=g) * 1e-3
    g_ent = torch.randn(ids.shape, generator=g) * 1e-3

    def loss(fn):
        def call(h, w):
            out = fn(h, w, ids, temperature=temperature, return_entropy=entropy)
            if not entropy:
                return (out * g_logp).sum()
            return (out[0] * g_logp).sum() + (out[1] * g_ent).sum()
        return call

    check(errors(loss(gk.selective_logprobs), loss(reference.selective_logprobs),
                 hidden, weight, on_route(route, monkeypatch)))


def dominated_logits(V, temperature, B=2, T=6):
    """logits [B, T, V], ids [B, T]: each token's target at z/τ = 40, the others at 40 - margin
    (MARGINS, per token) ± N(0, 1)."""
    g = torch.Generator().manual_seed(V + 1)
    margin = torch.tensor(MARGINS * B)[:B * T].view(B, T, 1)
    x = (torch.randn(B, T, V, generator=g) + 40.0 - margin) * temperature
    ids = torch.randint(0, V, (B, T), generator=g)
    return x.scatter_(-1, ids[..., None], 40.0 * temperature), ids


def check_logits(ours_fn, ref_fn, logits, g_scale, temperature, backend="chunked"):
    """d logits (ours on `backend`) within twice PyTorch's float32 error, plus one float32 ulp
    of p = 1 at the largest per-token gradient coefficient (g_scale / τ): both round
    s = Σ 2^(z - m) ≈ 1 + ε of a dominated row at float32's resolution, PyTorch's rounding
    chain a little more luckily."""
    def grad(fn, x):
        x = x.detach().clone().requires_grad_(True)
        fn(x).backward()
        return x.grad

    truth = grad(ref_fn, logits.double())
    torch32 = (grad(ref_fn, logits).double() - truth).abs().max().item()
    with gk.force_backend(backend):
        ours = (grad(ours_fn, logits).double() - truth).abs().max().item()
    floor = torch.finfo(torch.float32).eps * g_scale / temperature
    assert ours <= 2.0 * torch32 + floor, (ours, torch32, floor)


@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V", [64, 4096])
def test_logits_grpo_loss_at_dominated_rows(temperature, V):
    """grpo_loss on logits (dapo, beta = 0.04): the eager op keeps the forward's statistics."""
    x, ids = dominated_logits(V, temperature)
    adv = torch.tensor([1.0, -0.7])
    with torch.no_grad():
        ref_logps = reference.logprobs_from_logits(x.double(), ids,
                                                   temperature=temperature).float() + 0.1
    kw = dict(loss_type="dapo", beta=0.04, temperature=temperature, ref_logps=ref_logps)
    g_scale = adv.abs().max().item() / ids.numel()  # dapo: d loss / d logp ≈ A / tokens
    check_logits(lambda lg: gk.grpo_loss(lg, ids, adv, **kw)[0],
                 lambda lg: reference.grpo_loss(lg, ids, adv, **kw)[0], x, g_scale, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("V,entropy", [(64, False), (4096, False), (64, True), (4096, True)])
def test_logprobs_from_logits_at_dominated_rows(temperature, V, entropy):
    """logprobs_from_logits' backward, with and without an entropy gradient."""
    check_logits(*logits_logprobs_case(V, temperature, entropy), temperature)


def logits_logprobs_case(V, temperature, entropy):
    """(ours, reference, logits, g_scale) of a logprobs_from_logits loss at dominated rows:
    random weights on the log-probs (and entropies), summed."""
    x, ids = dominated_logits(V, temperature)
    g = torch.Generator().manual_seed(5)
    g_logp, g_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)

    def loss(fn):
        def call(lg):
            out = fn(lg, ids, temperature=temperature, return_entropy=entropy)
            if not entropy:
                return (out * g_logp).sum()
            return (out[0] * g_logp).sum() + (out[1] * g_ent).sum()
        return call

    g_scale = max(g_logp.abs().max().item(), g_ent.abs().max().item() if entropy else 0.0)
    return loss(gk.logprobs_from_logits), loss(reference.logprobs_from_logits), x, g_scale


def test_compiled_selective_logprobs_at_dominated_rows():
    """The operator under torch.compile (fullgraph, AOT autograd): the traced backward gets the
    forward's logp (a saved tensor of the graph) as the eager operator does."""
    hidden, weight, ids = dominated_head(4096, 1.0)
    g = torch.Generator().manual_seed(7)
    g_logp, g_ent = (torch.randn(ids.shape, generator=g) * 1e-3 for _ in range(2))

    def loss(fn):
        def call(h, w):
            logp, ent = fn(h, w, ids, return_entropy=True)
            return (logp * g_logp).sum() + (ent * g_ent).sum()
        return call

    compiled = torch.compile(loss(gk.selective_logprobs), fullgraph=True, backend="aot_eager")
    check(errors(compiled, loss(reference.selective_logprobs), hidden, weight))


@pytest.mark.parametrize("route", ROUTES)
def test_rows_dominated_by_another_token(monkeypatch, route):
    """Rows dominated by a token other than their target: its d logits is g·p, no cancellation,
    but p ≈ 1 read through the lse alone would carry the lse's rounding (2e-6 at |lse| ≈ 40),
    ~20x PyTorch's float32 error; the kept tile holds the forward's m and s, and a recomputing
    backward reads p as 2^(z - r) / S with the forward's S (`chunked.tiles.row_offset`)."""
    hidden, weight, ids = dominated_head(4096, 1.0)
    ids = (ids + 1) % 4096  # a small logit: the former target dominates the row
    g_logp = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7)) * 1e-3

    def loss(fn):
        return lambda h, w: (fn(h, w, ids) * g_logp).sum()

    check(errors(loss(gk.selective_logprobs), loss(reference.selective_logprobs), hidden, weight,
                 on_route(route, monkeypatch)))
