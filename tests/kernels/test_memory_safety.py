"""Memory safety of every kernel variant, checked in Triton's interpreter: every masked-in lane of
every load, store and atomic must address an element of one of the launch's tensor arguments
(the exact elements, so a read into the gap of a sliced view is caught too). Run at the small
interpreter tiles and at the real GPU tiles of sm_75/80/90 (tile_configs with a faked target
architecture), on odd shapes and sliced (non-contiguous) inputs. A planted off-by-one (the
logits kernel told V + 1) shows that the checker fails when it should."""

import functools

import numpy as np
import pytest
import torch
from helpers import leaf, make_grpo_batch, make_head
from triton.runtime import interpreter

import grpo_kernels as gk
from grpo_kernels.kernels import logits_logprobs, tile_configs
from grpo_kernels.kernels.epilogue import epilogue_args
from grpo_kernels.kernels.linear_loss_grad import linear_loss_grad
from grpo_kernels.params import GRPOParams

pytestmark = pytest.mark.usefixtures("one_thread")


class BoundsChecker:
    """Wraps the interpreter's memory ops; records accesses outside the launch's tensors."""

    def __init__(self):
        self.valid = np.empty(0, dtype=np.uint64)  # sorted element addresses of the launch
        self.accesses = 0
        self.violations = []

    def set_launch(self, args):
        addresses = [_element_addresses(a) for a in _tensors(args)]
        self.valid = np.unique(np.concatenate(addresses)) if addresses else self.valid[:0]

    def check(self, kind, ptrs, mask):
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        addr = addr.ravel()
        self.accesses += addr.size
        pos = np.clip(np.searchsorted(self.valid, addr), 0, max(self.valid.size - 1, 0))
        bad = addr[self.valid[pos] != addr] if self.valid.size else addr
        if bad.size:
            self.violations.append((kind, int(bad.size), int(bad[0])))


def _tensors(args):
    """The tensors among a launch's arguments, those inside tuple arguments (the GRPO epilogue's
    bundle) included."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensors(a)


def _element_addresses(t: torch.Tensor) -> np.ndarray:
    """Start address of every element of t (any strides), uint64."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint64)
    storage_elems = t.untyped_storage().nbytes() // t.element_size()
    index = torch.arange(storage_elems, dtype=torch.int64).as_strided(
        t.shape, t.stride(), t.storage_offset())
    base = t.untyped_storage().data_ptr()
    return (base + index.reshape(-1).numpy().astype(np.uint64) * t.element_size()).astype(
        np.uint64)


@pytest.fixture
def checker(monkeypatch):
    chk = BoundsChecker()
    builder = interpreter.InterpreterBuilder
    launch = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        chk.set_launch(list(args) + list(kwargs.values()))
        return launch(self, *args, **kwargs)

    def wrap(name, check):
        original = getattr(builder, name)

        @functools.wraps(original)
        def op(self, *args):
            check(*args)
            return original(self, *args)
        monkeypatch.setattr(builder, name, op)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)
    wrap("create_masked_load", lambda ptrs, mask, *_: chk.check("load", ptrs, mask))
    wrap("create_masked_store", lambda ptrs, value, mask, *_: chk.check("store", ptrs, mask))
    wrap("create_atomic_rmw", lambda op, ptr, val, mask, *_: chk.check("atomic", ptr, mask))
    wrap("create_atomic_cas", lambda ptr, *_: chk.check("atomic_cas", ptr, None))
    return chk


@pytest.fixture(params=[None, 75, 80, 90], ids=["small", "sm75", "sm80", "sm90"])
def arch(request, monkeypatch):
    """None: the interpreter's small tiles; else the real tiles of that GPU generation."""
    if request.param is not None:
        cc = request.param
        monkeypatch.setattr(tile_configs, "target_arch",
                            lambda device, arch=None: cc if arch is None else arch)
        monkeypatch.setattr(tile_configs, "num_splits",
                            functools.partial(tile_configs.num_splits, sms=132))
    return request.param


def sliced(x: torch.Tensor) -> torch.Tensor:
    """x as a non-contiguous view: padded on every side in a larger buffer."""
    big = torch.randn(*(s + 3 for s in x.shape), dtype=x.dtype)
    view = big[tuple(slice(1, 1 + s) for s in x.shape)]
    view.copy_(x)
    return view


def run_linear(B, T, D, V, dtype, **kw):
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", bias=True, scale=2.0)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, bias, ids)
    h, w, b = (leaf(sliced(x.to(dtype))) for x in (hidden, weight, bias))
    loss, _ = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old, ref, b, beta=0.04,
                                        entropy_coef=0.01, **kw)
    loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def run_logits(B, T, V, dtype, inplace=False, unmasked=False, **kw):
    """unmasked: every token has weight (the forward reads padding's row blocks not at all)."""
    hidden, weight, _, ids = make_head(B, T, 8, V, torch.float32, "cpu", scale=2.0)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, None, ids)
    if unmasked:
        mask = torch.ones_like(mask)
    x = leaf(sliced((hidden @ weight.T).to(dtype)))
    loss, _ = gk.grpo_loss(x, ids, adv, mask, old, ref, beta=0.04, entropy_coef=0.01,
                           inplace=inplace, **kw)
    loss.backward()


