"""Non-finite inputs (NaN, ±inf) on every route: the reference, the chunked backend and the
Triton kernels (in the interpreter on a CPU), each with three passes and four
(GRPO_KERNELS_THREE_PASS=0), from hidden states and from logits (docs/semantics.md,
"Non-finite inputs").

- At a padded position (mask 0) nothing is read: the loss, the metrics and every gradient equal
  those of the same batch with finite values there.
- At a real token the routes give what TRL's autograd gives: a non-finite rollout ratio or an
  infinite ratio w (old log-prob -inf) yields the same loss and the same gradients, NaN where
  autograd's product meets 0·inf, 0 where a clamp or the minimum selects the other branch.
- -inf logits (a masked vocabulary entry) leave the loss and gradients finite without the
  entropy bonus; the entropy is NaN, as TRL's `entropy_from_logits`.
"""

import math

import pytest
import torch
from helpers import hyper, leaf, make_grpo_batch, make_head, on_device

import grpo_kernels as gk
from grpo_kernels import loss_call, reference
from grpo_kernels.ops import three_pass_op

# NaN and ±inf inputs on purpose: numpy's warnings from the interpreter's arithmetic are expected
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

B, T, D, V = 2, 4, 8, 16
# backend, passes: three ("3"), three without compacting the padding away ("3u": the route of a
# packed CUDA batch, which computes every token), four ("4"), four with the atomic backward ("4a")
ROUTES = [("triton", "3"), ("triton", "3u"), ("triton", "4"), ("triton", "4a"),
          ("chunked", "3"), ("chunked", "3u"), ("chunked", "4")]
LOGITS_ROUTES = [("triton", "3"), ("chunked", "3")]  # the logits loss has one route
REAL, PAD = (0, 1), (0, 3)  # a real token and a padded one (mask 0)
PER_TOKEN = ("old_logps", "ref_logps", "sampling_logps", "importance_sampling_ratio")


def batch(seed=0):
    """hidden, weight, bias, ids and the loss's per-token inputs (keywords), with padding at
    PAD and at the tail of the second sequence."""
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=True,
                                          scale=3.0)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, bias, ids, seed=seed, masked_row=False)
    mask.fill_(1.0)
    mask[PAD] = 0.0
    mask[1, 2:] = 0.0
    inputs = dict(completion_mask=mask, old_logps=old, ref_logps=ref,
                  importance_sampling_ratio=torch.full((B, T), 1.1), sampling_logps=old + 0.1)
    return hidden, weight, bias, ids, adv, inputs


def run(route, x, weight, bias, ids, adv, inputs, kw, monkeypatch):
    """(loss, metrics, gradients) of one route; x is hidden [B, T, D], or logits [B, T, V] when
    weight is None."""
    leaves = [leaf(t) for t in (x, weight, bias) if t is not None]
    if route == "reference":
        fn = reference.grpo_loss if weight is None else reference.fused_linear_grpo_loss
        ctx = None
    else:
        backend, passes = route
        fn = on_device(gk.grpo_loss if weight is None else gk.fused_linear_grpo_loss, backend)
        monkeypatch.setenv("GRPO_KERNELS_THREE_PASS", "0" if passes[0] == "4" else "1")
        if passes == "4a":
            monkeypatch.setenv("GRPO_KERNELS_LINEAR_BACKWARD", "atomic")
        if passes == "3u":  # the call's last argument: compact
            full = three_pass_op.linear_grpo_loss
            monkeypatch.setattr(loss_call.three_pass_op, "linear_grpo_loss",
                                lambda *args: full(*args[:-1], False))
        ctx = backend
    args = (leaves[0], ids, adv) if weight is None else (*leaves[:2], ids, adv)
    extra = {} if weight is None else dict(bias=leaves[2])
    with gk.force_backend(ctx):
        loss, metrics = fn(*args, **inputs, **extra, **kw)
    loss.backward()
    monkeypatch.undo()
    return loss.detach(), metrics, [t.grad for t in leaves]


def same(a, b, tol=2e-5, exact_non_finite=True):
    """The same entries finite, those within tol (relative to max 1); the non-finite ones
    equal (NaN to NaN, inf to inf of the same sign) when exact_non_finite."""
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return False
    if exact_non_finite and not (torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a[a.isinf()], b[b.isinf()])):
        return False
    fa, fb = a[torch.isfinite(a)].double(), b[torch.isfinite(b)].double()
    return not fa.numel() or (fa - fb).abs().max().item() <= tol * max(1.0, fb.abs().max().item())


