"""Bad input gets a clear error naming the argument; never a silent wrong answer."""

import numpy as np
import pytest
import torch
from helpers import make_head

import grpo_kernels as gk
from grpo_kernels import reference

B, T, D, V = 2, 5, 8, 21


@pytest.fixture
def inputs():
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    return hidden, weight, ids, torch.randn(B)


CASES = [
    # (description, mutate(kwargs) -> None, exception, message fragment)
    ("ids out of range", lambda k: k.update(completion_ids=k["completion_ids"] + V), ValueError,
     "completion_ids has token id"),
    ("negative ids", lambda k: k["completion_ids"].__setitem__((0, 0), -100), ValueError,
     "not -100"),
    ("float ids", lambda k: k.update(completion_ids=k["completion_ids"].float()), TypeError,
     "completion_ids must be an integer tensor (token ids, of any integer dtype)"),
    ("ids shape", lambda k: k.update(completion_ids=k["completion_ids"][:, :3]), ValueError,
     "completion_ids must have shape"),
    ("hidden 2-d", lambda k: k.update(hidden=k["hidden"][0]), ValueError, "[B, T, D]"),
    ("hidden width", lambda k: k.update(hidden=k["hidden"][..., :3]), ValueError,
     "hidden size D"),
    ("dtype mismatch", lambda k: k.update(weight=k["weight"].double()), TypeError,
     "same dtype"),
    ("16-bit weight, fp32 hidden", lambda k: k.update(weight=k["weight"].bfloat16()), TypeError,
     "16-bit (float16/bfloat16) with a float32 weight"),
    ("fp64 hidden, fp32 weight", lambda k: k.update(hidden=k["hidden"].double()), TypeError,
     "same dtype"),
    ("bias dtype", lambda k: k.update(bias=torch.zeros(V, dtype=torch.float16)), TypeError,
     "bias (torch.float16) must have weight's dtype"),
    ("int hidden", lambda k: k.update(hidden=k["hidden"].long()), TypeError,
     "hidden must be a floating-point"),
    ("weight 1-d", lambda k: k.update(weight=k["weight"][0]), ValueError, "weight must have 2"),
    ("hidden size 0", lambda k: k.update(hidden=k["hidden"][..., :0], weight=k["weight"][:, :0]),
     ValueError, "weight must have a hidden size D >= 1, got shape (21, 0)"),
    ("bias shape", lambda k: k.update(bias=torch.zeros(V + 1)), ValueError,
     "bias must have shape [V]"),
    ("advantages shape", lambda k: k.update(advantages=torch.randn(B + 1)), ValueError,
     "advantages must have shape"),
    ("advantages nan", lambda k: k["advantages"].__setitem__(0, float("nan")), ValueError,
     "advantages contain NaN"),
    ("advantages inf", lambda k: k["advantages"].__setitem__(1, float("inf")), ValueError,
     "advantages contain NaN or inf"),
    ("mask shape", lambda k: k.update(completion_mask=torch.ones(B, T + 1)), ValueError,
     "completion_mask must have shape"),
    ("mask nan", lambda k: k.update(completion_mask=torch.ones(B, T).index_fill(1, torch.tensor(
        [2]), float("nan"))), ValueError, "completion_mask contains NaN or inf"),
    ("mask complex", lambda k: k.update(completion_mask=torch.ones(B, T, dtype=torch.complex64)),
     TypeError, "completion_mask must be a real tensor"),
    ("old shape", lambda k: k.update(old_logps=torch.zeros(B)), ValueError,
     "old_logps must have shape"),
    ("unknown loss", lambda k: k.update(loss_type="ppo"), ValueError, "loss_type must be one of"),
    ("unknown level", lambda k: k.update(importance_sampling_level="seq"), ValueError,
     "importance_sampling_level must be one of"),
    ("beta without ref", lambda k: k.update(beta=0.04), ValueError,
     "ref_logps is required when beta != 0"),
    ("dr_grpo without length", lambda k: k.update(loss_type="dr_grpo"), ValueError,
     "needs max_completion_length"),
    ("bad temperature", lambda k: k.update(temperature=0.0), ValueError, "temperature"),
    ("nan epsilon", lambda k: k.update(epsilon_low=float("nan")), ValueError, "epsilon_low"),
    ("bad delta", lambda k: k.update(delta=-1.0), ValueError, "delta must be > 0"),
    ("negative beta", lambda k: k.update(beta=-0.04, ref_logps=torch.zeros(B, T)), ValueError,
     "beta must be >= 0"),
    ("bias-correction flag a string", lambda k: k.update(use_bias_correction_kl="False"),
     TypeError, "use_bias_correction_kl must be a bool, got 'False'"),
    ("isr shape", lambda k: k.update(importance_sampling_ratio=torch.ones(T)), ValueError,
     "importance_sampling_ratio must have shape"),
    ("num items type", lambda k: k.update(num_items_in_batch="12"), TypeError,
     "num_items_in_batch"),
    ("num items tensor", lambda k: k.update(num_items_in_batch=torch.ones(3)), ValueError,
     "num_items_in_batch"),
    ("not a tensor", lambda k: k.update(hidden=[[1.0]]), TypeError, "hidden must be a torch"),
    ("sparse hidden", lambda k: k.update(hidden=k["hidden"].to_sparse()), TypeError,
     "hidden must be a dense tensor (torch.strided), got torch.sparse_coo"),  # failed inside
    ("sparse mask", lambda k: k.update(completion_mask=torch.ones(B, T).to_sparse()), TypeError,
     "completion_mask must be a dense tensor"),
    ("hidden 2-d, no cu_seqlens", lambda k: k.update(hidden=k["hidden"][0]), ValueError,
     "a packed batch's hidden [N, D] needs cu_seqlens"),
    # float hyperparameters enter float32 arithmetic: 1e39 is inf there (a clamp bound failed
    # to convert on the chunked path), and a divisor under 1.2e-38 has no finite inverse
    ("epsilon beyond float32", lambda k: k.update(epsilon_low=1e39), ValueError,
     "epsilon_low must be a finite number within float32's range"),
    ("delta beyond float32", lambda k: k.update(delta=1e300), ValueError,
     "delta must be a finite number within float32's range"),
    ("temperature under float32's normal range", lambda k: k.update(temperature=1e-300),
     ValueError, "temperature must be > 0 (the logits are divided by it"),
    ("sapo temperature under float32's normal range",
     lambda k: k.update(loss_type="sapo", sapo_temperature_neg=1e-39), ValueError,
     "sapo_temperature_neg must be > 0"),
    ("numpy int length", lambda k: k.update(loss_type="dr_grpo",
                                           max_completion_length=np.int64(5)), ValueError,
     "max_completion_length must be a positive int (a Python int), got np.int64(5)"),
    ("numpy float32 hyperparameter", lambda k: k.update(beta=np.float32(0.04)), ValueError,
     "beta must be a finite number (a Python int or float), got np.float32(0.04) of type"),
]


