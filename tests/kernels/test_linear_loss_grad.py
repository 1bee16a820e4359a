"""The three-pass linear-head loss and gradient of the Triton backend
(grpo_kernels/kernels/linear_loss_grad.py: library GEMMs around the Triton row kernels; on a CPU
the GEMMs are emulated and the row kernels run in Triton's interpreter), against a float64
truth (the per-token loss of grpo_math on float64 logits, differentiated by autograd) and
against the four-pass Triton route (the token-terms forward with its epilogue, then the linear
backward with g_logp = weight·dℓ/dlogp): every token-level loss type with beta 0 and 0.04,
temperature, delta, bias-corrected KL, rollout ratios, the entropy coefficient, logit scale and
soft cap, a bias, one chunk and several, frozen parts, float32, bfloat16, float16 and the
mixed head. Errors of 16-bit heads are bounded by twice PyTorch's own error in that dtype.
Plus: no host synchronization and the buffers it allocates (a dispatch mode records the ops),
the chunk-size rule and bad arguments (the GEMM helpers: test_gemm.py)."""

from collections import Counter

import pytest
import torch
from helpers import KERNEL_DEVICE, make_grpo_batch, make_head, max_err
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from grpo_kernels import reference
from grpo_kernels.grpo_math import entropy_bonus_weights, per_token_loss, token_weights
from grpo_kernels.kernels import gemm
from grpo_kernels.kernels import linear_loss_grad as llg
from grpo_kernels.kernels.epilogue import epilogue_args
from grpo_kernels.loss_specs import TOKEN_LOSS_TYPES
from grpo_kernels.ops.backends import IMPLS
from grpo_kernels.ops.launch import LinearHeadOp, grpo_token_terms
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = (3, 12, 24, 75)  # B, T, D, V: ~25 unmasked rows; V = 75 spans two 64-wide row tiles
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}
STATS = ("logp", "entropy", "lse", "lossw", "coef", "kl", "ratio")
GRADS = ("d hidden", "d weight", "d bias")


def problem(seed=0, bias=True, rollout=False, entropy_coef=0.0, **kw):
    """The rows a caller hands over (masked tokens dropped) and their GRPO inputs, float32 on
    the CPU; kw: GRPOParams' fields."""
    B, T, D, V = SHAPE
    params = GRPOParams(max_completion_length=T, **kw)
    hidden, weight, b, ids = make_head(B, T, D, V, torch.float32, "cpu", seed=seed, bias=bias,
                                       scale=3.0)
    _, adv, old, ref = make_grpo_batch(hidden, weight, b, ids, seed=seed,
                                       temperature=params.temperature)
    g = torch.Generator().manual_seed(seed + 7)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()  # the caller drops the zeros
    isr = 0.6 + 0.8 * torch.rand(B, T, generator=g) if rollout else None
    weights = token_weights(mask, params)
    g_ent = entropy_bonus_weights(mask, entropy_coef) if entropy_coef else None
    keep = mask.reshape(-1) != 0
    def flat(x):  # [B, T] or [B] -> the kept rows' [Na]
        return None if x is None else x.reshape(B, -1).expand(B, T).reshape(-1)[keep].clone()

    return dict(h=hidden.reshape(-1, D)[keep].contiguous(), w=weight, b=b, ids=flat(ids),
                weights=flat(weights), adv=flat(adv), old=flat(old), ref=flat(ref),
                isr=flat(isr), g_ent=flat(g_ent), rule=params.token_loss_args,
                temperature=params.temperature)


def head(P, dtype, weight_dtype=None, device="cpu"):
    w_dt = weight_dtype or dtype
    cast = lambda x, dt: None if x is None else x.to(device=device, dtype=dt)  # noqa: E731
    return cast(P["h"], dtype), cast(P["w"], w_dt), cast(P["b"], w_dt)


