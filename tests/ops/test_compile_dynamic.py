"""torch.compile with sizes that change from step to step, as in GRPO training (every step has
another number of sequences and another completion length): the fused losses trace them as
symbolic sizes, so a compiled step compiles twice (once for the first sizes, once with dynamic
sizes) and never again. Code on the traced path that fixes a size to its value (a size in a
formatted string, a shape compared in a way Dynamo cannot decide) would recompile it at every
new size, and with fullgraph=True fail once Dynamo's recompile limit (8) is reached. Float
hyperparameters that change from step to step (a schedule) are traced as symbolic floats the
same way: the operators take them as tensors, which keeps them symbolic, and the PyTorch loss
code traced around them makes them 0-d tensors while compiling (grpo_kernels/traced_floats.py).

Runs on both backends: the Triton kernels in the interpreter and the chunked PyTorch path."""

import dataclasses

import pytest
import torch
from helpers import make_grpo_batch, make_head

import grpo_kernels as gk
from grpo_kernels import reference
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ["triton", "chunked"]
KW = dict(beta=0.04, epsilon_high=0.28)
SIZES = [(2, 5), (3, 6), (2, 7), (4, 8), (3, 9), (2, 10), (3, 11), (4, 12), (2, 13), (3, 14)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch(B, T, seed, packed):
    """A padded batch [B, T], or the same tokens packed into [N] with cu_seqlens [B + 1]."""
    hidden, weight, _, ids = make_head(B, T, 8, 37, torch.float32, "cpu", seed=seed, scale=2.0)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, None, ids, seed=seed)
    args = [hidden, ids, adv, mask, old, ref]
    if not packed:
        return weight, args, {}
    flat = [args[0].reshape(B * T, -1), args[1].reshape(-1), args[2]]
    flat += [x.reshape(-1) for x in args[3:]]
    return weight, flat, {"cu_seqlens": torch.arange(0, B * T + 1, T)}


class GraphCount:
    """A torch.compile backend that counts the graphs Dynamo hands it and runs them eagerly."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_sizes_compile_twice(backend, packed):
    """Ten steps of changing (B, T): two graphs, and each step's loss and d hidden equal the
    eager call's."""
    counter = GraphCount()
    weight = None

    def step(hidden, weight, ids, adv, mask, old, ref, cu_seqlens=None):
        return gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, ref,
                                         cu_seqlens=cu_seqlens, **KW)[0]

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with gk.force_backend(backend):
        for seed, (B, T) in enumerate(SIZES):
            weight, args, kw = batch(B, T, seed, packed)
            weight = torch.nn.Parameter(weight.detach())
            h = args[0].detach().requires_grad_()
            loss = compiled(h, weight, *args[1:], **kw)
            (dh,) = torch.autograd.grad(loss, h)
            h_eager = args[0].detach().requires_grad_()
            want = step(h_eager, weight, *args[1:], **kw)
            (dh_want,) = torch.autograd.grad(want, h_eager)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(dh, dh_want, rtol=1e-5, atol=1e-6)
    assert counter.graphs == 2, f"{counter.graphs} graphs for {len(SIZES)} sizes"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_true_takes_per_sequence_advantages(backend):
    """dynamic=True from the first call: advantages [B] (one per sequence) are accepted, as in
    eager (Dynamo once read a tuple of symbolic sizes as absent from a tuple of tuples)."""
    weight, args, _ = batch(3, 6, 0, packed=False)

    def step(*args):
        return gk.fused_linear_grpo_loss(args[0], weight, *args[1:], **KW)[0]

    with gk.force_backend(backend):
        loss = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")(*args)
        torch.testing.assert_close(loss, step(*args), rtol=1e-5, atol=1e-6)