@pytest.mark.parametrize("impl", ["ours", "reference"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(inputs, case, impl):
    hidden, weight, ids, adv = inputs
    kwargs = dict(hidden=hidden, weight=weight, completion_ids=ids.clone(), advantages=adv.clone())
    _, mutate, exc, fragment = case
    mutate(kwargs)
    fn = gk.fused_linear_grpo_loss if impl == "ours" else reference.fused_linear_grpo_loss
    with pytest.raises(exc) as info:
        fn(**kwargs)
    assert fragment in str(info.value)


def test_selective_logprobs_errors():
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    with pytest.raises(ValueError, match="targets has token id 21 outside"):
        gk.selective_logprobs(hidden, weight, torch.full((B, T), V))
    with pytest.raises(ValueError, match=r"targets must have shape \(2, 5\)"):
        gk.selective_logprobs(hidden, weight, ids[:1])
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        gk.selective_logprobs(hidden, weight, ids, temperature=-1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        with gk.force_backend("cuda"):
            pass


def test_former_backend_name_still_pins_the_chunked_path():
    """The chunked path was once called "torch": that name still works, with a FutureWarning."""
    from grpo_kernels.ops.backends import forced_backend

    with pytest.warns(FutureWarning, match="'torch' is now called 'chunked'"):
        with gk.force_backend("torch"):
            assert forced_backend() == "chunked"
    assert forced_backend() is None


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float16])
def test_mixed_head_precision_is_accepted(hidden_dtype):
    """16-bit hidden with a float32 lm_head (and bias) passes validation on every public entry
    (accuracy: test_selective_logprobs.py / test_fused_linear_grpo.py test_mixed_head_precision)."""
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    h, bias, adv = hidden.to(hidden_dtype), torch.zeros(V) + 0.1, torch.randn(B)
    logp = gk.selective_logprobs(h, weight, ids, bias)
    assert logp.dtype == torch.float32 and bool(torch.isfinite(logp).all())
    loss, _ = gk.fused_linear_grpo_loss(h, weight, ids, adv)
    assert bool(torch.isfinite(loss))
    # the reference twins take it too: the logits of the float32 head (hidden cast exactly)
    torch.testing.assert_close(reference.selective_logprobs(h, weight, ids, bias), logp)
    torch.testing.assert_close(reference.fused_linear_grpo_loss(h, weight, ids, adv)[0], loss)


def test_forcing_triton_on_float64_is_refused():
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float64, "cpu")
    with gk.force_backend("triton"), pytest.raises(RuntimeError, match="cannot run") as info:
        gk.selective_logprobs(hidden, weight, ids)
    # the reason given is the dtype, not the interpreter (which is on here when there is no GPU)
    assert "float64 runs on the chunked backend" in str(info.value)
    # without forcing, float64 is served by the chunked PyTorch path
    assert gk.selective_logprobs(hidden, weight, ids).dtype == torch.float32


