"""Packed (padding-free) batches: `cu_seqlens` with hidden [N, D] or logits [N, V] gives the loss,
metrics and gradients of the padded call on the same tokens, on the Triton kernels (interpreter
on CPU), the chunked PyTorch path and the reference; every loss type × importance-sampling level
× option, with a length-1 and a zero-length sequence in every batch. Plus the modules, the
errors of a bad `cu_seqlens`, and torch.compile.

The two batches are built independently from the same sequences: padded rows [S, T] with random
(finite) values at the padded positions, and the concatenation of the sequences [N]."""

import pytest
import torch
from helpers import TYPE_LEVELS, leaf

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.loss_specs import TOKEN_LOSS_TYPES

pytestmark = pytest.mark.usefixtures("one_thread")
D, V = 8, 32
BACKENDS = ["triton", "chunked", "reference"]
CONFIGS = {
    "beta-entropy-bias": dict(beta=0.04, entropy_coef=0.01, bias=True, temperature=0.7),
    "delta-no_bias_correction": dict(beta=0.04, delta=1.5, use_bias_correction_kl=False),
    "isr_N-token_adv": dict(isr="N", token_adv=True, entropy_coef=0.02),
    "isr_S-num_items": dict(isr="S", num_items_in_batch=13, beta=0.04),
    "no_old_logps": dict(old=False),
}


