"""torch.compile with sizes that change from step to step, as in GRPO training (every step has
another number of sequences and another completion length): the fused losses trace them as
symbolic sizes, so a compiled step compiles twice (once for the first sizes, once with dynamic
sizes) and never again. Code on the traced path that fixes a size to its value (a size in a
formatted string, a shape compared in a way Dynamo cannot decide) would recompile it at every
new size, and with fullgraph=True fail once Dynamo's recompile limit (8) is reached.

Runs on both backends: the Triton kernels in the interpreter and the chunked PyTorch path."""

import pytest
import torch
from helpers import make_grpo_batch, make_head

import grpo_kernels as gk

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