def test_mask_values_are_respected_not_required_binary(inputs):
    """Fractional masks (e.g. tool masks multiplied in) weigh tokens, as in TRL."""
    hidden, weight, ids, adv = inputs
    mask = torch.rand(B, T)
    a, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, loss_type="bnpo")
    b, _ = reference.fused_linear_grpo_loss(hidden.double(), weight.double(), ids, adv, mask,
                                            loss_type="bnpo")
    assert abs(a.item() - b.item()) < 1e-5


@pytest.mark.parametrize("source", ["hidden", "logits"])
@pytest.mark.parametrize("impl", ["ours", "reference"])
def test_device_mismatch_names_both_tensors(inputs, source, impl):
    """A per-token input on another device is refused before any kernel runs, and the message
    names the tensor the loss is computed from (meta stands in for a second device on CPU)."""
    hidden, weight, ids, adv = inputs
    mod = gk if impl == "ours" else reference
    if source == "hidden":
        def call(**kw):
            return mod.fused_linear_grpo_loss(hidden, weight, ids, **kw)
    else:
        logits = torch.randn(B, T, V)

        def call(**kw):
            return mod.grpo_loss(logits, ids, **kw)
    with pytest.raises(ValueError, match=f"advantages is on meta but {source} is on cpu"):
        call(advantages=adv.to("meta"))
    with pytest.raises(ValueError, match=f"completion_mask is on meta but {source} is on cpu"):
        call(advantages=adv, completion_mask=torch.ones(B, T, device="meta"))


# ---- counts and normalizers ---------------------------------------------------------------------
# Every count or normalizer a caller passes must be finite and > 0: a normalizer of 0 was once
# clamped to 1 silently, which turns a token mean into a token sum.

BAD_NORMALIZERS = [(0, "got 0"), (-1, "got -1"), (float("nan"), "got nan"),
                   (float("inf"), "got inf"), (torch.tensor(0.0), "got 0.0")]
BAD_IDS = ["0", "-1", "nan", "inf", "tensor0"]
# finite, but inf in float32 (the loss came out 0): as a number and as a float64 tensor
TOO_LARGE = [(1e300, "got 1e+300"), (torch.tensor(1e300, dtype=torch.float64), "got 1e+300")]