def assert_clean(chk):
    assert chk.accesses > 0, "the checker saw no access: vacuous"
    assert not chk.violations, chk.violations[:5]


DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_head_kernels_stay_in_bounds(checker, arch, dtype, monkeypatch):
    if arch is None:  # small tiles (16 x 32 x 32): several of each on small shapes
        split_shape, shape = (2, 9, 40, 70), (3, 5, 40, 50)
    else:
        if dtype == torch.float16 and arch != 90:
            pytest.skip("16-bit real tiles: sm_90's (the largest) are enough")
        # the real tiles: N = 70 tokens (two 64-token blocks or one partial 128 block), a
        # partial D step (D = 40), and 9 vocabulary tiles so the forward splits V in 2 and runs
        # the combine kernel; V not a multiple of the tile
        split_shape = (2, 35, 40, 9 * (64 if dtype == torch.float32 else 128) - 5)
        shape = (3, 5, 40, 130)
    with gk.force_backend("triton"):
        run_linear(*split_shape, dtype)  # token level: epilogue; GEMM backward
        run_linear(*shape, dtype, importance_sampling_level="sequence")
        run_linear(*shape, dtype, grad_filter=0.0)  # atomic backward, filter on
        monkeypatch.setenv("GRPO_KERNELS_LINEAR_BACKWARD", "atomic")
        run_linear(*shape, dtype)  # atomic backward, exact
    assert_clean(checker)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_kernels_stay_in_bounds(checker, arch, dtype):
    with gk.force_backend("triton"):
        run_logits(3, 7, 4100 if arch else 150, dtype)  # V past one 4096-wide chunk (real)
        run_logits(2, 5, 37, dtype, inplace=True, importance_sampling_level="sequence")
    assert_clean(checker)


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernels", "fused"])
def test_bad_target_ids_are_clamped_in_the_row_kernels(checker, arch, fused):
    """The three-pass route's row kernels (kernels/linear_loss_grad.py, both forms) with ids
    outside [0, V): no access outside the launch's tensors; the forward gives the results of the
    clamped ids, and the backward adds no one-hot term for them (an id outside [0, V) is
    another vocabulary shard's there, grpo_kernels/parallel; the caller reports a bad id)."""
    B, T, D, V = 1, 13, 24, 75
    hidden, weight, bias, ids = make_head(B, T, D, V, torch.float32, "cpu", bias=True)
    h, ids = hidden[0], ids[0]
    ids[[2, 7, 11]] = torch.tensor([-5, V, V + 1000])
    rule = GRPOParams(loss_type="dapo", beta=0.04).token_loss_args
    g = torch.Generator().manual_seed(0)
    adv, old, ref = (torch.randn(T, generator=g) for _ in range(3))
    g_ent = torch.full((T,), -0.01)

    def run(targets):
        ep = epilogue_args(rule, torch.full((T,), 1.0 / T), adv, old - 3, ref - 3, None)
        out = linear_loss_grad(h, weight, bias, targets, 0.9, ep, g_ent, chunk_rows=4,
                               fused_rows=fused)
        return [*out, *ep.outputs]

    bad = run(ids)
    assert_clean(checker)
    clamped = ids.clamp(0, V - 1)
    want = run(clamped)
    for i, (x, y) in enumerate(zip(bad, want)):
        if i not in (4, 5, 6):  # everything but the gradients: the clamped ids' results
            assert torch.equal(x, y)
    # the gradients without the clamped ids' one-hot terms: d y[n, col] = coef_n / τ there
    rows = torch.tensor([2, 7, 11])
    one_hot = torch.zeros(T, V).index_put_((rows, clamped[rows]), want[3][rows] / 0.9)
    torch.testing.assert_close(bad[4], want[4] - one_hot @ weight)
    torch.testing.assert_close(bad[5], want[5] - one_hot.T @ h)
    torch.testing.assert_close(bad[6], want[6] - one_hot.sum(0))


class OffByOne:
    """The logits forward kernel launched with V + 1: its masks admit one element past each row."""

    def __init__(self, kernel):
        self.kernel, self.v_index = kernel, kernel.arg_names.index("V")

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args = list(args)
            args[self.v_index] += 1
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_planted_off_by_one_is_caught(checker, monkeypatch):
    monkeypatch.setattr(logits_logprobs, "_logits_logprob_fwd_kernel",
                        OffByOne(logits_logprobs._logits_logprob_fwd_kernel))
    with gk.force_backend("triton"):
        run_logits(2, 3, 37, torch.float32, unmasked=True)  # the last row is read
    assert checker.violations and all(kind == "load" for kind, *_ in checker.violations)