def agree(got, want):
    """Loss and metrics as the reference's, NaN for NaN; gradients finite where the reference's
    are, and equal there (a non-finite per-token coefficient gives NaN or ±inf, which one
    depending on the order of the products: that is not compared)."""
    loss, metrics, grads = got
    assert same(loss, want[0]), (loss, want[0])
    assert metrics.keys() == want[1].keys()
    for k in metrics:
        assert same(metrics[k], want[1][k]), (k, metrics[k], want[1][k])
    for g, w in zip(grads, want[2], strict=True):
        assert same(g, w, exact_non_finite=False), (g, w)


KW = [dict(loss_type="grpo", beta=0.04),
      dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
      dict(loss_type="dapo", entropy_coef=0.01, delta=1.5, off_policy_mask_threshold=0.5),
      dict(loss_type="grpo", softcap=3.0, entropy_coef=0.01),
      dict(loss_type="vespo"),
      dict(loss_type="dppo", beta=0.04)]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kw", KW, ids=["grpo", "gspo", "dapo-options", "softcap", "vespo", "dppo"])
def test_padding_is_never_read(kw, value, monkeypatch):
    """NaN or ±inf at a padded position of hidden, logits, or any per-token input: every
    route's loss, metrics and gradients are those of the batch with finite values there (and
    the gradient at the padded position is 0)."""
    hidden, weight, bias, ids, adv, inputs = batch()
    kw = {**hyper(kw["loss_type"], "token", 0.0, 1.0, None), **kw}
    clean = run("reference", hidden, weight, bias, ids, adv, inputs, kw, monkeypatch)
    clean_logits = run("reference", hidden @ weight.T + bias, None, None, ids, adv, inputs, kw,
                       monkeypatch)
    bad_hidden = hidden.clone()
    bad_hidden[PAD][0] = value
    bad_logits = (hidden @ weight.T + bias).detach()
    bad_logits[PAD][3] = value
    for name in PER_TOKEN:
        inputs[name] = inputs[name].clone()
        inputs[name][PAD] = value
    for route in ["reference", *ROUTES]:
        got = run(route, bad_hidden, weight, bias, ids, adv, inputs, kw, monkeypatch)
        agree(got, clean)
        assert not got[2][0][PAD].any(), route
    for route in ["reference", *LOGITS_ROUTES]:
        got = run(route, bad_logits, None, None, ids, adv, inputs, kw, monkeypatch)
        agree(got, clean_logits)
        assert not got[2][0][PAD].any(), route


@pytest.mark.parametrize("name, value", [("importance_sampling_ratio", math.nan),
                                         ("importance_sampling_ratio", math.inf),
                                         ("importance_sampling_ratio", -math.inf),
                                         ("old_logps", -math.inf), ("old_logps", math.nan)])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_non_finite_ratio_at_a_real_token(name, value, delta, monkeypatch):
    """A non-finite rollout ratio, or an old log-prob of -inf (ratio w = inf), at real tokens
    whose ratios are clipped and not clipped, with advantages of either sign and 0: every route
    gives the reference's loss and gradients (TRL's autograd). The Triton epilogue once
    multiplied the rollout ratio into a derivative the clamp had already zeroed (NaN where
    autograd gives 0), and zeroed the clamp's w·0 where autograd gives 0·inf = NaN."""
    hidden, weight, bias, ids, adv, inputs = batch(seed=3)
    adv = torch.tensor([1.0, -1.0]) if name == "old_logps" else torch.tensor([1.0, 0.0])
    # ratios far off 1 at (0, 0) (clipped: A > 0, w > 1 + ε_hi) and (0, 2) (w < 1 - ε_lo: the
    # unclipped branch for A > 0)
    inputs["old_logps"][0, 0] -= 2.0
    inputs["old_logps"][0, 2] += 2.0
    inputs[name] = inputs[name].clone()
    at = [REAL, (1, 1)] + ([(0, 0), (0, 2)] if name == "importance_sampling_ratio" else [])
    for pos in at:
        inputs[name][pos] = value
    kw = hyper("grpo", "token", 0.0, 1.0, delta)
    want = run("reference", hidden, weight, bias, ids, adv, inputs, kw, monkeypatch)
    want_logits = run("reference", hidden @ weight.T + bias, None, None, ids, adv, inputs, kw,
                      monkeypatch)
    for route in ROUTES:
        agree(run(route, hidden, weight, bias, ids, adv, inputs, kw, monkeypatch), want)
    for route in LOGITS_ROUTES:
        agree(run(route, hidden @ weight.T + bias, None, None, ids, adv, inputs, kw,
                  monkeypatch), want_logits)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("at", [REAL, PAD], ids=["real", "padded"])