def _entry_points():
    """name -> call(**kwargs) for every public loss that takes num_items_in_batch: the
    functions (ours and the reference), the modules, and the packed (cu_seqlens) forms."""
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    logits = torch.randn(B, T, V)
    adv = torch.randn(B)
    cu = torch.tensor([0, T, B * T])  # the same tokens as B sequences of T, end to end
    flat_hidden, flat_logits, flat_ids = hidden.reshape(B * T, D), logits.reshape(B * T, V), \
        ids.reshape(-1)

    def with_params(fn, *args, **fixed):
        return lambda **kw: fn(*args, **fixed, **kw)

    def module(cls, *args):
        def call(**kw):
            init = {k: kw.pop(k) for k in ("loss_type", "max_completion_length") if k in kw}
            return cls(**init)(*args, **kw)
        return call

    return {
        "fused_linear_grpo_loss": with_params(gk.fused_linear_grpo_loss, hidden, weight, ids,
                                              adv),
        "grpo_loss": with_params(gk.grpo_loss, logits, ids, adv),
        "FusedLinearGRPOLoss": module(gk.FusedLinearGRPOLoss, hidden, weight, ids, adv),
        "GRPOLoss": module(gk.GRPOLoss, logits, ids, adv),
        "fused_linear_grpo_loss packed": with_params(gk.fused_linear_grpo_loss, flat_hidden,
                                                     weight, flat_ids, adv, cu_seqlens=cu),
        "grpo_loss packed": with_params(gk.grpo_loss, flat_logits, flat_ids, adv, cu_seqlens=cu),
        "reference.fused_linear_grpo_loss": with_params(reference.fused_linear_grpo_loss, hidden,
                                                        weight, ids, adv),
        "reference.grpo_loss": with_params(reference.grpo_loss, logits, ids, adv),
        "reference.grpo_loss packed": with_params(reference.grpo_loss, flat_logits, flat_ids,
                                                  adv, cu_seqlens=cu),
    }


ENTRY_POINTS = list(_entry_points())