def lengths_for(seed: int) -> list[int]:
    """S = 4 sequences of at most 5 tokens, always one of length 1 and one of length 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(2, 6, (1,), generator=g)), 1, 0,
               int(torch.randint(1, 6, (1,), generator=g))]
    order = torch.randperm(4, generator=g).tolist()
    return [lengths[i] for i in order]


def make_batch(lengths, seed=0, bias=False, token_adv=False, isr=None, old=True,
               temperature=1.0):
    """The same sequences as a padded batch (dict "padded") and a packed one ("packed"): the
    positional and keyword arguments of the loss functions except the head."""
    g = torch.Generator().manual_seed(seed)
    S, N, T = len(lengths), sum(lengths), max(lengths) + 1  # every row ends in padding
    weight = torch.randn(V, D, generator=g) * (3.0 / D**0.5)
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    hidden = torch.randn(S, T, D, generator=g)  # the padded positions hold noise as well
    ids = torch.randint(0, V, (S, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    real = mask.bool()
    with torch.no_grad():
        logp = reference.selective_logprobs(hidden.double(), weight.double(), ids,
                                            None if b is None else b.double(),
                                            temperature=temperature).float()
    old_logps = logp + 0.25 * torch.randn(S, T, generator=g)  # ratios straddle the clip range
    ref_logps = logp + 0.25 * torch.randn(S, T, generator=g)
    adv = torch.randn(S, T, generator=g) if token_adv else torch.randn(S, generator=g)
    ratio = {None: None, "N": torch.rand(S, T, generator=g) + 0.5,
             "S": torch.rand(S, 1, generator=g) + 0.5}[isr]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert cu[-1] == N

    def pack(x):  # [S, T, ...] -> [N, ...] (row-major: sequence by sequence)
        return x[real]

    padded = dict(hidden=hidden, ids=ids, adv=adv, mask=mask, old=old_logps if old else None,
                  ref=ref_logps, isr=ratio)
    packed = dict(hidden=pack(hidden), ids=pack(ids), adv=pack(adv) if token_adv else adv,
                  mask=None, old=pack(old_logps) if old else None, ref=pack(ref_logps),
                  isr=ratio if isr != "N" else pack(ratio), cu_seqlens=cu)
    return weight, b, padded, packed, real


def run_linear(fn, weight, bias, batch, kw):
    h, w, b = leaf(batch["hidden"]), leaf(weight), leaf(bias)
    extra = {} if batch.get("cu_seqlens") is None else dict(cu_seqlens=batch["cu_seqlens"])
    loss, metrics = fn(h, w, batch["ids"], batch["adv"], batch["mask"], batch["old"],
                       batch["ref"], b, importance_sampling_ratio=batch["isr"], **extra, **kw)
    loss.backward()
    return loss.detach(), metrics, h.grad, [w.grad] + ([] if b is None else [b.grad])


def assert_same(packed, padded, real):
    """Packed == padded to float32 precision: loss, every metric, the gradients at the same
    tokens (and no gradient at the padded call's padding), the head's gradients."""
    close = dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(packed[0], padded[0], **close)
    assert packed[1].keys() == padded[1].keys()
    for key in padded[1]:
        torch.testing.assert_close(packed[1][key], padded[1][key], **close, msg=key)
    torch.testing.assert_close(packed[2], padded[2][real], **close)
    assert torch.count_nonzero(padded[2][~real]) == 0
    for ours, want in zip(packed[3], padded[3], strict=True):
        torch.testing.assert_close(ours, want, **close)


def check_linear(backend, loss_type, level, config, seed=0):
    config = dict(config)
    batch_kw = {k: config.pop(k) for k in ("bias", "token_adv", "isr", "old") if k in config}
    kw = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=7,
              epsilon_high=4.0 if loss_type == "cispo" else 0.28, **config)
    weight, b, padded, packed, real = make_batch(lengths_for(seed), seed, **batch_kw,
                                                 temperature=kw.get("temperature", 1.0))
    if backend == "reference":
        want = run_linear(reference.fused_linear_grpo_loss, weight, b, padded, kw)
        ours = run_linear(reference.fused_linear_grpo_loss, weight, b, packed, kw)
    else:
        with gk.force_backend(backend):
            want = run_linear(gk.fused_linear_grpo_loss, weight, b, padded, kw)
            ours = run_linear(gk.fused_linear_grpo_loss, weight, b, packed, kw)
    assert_same(ours, want, real)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("loss_type,level", TYPE_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend, loss_type, level, config):
    check_linear(backend, loss_type, level, CONFIGS[config],
                 seed=TOKEN_LOSS_TYPES.index(loss_type) + 10 * list(CONFIGS).index(config))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_and_int32_cu_seqlens(backend):
    """A given [N] mask (fractional, with zeros) weighs the packed tokens as the padded mask
    does; int32 cu_seqlens are accepted; advantages and ratios as [S, 1]."""
    weight, _, padded, packed, real = make_batch([2, 5, 1, 4], seed=3, isr="S")
    g = torch.Generator().manual_seed(4)
    padded["mask"] = padded["mask"] * torch.rand(padded["mask"].shape, generator=g)
    padded["mask"][0, 1] = 0.0
    packed.update(mask=padded["mask"][real], adv=padded["adv"][:, None],
                  cu_seqlens=packed["cu_seqlens"].int())
    fn = reference.fused_linear_grpo_loss if backend == "reference" else gk.fused_linear_grpo_loss
    for kw in (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
               dict(loss_type="dapo", entropy_coef=0.01)):
        with gk.force_backend(None if backend == "reference" else backend):
            want = run_linear(fn, weight, None, padded, kw)
            ours = run_linear(fn, weight, None, packed, kw)
        assert_same(ours, want, real)


def test_zero_length_sequence_counts_in_S():
    """A zero-length sequence is a fully masked padded row: it adds nothing but counts in S for
    the per-sequence means (grpo), so dropping it scales the loss by S / (S - 1)."""
    weight, _, _, packed, _ = make_batch([3, 0, 2], seed=5)
    kw = dict(loss_type="grpo")
    with gk.force_backend("chunked"):
        full = run_linear(gk.fused_linear_grpo_loss, weight, None, packed, kw)[0]
        packed.update(adv=packed["adv"][[0, 2]], cu_seqlens=torch.tensor([0, 3, 5]))
        dropped = run_linear(gk.fused_linear_grpo_loss, weight, None, packed, kw)[0]
    torch.testing.assert_close(full, dropped * 2 / 3)


# ---- the logits variant and the modules -------------------------------------------------------


def run_logits(fn, logits, batch, kw):
    x = leaf(logits)
    extra = {} if batch.get("cu_seqlens") is None else dict(cu_seqlens=batch["cu_seqlens"])
    loss, metrics = fn(x, batch["ids"], batch["adv"], batch["mask"], batch["old"], batch["ref"],
                       importance_sampling_ratio=batch["isr"], **extra, **kw)
    loss.backward()
    return loss.detach(), metrics, x.grad, []


@pytest.mark.parametrize("loss_type,level", TYPE_LEVELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_packed_equals_padded(backend, loss_type, level):
    seed = 40 + TOKEN_LOSS_TYPES.index(loss_type)
    weight, _, padded, packed, real = make_batch(lengths_for(seed), seed, isr="N")
    logits = padded["hidden"] @ weight.T * 2.0  # [S, T, V]
    kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, delta=1.5,
              entropy_coef=0.01, max_completion_length=7, temperature=0.9,
              epsilon_high=4.0 if loss_type == "cispo" else 0.28)
    fn = reference.grpo_loss if backend == "reference" else gk.grpo_loss
    with gk.force_backend(None if backend == "reference" else backend):
        want = run_logits(fn, logits, padded, kw)
        ours = run_logits(fn, logits[real], packed, kw)  # [N, V]
    assert_same(ours, want, real)


@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_modules_take_cu_seqlens(backend):
    weight, b, padded, packed, real = make_batch(lengths_for(7), seed=7, bias=True)
    kw = dict(loss_type="luspo", beta=0.04, importance_sampling_level="sequence")
    cu = packed["cu_seqlens"]
    with gk.force_backend(backend):
        module = gk.FusedLinearGRPOLoss(**kw)
        a = module(packed["hidden"], weight, packed["ids"], packed["adv"], None, packed["old"],
                   packed["ref"], b, cu_seqlens=cu)
        want = gk.fused_linear_grpo_loss(padded["hidden"], weight, padded["ids"], padded["adv"],
                                         padded["mask"], padded["old"], padded["ref"], b, **kw)
        torch.testing.assert_close(a[0], want[0], rtol=2e-5, atol=2e-6)
        logits = padded["hidden"] @ weight.T
        c = gk.GRPOLoss(**kw)(logits[real], packed["ids"], packed["adv"], None, packed["old"],
                              packed["ref"], cu_seqlens=cu)
        want = gk.grpo_loss(logits, padded["ids"], padded["adv"], padded["mask"], padded["old"],
                            padded["ref"], **kw)
        torch.testing.assert_close(c[0], want[0], rtol=2e-5, atol=2e-6)
        assert c[1].keys() == want[1].keys()


# ---- errors -----------------------------------------------------------------------------------

ERRORS = [
    # (description, mutate(kwargs), message fragment); the batch has S = 4, N = 9
    ("float", lambda k: k.update(cu_seqlens=k["cu_seqlens"].float()), "1-D int32 or int64"),
    ("2-D", lambda k: k.update(cu_seqlens=k["cu_seqlens"][None]), "1-D int32 or int64"),
    ("one entry", lambda k: k.update(cu_seqlens=k["cu_seqlens"][:1]), "at least [0, N]"),
    ("start", lambda k: k.update(cu_seqlens=k["cu_seqlens"] + 1), "must start at 0"),
    ("decreasing", lambda k: k["cu_seqlens"].__setitem__(2, 1),
     "must not decrease (sequence lengths are >= 0), got cu_seqlens[2] = 1 < cu_seqlens[1] = 3"),
    ("end", lambda k: k.update(cu_seqlens=k["cu_seqlens"][:-1]),
     "must end at the number of tokens N = 9"),
    ("S vs advantages", lambda k: k.update(cu_seqlens=torch.tensor([0, 3, 9])),
     "S + 1 = 3 entries of cu_seqlens"),
    ("device", lambda k: k.update(cu_seqlens=k["cu_seqlens"].to("meta")),
     "cu_seqlens is on meta but hidden is on cpu"),
    ("padded hidden", lambda k: k.update(hidden=k["hidden"][None]),
     "hidden must be [N, D] with cu_seqlens"),
    ("ids", lambda k: k.update(completion_ids=k["completion_ids"][:-1]),
     "completion_ids must have shape (9,)"),
    ("mask", lambda k: k.update(completion_mask=torch.ones(4, 3)),
     "completion_mask must have shape [N] = [9]"),
    ("old", lambda k: k.update(old_logps=torch.zeros(4)), "old_logps must have shape [N] = [9]"),
]


@pytest.mark.parametrize("impl", ["ours", "reference"])
@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_packed_input_raises_value_error(case, impl):
    weight, _, _, packed, _ = make_batch([3, 1, 0, 5], seed=8)
    kwargs = dict(hidden=packed["hidden"], weight=weight, completion_ids=packed["ids"],
                  advantages=packed["adv"], old_logps=packed["old"],
                  cu_seqlens=packed["cu_seqlens"].clone())
    _, mutate, fragment = case
    mutate(kwargs)
    fn = gk.fused_linear_grpo_loss if impl == "ours" else reference.fused_linear_grpo_loss
    with pytest.raises(ValueError) as info:
        fn(**kwargs)
    assert fragment in str(info.value)
    if "completion_ids" not in fragment and "hidden" not in fragment:
        assert "cu_seqlens" in str(info.value) or "[N]" in str(info.value)


def test_bad_packed_logits_raise_value_error():
    weight, _, padded, packed, real = make_batch([3, 1, 0, 5], seed=8)
    logits = padded["hidden"] @ weight.T
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] with cu_seqlens"):
        gk.grpo_loss(logits, packed["ids"], packed["adv"], cu_seqlens=packed["cu_seqlens"])
    with pytest.raises(ValueError, match="cu_seqlens must end at the number of tokens N = 9"):
        gk.grpo_loss(logits[real], packed["ids"], packed["adv"],
                     cu_seqlens=packed["cu_seqlens"][:-1])


# ---- torch.compile ----------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo", "recompute_tiles")
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_packed_call_compiles_fullgraph(backend, level):
    """torch.compile(fullgraph=True) of a packed step gives eager's loss, metrics and
    gradients; a bad cu_seqlens still fails inside the compiled graph (in-graph assertion)."""
    weight, b, _, packed, _ = make_batch(lengths_for(9), seed=9, bias=True)
    kw = dict(beta=0.04, entropy_coef=0.01, epsilon_high=0.28, importance_sampling_level=level)

    def step(h, w, bb, cu):
        loss, metrics = gk.fused_linear_grpo_loss(h, w, packed["ids"], packed["adv"], None,
                                                  packed["old"], packed["ref"], bb,
                                                  cu_seqlens=cu, **kw)
        return loss * 1.0, metrics

    def run(fn, cu):
        h, w, bb = leaf(packed["hidden"]), leaf(weight), leaf(b)
        loss, metrics = fn(h, w, bb, cu)
        loss.backward()
        return [loss.detach(), *metrics.values(), h.grad, w.grad, bb.grad]

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with gk.force_backend(backend):
        want = run(step, packed["cu_seqlens"])
        ours = run(compiled, packed["cu_seqlens"])
        for o, w in zip(ours, want, strict=True):
            assert torch.equal(o, w), (o, w)
        with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
            compiled(packed["hidden"], weight, b, packed["cu_seqlens"] + 1)


def test_opcheck_packed_loss_op():
    """The loss op's schema, fake tensors and autograd registration with cu_seqlens."""
    from grpo_kernels.loss_call import terms_args as _terms_args
    from grpo_kernels.ops.custom_ops import OPS
    from grpo_kernels.params import GRPOParams
    from grpo_kernels.validation import check_loss_inputs

    weight, b, _, packed, _ = make_batch([2, 0, 1], seed=10, bias=True)
    params = GRPOParams(beta=0.04, entropy_coef=0.01)
    inputs = check_loss_inputs(1, 3, torch.device("cpu"), params, None, packed["adv"],
                               packed["old"], packed["ref"], None, None,
                               cu_seqlens=packed["cu_seqlens"])
    args = OPS.linear_grpo_terms.args(leaf(packed["hidden"]), leaf(weight), leaf(b), packed["ids"],
                                      1.0, None, "triton", *_terms_args(inputs, params))
    tests = ["test_schema", "test_faketensor", "test_autograd_registration",
             "test_aot_dispatch_dynamic"]
    result = torch.library.opcheck(OPS.linear_grpo_terms.default, args, test_utils=tests)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("impl", ["fused_linear", "logits"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_no_tokens_at_all_gives_zero_loss_and_gradients(impl, loss_type):
    """A packed micro-batch whose sequences are all empty (e.g. masked truncated completions):
    N = 0. The loss is 0 and every gradient is exactly zero (d W is written, never left as
    uninitialized memory), on the chunked path and in the interpreter."""
    torch.manual_seed(0)
    weight = leaf(torch.randn(11, 8))
    extra = dict(cu_seqlens=torch.tensor([0, 0, 0]), loss_type=loss_type, beta=0.1,
                 ref_logps=torch.zeros(0),
                 num_items_in_batch=torch.tensor(5.0) if loss_type == "dapo" else None)
    for backend in ("chunked", "triton"):
        with gk.force_backend(backend):
            if impl == "fused_linear":
                hidden = leaf(torch.randn(0, 8))
                loss, metrics = gk.fused_linear_grpo_loss(
                    hidden, weight, torch.zeros(0, dtype=torch.long), torch.randn(2), **extra)
                grads = (hidden, weight)
            else:
                logits = leaf(torch.randn(0, 11))
                loss, metrics = gk.grpo_loss(logits, torch.zeros(0, dtype=torch.long),
                                             torch.randn(2), **extra)
                grads = (logits,)
            loss.backward()
        assert loss.item() == 0.0 and all(m.item() == 0.0 for m in metrics.values())
        for x in grads:
            if x.grad is not None:
                assert torch.equal(x.grad, torch.zeros_like(x)), backend
                x.grad = None