def test_non_finite_mask_is_refused(value, at, monkeypatch):
    """A NaN or inf completion_mask entry is refused with one error on every route, padded or
    packed: the normalizers (Σ m) would carry it to every token, and 0·NaN to the gradient of
    padded rows on the routes that compute those rows and not on the others."""
    hidden, weight, bias, ids, adv, inputs = batch()
    inputs["completion_mask"][at] = value
    kw = hyper("dapo", "token", 0.0, 1.0, None)
    logits = (hidden @ weight.T + bias).detach()
    calls = [(r, hidden, weight, bias) for r in ["reference", *ROUTES]]
    calls += [(r, logits, None, None) for r in ["reference", *LOGITS_ROUTES]]
    for route, x, w, b in calls:
        with pytest.raises(ValueError, match="completion_mask contains NaN or inf"):
            run(route, x, w, b, ids, adv, inputs, kw, monkeypatch)
        monkeypatch.undo()
    cu = torch.tensor([0, T, 2 * T])
    with pytest.raises(ValueError, match="completion_mask contains NaN or inf"):
        gk.fused_linear_grpo_loss(hidden.reshape(B * T, D), weight, ids.reshape(-1), adv,
                                  inputs["completion_mask"].reshape(-1), cu_seqlens=cu)


@pytest.mark.parametrize("entry", ["bias", "logits"])
@pytest.mark.parametrize("at_target", [False, True])
def test_minus_inf_logits(entry, at_target, monkeypatch):
    """-inf in the head's bias (every token's logits) or in one token's logits, at a vocabulary
    entry that is not the target or at the target: without the entropy bonus every route gives
    the reference's finite loss and gradients; the entropy metric is NaN, as TRL's."""
    hidden, weight, bias, ids, adv, inputs = batch(seed=5)
    col = ids[REAL].item() if at_target else (ids[REAL].item() + 1) % V
    kw = hyper("dapo", "token", 0.0, 1.0, None)
    if entry == "bias":
        bias = bias.clone()
        bias[col] = -math.inf
        args = (hidden, weight, bias)
    else:
        logits = (hidden @ weight.T + bias).detach()
        logits[REAL][col] = -math.inf
        args = (logits, None, None)
    want = run("reference", *args, ids, adv, inputs, kw, monkeypatch)
    assert torch.isfinite(want[0]) and want[1]["entropy"].isnan()
    assert all(torch.isfinite(g).all() for g in want[2])
    for route in ROUTES if entry == "bias" else LOGITS_ROUTES:
        agree(run(route, *args, ids, adv, inputs, kw, monkeypatch), want)


def test_entropy_window_sums_skip_padding():
    """The adaptive entropy controller's sums (`grpo_options.masked_sums`): a NaN entropy at a
    padded position (a row of non-finite logits there) adds nothing."""
    from grpo_kernels.grpo_options import masked_sums

    entropy, mask = torch.tensor([[1.0, 2.0, math.nan]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.equal(masked_sums(entropy, mask), torch.tensor([3.0, 2.0]))


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "chunked"])
def test_nan_rollout_ratio_on_a_real_head(backend):
    """A Qwen-sized head (nn.Parameter, V = 151,936): a NaN rollout ratio at a token whose ratio
    is clipped gives that token a d hidden of 0, and a NaN one at an unclipped token, as the
    reference (TRL's autograd) gives them; the loss is NaN."""
    Vq, Dq = 151_936, 8
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 2, Dq, generator=g)
    weight = torch.nn.Parameter(torch.randn(Vq, Dq, generator=g) * 0.3)
    ids = torch.tensor([[5, 151_000]])
    with torch.no_grad():
        logp = reference.selective_logprobs(hidden, weight, ids)
    old = logp + torch.tensor([[-2.0, 0.0]])  # token 0: w = e² (clipped for A > 0); token 1: 1
    isr = torch.full((1, 2), math.nan)
    kw = dict(loss_type="dapo", importance_sampling_ratio=isr)
    h = leaf(hidden)
    want, _ = reference.fused_linear_grpo_loss(h, weight, ids, torch.ones(1), None, old, **kw)
    want.backward()
    x = leaf(hidden)
    with gk.force_backend(backend):
        got, _ = on_device(gk.fused_linear_grpo_loss, backend)(x, weight, ids, torch.ones(1),
                                                               None, old, **kw)
    got.backward()
    assert want.isnan() and got.isnan()
    assert not h.grad[0, 0].any() and h.grad[0, 1].isnan().all()
    assert not x.grad[0, 0].any() and x.grad[0, 1].isnan().all()