@pytest.mark.parametrize("bad", BAD_NORMALIZERS + TOO_LARGE,
                         ids=BAD_IDS + ["1e300", "float64 tensor 1e300"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_bad_num_items_in_batch_is_refused(entry, bad):
    value, shown = bad
    call = _entry_points()[entry]
    for loss_type in ("dapo", "grpo"):  # refused whether or not the loss type uses it
        with pytest.raises(ValueError) as info:
            call(num_items_in_batch=value, loss_type=loss_type)
        message = str(info.value)
        assert message.startswith("num_items_in_batch must be a positive finite number"), message
        assert shown in message


@pytest.mark.parametrize("good", [7, 0.5, torch.tensor(7.0), torch.tensor(7)],
                         ids=["int", "float", "tensor", "int tensor"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_positive_num_items_in_batch_is_accepted(entry, good):
    loss, _ = _entry_points()[entry](num_items_in_batch=good)
    assert bool(torch.isfinite(loss))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_num_items_in_batch_scales_the_dapo_loss(entry):
    """A valid normalizer divides the token sum: n = 7 gives twice the loss of n = 14."""
    call = _entry_points()[entry]
    a, _ = call(num_items_in_batch=7)
    b, _ = call(num_items_in_batch=torch.tensor(14.0))
    assert abs(a.item() - 2 * b.item()) <= 1e-5 * max(1.0, abs(a.item()))


def test_num_items_in_batch_bool_tensor_is_refused():
    with pytest.raises(TypeError, match="num_items_in_batch must be a real-valued tensor"):
        _entry_points()["fused_linear_grpo_loss"](num_items_in_batch=torch.tensor(True))


BAD_LENGTHS = [(0, "got 0"), (-1, "got -1"), (float("nan"), "got nan"),
               (float("inf"), "got inf"), (torch.tensor(0.0), "got tensor(0.)")]


@pytest.mark.parametrize("bad", BAD_LENGTHS, ids=BAD_IDS)
@pytest.mark.parametrize("entry", ["GRPOParams", *ENTRY_POINTS])
def test_bad_max_completion_length_is_refused(entry, bad):
    """dr_grpo's normalizer B·max_completion_length: a positive int, checked with the other
    hyperparameters (so also by the modules' constructors)."""
    value, shown = bad
    call = gk.GRPOParams if entry == "GRPOParams" else _entry_points()[entry]
    with pytest.raises(ValueError) as info:
        call(loss_type="dr_grpo", max_completion_length=value)
    message = str(info.value)
    assert message.startswith("max_completion_length must be a positive int"), message
    assert shown in message


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_positive_max_completion_length_is_accepted(entry):
    loss, _ = _entry_points()[entry](loss_type="dr_grpo", max_completion_length=64)
    assert bool(torch.isfinite(loss))


def test_num_items_in_batch_tensor_is_checked_in_graph_under_torch_compile():
    """Under torch.compile a tensor normalizer is an in-graph assertion: no graph break, no
    host read, and a bad value still fails with the argument's name."""
    torch._dynamo.reset()
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    adv = torch.randn(B)

    def step(n):
        return gk.fused_linear_grpo_loss(hidden, weight, ids, adv, num_items_in_batch=n)[0]

    try:
        fn = torch.compile(step, fullgraph=True, backend="eager")
        n = torch.tensor(7.0)
        assert torch.allclose(fn(n), step(n))
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(RuntimeError, match="num_items_in_batch must be a positive finite"):
                fn(torch.tensor(bad))
    finally:
        torch._dynamo.reset()


FLAGS = [  # (call, flag): every flag of the public functions must be a Python bool
    (lambda h, w, ids, adv, **f: gk.fused_linear_grpo_loss(h, w, ids, adv, **f), "return_terms"),
    (lambda h, w, ids, adv, **f: gk.fused_linear_grpo_loss(h, w, ids, adv, **f),
     "return_token_values"),
    (lambda h, w, ids, adv, **f: gk.grpo_loss(h @ w.T, ids, adv, **f), "inplace"),
    (lambda h, w, ids, adv, **f: gk.grpo_loss(h @ w.T, ids, adv, **f), "return_terms"),
    (lambda h, w, ids, adv, **f: gk.selective_logprobs(h, w, ids, **f), "return_entropy"),
    (lambda h, w, ids, adv, **f: gk.logprobs_from_logits(h @ w.T, ids, **f), "inplace"),
    (lambda h, w, ids, adv, **f: gk.logprobs_from_logits(h @ w.T, ids, **f), "return_entropy"),
]


@pytest.mark.parametrize("call, flag", FLAGS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(FLAGS)])
def test_a_flag_given_as_a_string_is_refused(call, flag, inputs):
    """inplace="False" reads as true (the backward overwrote the caller's logits): a TypeError
    naming the flag."""
    hidden, weight, ids, adv = inputs
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'False'"):
        call(hidden, weight, ids, adv, **{flag: "False"})


def test_a_too_large_token_id_is_not_blamed_on_minus_100(inputs):
    """The -100 hint is for negative ids (a label mask); an id >= V gets the range alone."""
    hidden, weight, ids, adv = inputs
    with pytest.raises(ValueError, match=r"token id \d+ outside") as info:
        gk.fused_linear_grpo_loss(hidden, weight, ids + V, adv)
    assert "-100" not in str(info.value)


@pytest.mark.parametrize("make", [
    lambda h, w, ids, adv: gk.fused_linear_grpo_loss(h, w, ids, adv, vocab_group=3),
    lambda h, w, ids, adv: gk.selective_logprobs(h, w, ids, vocab_group="tp"),
    lambda h, w, ids, adv: gk.FusedLinearGRPOLoss(vocab_group=3),
], ids=["function", "logprobs", "module"])
def test_a_vocab_group_that_is_not_a_process_group_is_refused(make, inputs):
    """At the call, and at a module's construction rather than its first forward."""
    with pytest.raises(TypeError, match="vocab_group must be None or a torch.distributed "
                                        "ProcessGroup"):
        make(*inputs)