def torch_terms(P, dtype, weight_dtype=None, softcap=None, logit_scale=None):
    """PyTorch autograd with the head in `dtype` (float64: the truth), as eager computes it:
    the per-token values of STATS and the gradients of Σ weight·ℓ + Σ g_ent·H."""
    leaves = [None if x is None else x.detach().clone().requires_grad_()
              for x in head(P, dtype, weight_dtype)]
    h, w, b = leaves
    y = h @ w.T if b is None else h @ w.T + b
    z = reference.transform_logits(y, softcap, logit_scale) / P["temperature"]
    log_p = torch.log_softmax(z, -1)
    logp = log_p.gather(-1, P["ids"][:, None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    fdt = z.dtype
    as_f = lambda x: None if x is None else x.to(fdt)  # noqa: E731
    loss, ratio, kl = per_token_loss(logp, as_f(P["old"]), as_f(P["ref"]), as_f(P["adv"]),
                                     as_f(P["weights"]), P["rule"], as_f(P["isr"]))
    lossw = as_f(P["weights"]) * loss
    (coef,) = torch.autograd.grad(lossw.sum(), logp, retain_graph=True)
    total = lossw.sum() + (0.0 if P["g_ent"] is None else (as_f(P["g_ent"]) * ent).sum())
    grads = torch.autograd.grad(total, [x for x in leaves if x is not None])
    stats = dict(logp=logp, entropy=ent, lse=torch.logsumexp(z, -1), lossw=lossw, coef=coef,
                 kl=kl, ratio=ratio)
    return {k: None if v is None else v.detach() for k, v in stats.items()}, list(grads)


def epilogue(P, device):
    move = lambda x: None if x is None else x.to(device)  # noqa: E731
    return epilogue_args(P["rule"], *(move(P[k]) for k in ("weights", "adv", "old", "ref",
                                                           "isr")))


def arguments(P, dtype, weight_dtype=None):
    """linear_loss_grad's positional arguments up to g_ent, on the kernels' device."""
    dev = KERNEL_DEVICE
    g_ent = None if P["g_ent"] is None else P["g_ent"].to(dev)
    return (*head(P, dtype, weight_dtype, dev), P["ids"].to(dev), P["temperature"],
            epilogue(P, dev), g_ent)


def ours(P, dtype, weight_dtype=None, needs=(True, True, True), chunk_rows=4, fused=False,
         **transform):
    args = arguments(P, dtype, weight_dtype)
    ep = args[5]
    out = llg.linear_loss_grad(*args, needs, chunk_rows=chunk_rows, fused_rows=fused,
                               **transform)
    assert out.coef is ep.outputs[1]
    stats = dict(zip(("logp", "entropy", "lse", "coef"), (out.logp, out.entropy, out.lse,
                                                          out.coef)))
    stats.update(zip(("lossw", "kl", "ratio"), (ep.outputs[0], ep.outputs[2], ep.outputs[3])))
    cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
    return {k: cpu(v) for k, v in stats.items()}, [cpu(x) for x in out[4:]]


def four_pass(P, dtype, weight_dtype=None, **transform):
    """The four-pass Triton route: the token-terms forward, then the linear backward."""
    dev = KERNEL_DEVICE
    tensors = head(P, dtype, weight_dtype, dev)
    op = LinearHeadOp(IMPLS["triton"], P["temperature"], None, **transform)
    move = lambda x: None if x is None else x.to(dev)  # noqa: E731
    logp, ent, lse, lossw, coef, kl, ratio = grpo_token_terms(
        op, P["ids"].to(dev), tensors, P["rule"],
        *(move(P[k]) for k in ("weights", "adv", "old", "ref", "isr")))
    grads = op.backward(tensors, P["ids"].to(dev), lse, ent, coef, move(P["g_ent"]),
                        (True, True, True))
    stats = dict(zip(STATS, (logp, ent, lse, lossw, coef, kl, ratio)))
    return ({k: v.cpu() for k, v in stats.items()},
            [None if g is None else g.cpu() for g in grads])


def _scale(t):
    return max(t.abs().max().item(), 1e-3) if t.numel() else 1.0


def assert_bounded(got, same, truth, tol, what):
    """Each value within twice PyTorch's same-dtype error against the truth + tol·scale."""
    for k, t in truth.items() if isinstance(truth, dict) else zip(GRADS, truth):
        o = got[k] if isinstance(got, dict) else got[GRADS.index(k)]
        s = same[k] if isinstance(same, dict) else same[GRADS.index(k)]
        if t is None:  # the KL without beta
            continue
        bound = 2 * max_err(s, t) + tol * _scale(t)
        assert max_err(o, t) <= bound, f"{what} {k}: {max_err(o, t):.3g} > {bound:.3g}"


def check(P, dtype, weight_dtype=None, chunk_rows=4, fused=False, **transform):
    """Ours against the truth (bounded by PyTorch's same-dtype error) and the four-pass route.
    The head is rounded to its dtypes first: the truth is that of the values the kernels see."""
    P = dict(P, **dict(zip(("h", "w", "b"), (
        None if x is None else x.float() for x in head(P, dtype, weight_dtype)))))
    truth = torch_terms(P, torch.float64, **transform)
    same = torch_terms(P, weight_dtype or dtype, **transform)  # the mixed head: a float32 head
    got = ours(P, dtype, weight_dtype, chunk_rows=chunk_rows, fused=fused, **transform)
    tol = 1e-4 if weight_dtype else TOL[dtype]
    assert_bounded(got[0], same[0], truth[0], tol, "stats")
    # the mixed head's d hidden is rounded to bf16: against the float32 head's, rounded so
    same_grads = [s.to(g.dtype) for s, g in zip(same[1], [x for x in got[1] if x is not None])]
    assert_bounded(got[1], same_grads, truth[1], tol, "grads")
    for x, ref in zip(got[1], head(P, dtype, weight_dtype)):
        assert ref is None or x.dtype == ref.dtype
    four = four_pass(P, dtype, weight_dtype, **transform)
    if weight_dtype is None:  # both from float32 logits of the same products: rounding apart
        for k in STATS:
            if truth[0][k] is not None:
                assert max_err(got[0][k], four[0][k]) <= 1e-5 * max(1.0, _scale(truth[0][k])), k
    else:  # the four-pass mixed head multiplies with ~16 bits of the weight (split_dot)
        assert_bounded(got[0], four[0], truth[0], tol, "stats vs four-pass")
    if dtype == torch.float32:
        for name, o, f in zip(GRADS, got[1], four[1]):
            assert (o is None) == (f is None), name
            assert f is None or max_err(o, f) <= 1e-5 * _scale(f), name
    else:  # no worse than twice the four-pass route's error
        assert_bounded(got[1], four[1], truth[1], tol, "vs four-pass")
    return got


def _cell(i: int) -> dict:
    """Options of the i-th matrix cell, varied so that each is on and off across the matrix."""
    return dict(temperature=(1.0, 0.7)[i % 2], delta=(None, 1.5)[(i // 2) % 2],
                use_bias_correction_kl=i % 3 == 1, rollout=i % 4 == 3,
                entropy_coef=(0.0, 0.05)[(i // 3) % 2], bias=i % 5 != 2)


MATRIX = [(t, beta) for t in TOKEN_LOSS_TYPES for beta in (0.0, 0.04)]


@pytest.mark.parametrize("loss_type,beta", MATRIX)
def test_every_loss_type_float32(loss_type, beta):
    kw = _cell(MATRIX.index((loss_type, beta)))
    eps = 5.0 if loss_type == "cispo" else 0.28
    P = problem(seed=MATRIX.index((loss_type, beta)), loss_type=loss_type, beta=beta,
                epsilon_high=eps, **kw)
    check(P, torch.float32, chunk_rows=(4, 5, 64)[MATRIX.index((loss_type, beta)) % 3])


@pytest.mark.parametrize("softcap,logit_scale,dtype", [
    (3.0, None, torch.float32), (None, 0.4, torch.float32), (3.0, 1.6, torch.float32),
    (None, -1.3, torch.float32), (3.0, 1.6, torch.bfloat16)])
def test_logit_transforms(softcap, logit_scale, dtype):
    P = problem(seed=11, loss_type="dapo", beta=0.04, temperature=0.8, entropy_coef=0.05)
    got = check(P, dtype, softcap=softcap, logit_scale=logit_scale)
    plain = torch_terms(P, torch.float64)[1]
    assert max_err(got[1][0], plain[0]) > 1e-2 * _scale(plain[0])  # the transform mattered


@pytest.mark.parametrize("chunk_rows", [4, 64], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("dtype,weight_dtype", [
    (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32)],
    ids=["bf16", "fp16", "mixed"])
def test_16bit_and_mixed_heads(dtype, weight_dtype, chunk_rows):
    P = problem(seed=3, loss_type="grpo", beta=0.04, temperature=0.7, delta=1.5,
                entropy_coef=0.05, rollout=True)
    check(P, dtype, weight_dtype, chunk_rows=chunk_rows)


FUSED_CASES = [
    (torch.float32, None, dict(loss_type="cispo", beta=0.04, epsilon_high=5.0, delta=1.5,
                               rollout=True, entropy_coef=0.05), {}),
    (torch.bfloat16, None, dict(loss_type="dppo", beta=0.04, use_bias_correction_kl=True,
                                entropy_coef=0.05), dict(softcap=3.0, logit_scale=1.6)),
    (torch.bfloat16, torch.float32, dict(loss_type="grpo", temperature=0.7), dict(logit_scale=0.4)),
]


@pytest.mark.parametrize("dtype,weight_dtype,kw,transform", FUSED_CASES,
                         ids=["fp32", "bf16-softcap", "mixed-scale"])
def test_fused_row_kernel(dtype, weight_dtype, kw, transform):
    """fused_rows=True (one kernel for the row forward, epilogue and backward): the numbers of
    the two kernels, and bounded against the truth and the four-pass route like them."""
    P = problem(seed=12, **kw)
    two = ours(P, dtype, weight_dtype, **transform)
    one = check(P, dtype, weight_dtype, fused=True, **transform)
    exact = KERNEL_DEVICE.type == "cpu"  # the same operations; a GPU compiler may contract them
    for k in STATS:
        assert (torch.equal(one[0][k], two[0][k]) if exact else
                max_err(one[0][k], two[0][k]) <= 1e-6 * max(1.0, _scale(two[0][k]))), k
    for name, a, b in zip(GRADS, one[1], two[1]):
        assert (torch.equal(a, b) if exact else max_err(a, b) <= 1e-5 * _scale(b)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_and_many_agree(dtype):
    """Per-row statistics do not depend on the chunking; the gradients only by rounding (d W
    summed over chunks in float32, d bias over chunks)."""
    P = problem(seed=4, loss_type="sapo", beta=0.04, entropy_coef=0.05)
    one, many = ours(P, dtype, chunk_rows=64), ours(P, dtype, chunk_rows=3)
    for k in STATS:  # cuBLAS picks its tiles (its order of summation) by the chunk's rows
        assert max_err(one[0][k], many[0][k]) <= 1e-5 * max(1.0, _scale(one[0][k])), k
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(GRADS, one[1], many[1]):
        assert (a is None) == (b is None) and (a is None or max_err(a, b) <= rel * _scale(a)), name


@pytest.mark.parametrize("needs", [(True, False, True), (False, True, False),
                                   (False, False, True), (False, False, False)])
def test_frozen_parts(needs):
    """A gradient not wanted is None and costs nothing; the others are those of the full run."""
    P = problem(seed=5, loss_type="cispo", beta=0.04, epsilon_high=5.0, entropy_coef=0.05)
    full = ours(P, torch.bfloat16)
    part = ours(P, torch.bfloat16, needs=needs)
    for name, want, a, b in zip(GRADS, needs, part[1], full[1]):
        assert (a is None) == (not want), name
        if want:
            assert torch.equal(a, b), name
    for k in STATS:
        assert torch.equal(part[0][k], full[0][k]), k


class Recorder(TorchDispatchMode):
    """Records the aten ops the three-pass function itself runs (not those inside its GEMM
    helper, whose CPU emulation makes its own temporaries, nor the interpreter's), and the
    shape and dtype of every tensor they create."""

    def __init__(self):
        super().__init__()
        self.ops, self.created, self.inside = Counter(), [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside:
            self.ops[func._schema.name] += 1
            if func._schema.name in FACTORIES:
                self.created.append((tuple(out.shape), out.dtype))
        return out

    def hide(self, fn):
        def hidden(*args, **kwargs):
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1
        return hidden


FACTORIES = {"aten::empty", "aten::empty_like", "aten::zeros", "aten::zeros_like",
             "aten::new_empty", "aten::empty_strided", "aten::_to_copy", "aten::clone"}
SYNCS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero",
         "aten::masked_select", "aten::unique", "aten::_unique2"}


@pytest.mark.parametrize("dtype,weight_dtype,chunk_rows", [
    (torch.bfloat16, None, 4), (torch.bfloat16, None, 64), (torch.float32, None, 4),
    (torch.bfloat16, torch.float32, 4)])
def test_no_host_sync_and_one_chunk_buffer(dtype, weight_dtype, chunk_rows, monkeypatch):
    """No op that reads a value on the host; one [C, V] float32 logits buffer, with the d logits
    written over it (no second [C, V] buffer); a float32 d W accumulator only for a 16-bit
    weight over several chunks."""
    P = problem(seed=6, loss_type="dapo", beta=0.04, entropy_coef=0.05, rollout=True)
    rec = Recorder()
    monkeypatch.setattr(gemm, "product", rec.hide(gemm.product))
    monkeypatch.setattr(interpreter.GridExecutor, "__call__",
                        rec.hide(interpreter.GridExecutor.__call__))
    Na, V, D = P["h"].shape[0], *P["w"].shape
    args = arguments(P, dtype, weight_dtype)
    with rec:
        out = llg.linear_loss_grad(*args, chunk_rows=chunk_rows)
    assert all(x is not None for x in out)
    assert not {"aten::mm", "aten::addmm"} & set(rec.ops)  # every GEMM in the GEMM helper
    assert not SYNCS & set(rec.ops), sorted(SYNCS & set(rec.ops))
    C = min(chunk_rows, Na)
    gemm_dtype = weight_dtype or dtype
    assert Counter(c for c in rec.created if c[0] == (C, V)) == Counter(
        [((C, V), torch.float32)]), rec.created
    if gemm_dtype != torch.float32:  # a float32 d W is its own accumulator
        assert (((V, D), torch.float32) in rec.created) == (chunk_rows < Na), rec.created
    big = [c for c in rec.created if c[0] not in ((C, V), (V, D), (Na, D)) and
           torch.Size(c[0]).numel() >= C * V]
    assert not big, big


def test_no_rows():
    P = problem(seed=7, loss_type="dapo", beta=0.04)
    P.update({k: P[k][:0] for k in ("h", "ids", "weights", "adv", "old", "ref")})
    stats, grads = ours(P, torch.bfloat16)
    assert all(v.numel() == 0 for v in stats.values())
    assert grads[0].shape == (0, SHAPE[2])
    assert not grads[1].any() and not grads[2].any()


def test_chunk_rows_rule():
    V, D = 128256, 4096
    per_row = V * 4 + D * 8  # float32 logits (the d logits over them), two [., D] float32 rows
    rows = llg.chunk_rows(16384, V, D, llg.CUDA_BUDGET_BYTES)
    assert rows == llg.CUDA_BUDGET_BYTES // per_row // 16 * 16 and 1300 <= rows <= 1400
    assert rows * per_row <= llg.CUDA_BUDGET_BYTES
    assert llg.chunk_rows(100, V, D, 2**40) == 100  # at most n
    assert llg.chunk_rows(100, V, D, 10) == 1  # at least 1
    assert llg.chunk_rows(0, V, D, 2**30) == 1
    assert llg.chunk_rows(5000, 100, 8, 37 * (400 + 64)) == 32  # aligned
    assert llg.chunk_rows(5000, 100, 8, 9 * (400 + 64)) == 9  # < 16: as is


def test_bad_arguments():
    P = problem(seed=8, loss_type="dapo")
    h, w, b = head(P, torch.float32)
    ep = epilogue(P, "cpu")
    call = lambda *a, **k: llg.linear_loss_grad(*a, **k)  # noqa: E731
    with pytest.raises(ValueError, match="hidden must be a contiguous"):
        call(h.T, w, b, P["ids"], 1.0, ep)
    with pytest.raises(TypeError, match="must share a dtype"):
        call(h, w.bfloat16(), None, P["ids"], 1.0, ep)
    with pytest.raises(ValueError, match="targets must be"):
        call(h, w, b, P["ids"].int(), 1.0, ep)
    with pytest.raises(ValueError, match="epilogue tensor must be"):
        call(h[:-1].contiguous(), w, b, P["ids"][:-1], 1.0, ep)
    with pytest.raises(ValueError, match="GRPO epilogue's bundle"):
        call(h, w, b, P["ids"], 1.0, ep._replace(flags=0))
    with pytest.raises(ValueError, match="chunk_rows must be"):
        call(h, w, b, P["ids"], 1.0, ep, chunk_rows=0)


@pytest.mark.parametrize("V", [75, pytest.param(151936, marks=pytest.mark.slow)])
def test_parameters_and_real_vocabulary(V):
    """nn.Parameter heads and a hidden state that requires grad, as a model hands them over (the
    function builds no graph), at a tiny and at a Qwen2.5-sized vocabulary, against the truth."""
    D, Na = 8, 4
    g = torch.Generator().manual_seed(9)
    weight = torch.nn.Parameter(torch.randn(V, D, generator=g).bfloat16())
    bias = torch.nn.Parameter(torch.randn(V, generator=g).bfloat16())
    P = dict(h=torch.randn(Na, D, generator=g), w=weight.detach().float(),
             b=bias.detach().float(), ids=torch.randint(0, V, (Na,), generator=g),
             weights=torch.full((Na,), 1.0 / Na), adv=torch.randn(Na, generator=g),
             old=torch.full((Na,), -12.0), ref=torch.full((Na,), -12.0), isr=None,
             g_ent=torch.full((Na,), -0.01), temperature=0.9,
             rule=GRPOParams(loss_type="dapo", beta=0.04).token_loss_args)
    hidden = P["h"].bfloat16().to(KERNEL_DEVICE).requires_grad_()
    out = llg.linear_loss_grad(hidden, weight.to(KERNEL_DEVICE), bias.to(KERNEL_DEVICE),
                               P["ids"].to(KERNEL_DEVICE), 0.9, epilogue(P, KERNEL_DEVICE),
                               P["g_ent"].to(KERNEL_DEVICE))
    assert not any(x.requires_grad for x in out)
    P["h"] = hidden.detach().float().cpu()
    truth, same = torch_terms(P, torch.float64), torch_terms(P, torch.bfloat16)
    got = [x.cpu() for x in out[4:]]
    assert_bounded(got, [s.bfloat16() for s in same[1]], truth[1], TOL[torch.bfloat16], "grads")