class Config:
    """Hyperparameters read from an object, as a training script reads its config."""

    beta = 0.04
    temperature = 0.7


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_true_takes_hyperparameters_from_an_object(backend):
    """dynamic=True traces floats read from an object as symbolic floats: the finiteness checks
    take them (math.isfinite cannot), and the loss equals eager's."""
    weight, args, _ = batch(3, 6, 0, packed=False)
    config = Config()

    def step(*args):
        return gk.fused_linear_grpo_loss(args[0], weight, *args[1:], beta=config.beta,
                                         temperature=config.temperature)[0]

    with gk.force_backend(backend):
        loss = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")(*args)
        torch.testing.assert_close(loss, step(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_changing_num_items_in_batch_compiles_twice(backend):
    """num_items_in_batch as a Python int that changes every step (the batch's completion
    tokens): two graphs, and each loss equals eager's."""
    counter = GraphCount()
    weight, args, _ = batch(3, 6, 0, packed=False)

    def step(*args, num_items_in_batch):
        return gk.fused_linear_grpo_loss(args[0], weight, *args[1:], loss_type="dapo",
                                         num_items_in_batch=num_items_in_batch, **KW)[0]

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with gk.force_backend(backend):
        for count in range(7, 13):
            torch.testing.assert_close(compiled(*args, num_items_in_batch=count),
                                       step(*args, num_items_in_batch=count), rtol=1e-5,
                                       atol=1e-6)
    assert counter.graphs == 2, f"{counter.graphs} graphs for 6 counts"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_equal_hyperparameter_in_a_new_object_compiles_once(backend):
    """A hyperparameter that a schedule or a config parser builds anew each step, with the same
    value: one graph (the guards compare values, not the float objects' identities)."""
    counter = GraphCount()
    weight, args, _ = batch(3, 6, 0, packed=False)

    def step(beta, epsilon_high, *args):
        return gk.fused_linear_grpo_loss(args[0], weight, *args[1:], beta=beta,
                                         epsilon_high=epsilon_high, temperature=0.7)[0]

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    with gk.force_backend(backend):
        for _ in range(4):
            beta, epsilon_high = float("0.04"), float("0.28")  # new objects, equal values
            torch.testing.assert_close(compiled(beta, epsilon_high, *args),
                                       step(beta, epsilon_high, *args), rtol=1e-5, atol=1e-6)
    assert counter.graphs == 1, f"{counter.graphs} graphs for one value"


# A hyperparameter schedule: every float a custom operator takes changes at every step (beta,
# the clip range, delta, the temperature, the logit transform), and the entropy coefficient as
# the TRL subclass gives it (its adaptive coefficient / (accumulation · the loss scale), new at
# every micro-batch). Dynamo makes a float that changes a symbolic one; a `float` operator
# argument would specialize it again (a graph per value, and an error at the recompile limit),
# so the operators take them as 0-d tensors.
SCHEDULE = [dict(beta=0.04 + 0.01 * i, epsilon_low=0.2 - 0.02 * i, epsilon_high=0.28 + 0.01 * i,
                 delta=2.0 + 0.5 * i, temperature=0.7 + 0.1 * i, logit_scale=1.0 - 0.1 * i,
                 entropy_coef=float(0.01 + 0.002 * i) / (2 * float(1.0 + 0.1 * i)))
            for i in range(4)]
CAPPED = [dict(step, softcap=20.0 + 5 * i) for i, step in enumerate(SCHEDULE)]  # four passes


def graphs_for(step, calls, dynamic=None):
    """The graphs torch.compile(step) builds (AOTAutograd, where a float operator argument is
    specialized) over `calls`, each (args, kwargs); each call's loss and d hidden (args[0]),
    and its metrics where `step` returns (loss, metrics), equal the eager call's."""
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for args, kw in calls:
        outs = []
        for fn in (compiled, step):
            h = args[0].detach().requires_grad_()
            out = fn(h, *args[1:], **kw)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            outs.append((loss, *torch.autograd.grad(loss, h), metrics))
        for ours, want in zip(*outs):
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    return counts["stats"]["unique_graphs"]


@pytest.mark.parametrize("schedule", [SCHEDULE, CAPPED], ids=["three-pass", "four-pass"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hyperparameter_schedule_compiles_twice(backend, schedule):
    """Four steps with new values of every float hyperparameter an operator takes: two graphs
    (the first values, then symbolic floats), each step's loss and d hidden equal eager's. The
    chunked four-pass route traces grpo_math around its operator: its clamps by the clip range
    and delta keep them symbolic too (`objectives.clamp`)."""
    weight, args, _ = batch(3, 6, 0, packed=False)

    def step(*args, **kw):
        return gk.fused_linear_grpo_loss(args[0], weight, *args[1:], **kw)[0]

    with gk.force_backend(backend):
        graphs = graphs_for(step, [(args, kw) for kw in schedule])
    assert graphs == 2, f"{graphs} graphs for {len(schedule)} steps"


def test_a_hyperparameter_schedule_compiles_once_with_dynamic_true():
    """dynamic=True: the floats are symbolic from the first call: one graph for the logits
    loss (its token-terms op on Triton) over three steps of the schedule, each step's GRPOParams
    made as the TRL subclass makes them (dataclasses.replace of the trainer's)."""
    weight, args, _ = batch(3, 6, 0, packed=False)
    base = GRPOParams(loss_type="dapo")

    def step(hidden, *args, params, logit_scale):
        return gk.grpo_loss(hidden @ weight.T, *args, params=params, logit_scale=logit_scale)[0]

    def kwargs(kw):  # logit_scale is the function's argument, the rest GRPOParams fields
        kw = dict(kw)
        scale = kw.pop("logit_scale")
        return {"params": dataclasses.replace(base, **kw), "logit_scale": scale}

    calls = [(args, kwargs(kw)) for kw in SCHEDULE[:3]]
    with gk.force_backend("triton"):
        graphs = graphs_for(step, calls, dynamic=True)
    assert graphs == 1, f"{graphs} graphs for {len(calls)} steps"


# The options traced as PyTorch code around the operators, three steps of new values each:
# vespo's four parameters (torch.where of two numbers), gmpo's clip range (its clip metrics
# compare the ratio with exp(-epsilon_low) and exp(epsilon_high)) and top_entropy_quantile
# (torch.nanquantile's q); each would fix a symbolic float to its value (traced_floats.py).
OPTION_SCHEDULES = {
    "vespo": [dict(loss_type="vespo", vespo_k_pos=2.0 + 0.5 * i, vespo_lambda_pos=3.0 - 0.5 * i,
                   vespo_k_neg=3.0 + 0.25 * i, vespo_lambda_neg=2.0 + 0.25 * i)
              for i in range(3)],
    "gmpo": [dict(loss_type="gmpo", epsilon_low=0.05 + 0.1 * i, epsilon_high=0.06 + 0.1 * i)
             for i in range(3)],
    "quantile": [dict(top_entropy_quantile=0.4 + 0.2 * i) for i in range(3)],
}


@pytest.mark.parametrize("option", OPTION_SCHEDULES)
@pytest.mark.parametrize("route", [*BACKENDS, "reference"])
def test_an_option_schedule_compiles_twice(route, option):
    """Three steps with new values of vespo's parameters, gmpo's clip range or the entropy
    quantile: two graphs (the first values, then symbolic floats), on both backends and the
    reference, each step's loss, d hidden and metrics (gmpo's clip metrics) equal eager's."""
    weight, args, _ = batch(3, 6, 4, packed=False)  # 7 real tokens, A of both signs
    loss_fn = reference.fused_linear_grpo_loss if route == "reference" else (
        gk.fused_linear_grpo_loss)

    def step(*args, **kw):
        return loss_fn(args[0], weight, *args[1:], **kw)

    schedule = OPTION_SCHEDULES[option]
    with gk.force_backend("chunked" if route == "reference" else route):
        # the values matter: each step's loss differs, and gmpo's clip metrics change
        eager = [step(*args, **kw) for kw in schedule]
        assert len({loss.item() for loss, _ in eager}) == len(schedule)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean") * (option == "gmpo"):
            assert len({metrics[name].item() for _, metrics in eager}) > 1, name
        graphs = graphs_for(step, [(args, kw) for kw in schedule])
    assert graphs == 2, f"{graphs} graphs for {len(schedule)} steps"
