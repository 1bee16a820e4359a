"""The linear-map probe's verdict is kept between calls (hf/head_probe.py): a head whose forward
is its own runs the probe once over repeated calls, and again, with the new verdict, after each
change that can alter it (a tensor changed in place or replaced, a forward replaced, a dtype,
the training flag, an attribute, a hook); a write the key cannot see is caught within
REPROBE_AFTER calls; a kept verdict does not keep its module alive."""

import gc
import weakref

import pytest
import torch
from torch import nn

from grpo_kernels.hf import head_probe
from grpo_kernels.hf.head_adapters import resolve_head

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, D = 12, 8
PROBES: list = []  # one entry per forward on the probe's fixed input (any head below)


def _seen(x):
    if x.shape[:-1] in ((1, 2), (2,)):
        PROBES.append(tuple(x.shape))


class Head(nn.Module):
    """An output embedding that is not an nn.Linear: x·Wᵀ (+ b unless `use_bias` is False),
    times `scale` (a plain attribute)."""

    def __init__(self, bias: bool = True, use_bias: bool = True, scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(V, D, generator=g))
        self.bias = nn.Parameter(torch.zeros(V)) if bias else None
        self.use_bias, self.scale = use_bias, scale

    def forward(self, x):
        _seen(x)
        out = nn.functional.linear(x, self.weight, self.bias if self.use_bias else None)
        return out * self.scale


class ScaledHead(Head):
    """A head with a tensor of its own besides weight and bias (a learned scale, or a buffer)."""

    def __init__(self, as_buffer: bool = False):
        super().__init__()
        if as_buffer:
            self.register_buffer("gain", torch.ones(()))
        else:
            self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.gain


class Float32Linear(nn.Linear):
    """An nn.Linear with a forward of its own that runs in float32 only."""

    def forward(self, x):
        _seen(x)
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return super().forward(x)


class DropoutHead(Head):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return super().forward(self.drop(x))


@pytest.fixture(autouse=True)
def fresh():
    PROBES.clear()
    head_probe.clear_probe_cache()
    yield
    head_probe.clear_probe_cache()


def refused(head) -> bool:
    try:
        resolve_head(head, "m.lm_head")
    except NotImplementedError:
        return True
    return False


@pytest.mark.parametrize("make", [Head, lambda: Float32Linear(D, V)], ids=["module", "linear"])
def test_an_unchanged_head_is_probed_once(make):
    head = make()
    for _ in range(5):
        assert resolve_head(head, "m.lm_head").weight is head.weight
    assert len(PROBES) == 1


def test_a_scale_parameter_changed_in_place_is_seen():
    head = ScaledHead()
    assert not refused(head)
    with torch.no_grad():
        head.gain.fill_(2.0)
    assert refused(head)


def test_a_scale_changed_through_data_is_seen():
    """.data writes (and fused optimizer steps) leave the version counter: a head with a tensor
    of its own besides weight and bias is probed on every call."""
    head = ScaledHead()
    assert not refused(head)
    head.gain.data.fill_(2.0)
    assert refused(head)


def test_a_buffer_changed_is_seen():
    head = ScaledHead(as_buffer=True)
    assert not refused(head)
    head.gain.fill_(2.0)
    assert refused(head)


def test_a_replaced_parameter_is_seen():
    """The new bias has the old one's shape, dtype and version: only its identity differs."""
    head = Head(use_bias=False)  # its forward drops the bias, which is zero so far
    assert not refused(head)
    head.bias = nn.Parameter(torch.ones(V))
    assert head.bias._version == 0
    assert refused(head)


def test_a_tensor_changed_in_place_is_probed_again():
    head = Head(use_bias=False)
    assert not refused(head) and not refused(head)
    with torch.no_grad():
        head.bias.add_(1.0)  # what an optimizer step does: the version counter moves
    assert refused(head)


def test_a_forward_replaced_on_the_instance_is_seen():
    head = Head()
    assert not refused(head)
    head.forward = lambda x: nn.functional.linear(x, head.weight, head.bias)
    assert not refused(head)
    head.forward = lambda x: nn.functional.linear(x, head.weight, head.bias) * 2
    assert refused(head)
    del head.forward
    assert not refused(head)


def test_a_class_forward_replaced_is_seen(monkeypatch):
    head = Head()
    assert not refused(head)
    monkeypatch.setattr(Head, "forward", lambda self, x: nn.functional.linear(x, self.weight) * 3)
    assert refused(head)


def test_a_dtype_change_is_seen():
    head = Float32Linear(D, V)
    assert not refused(head)
    head.to(torch.bfloat16)  # same parameters, same versions
    with pytest.raises(NotImplementedError, match=r"fails on \[2, in_features\] \(float32 only"):
        resolve_head(head, "m.lm_head")


def test_the_training_flag_is_seen():
    head = DropoutHead().eval()
    assert not refused(head)
    assert refused(head.train())


def test_a_plain_attribute_change_is_seen():
    head = Head()
    assert not refused(head)
    head.scale = 2.0
    assert refused(head)


def test_a_forward_hook_is_seen():
    head = Head()
    assert not refused(head)
    handle = head.register_forward_hook(lambda m, args, out: out * 2)
    assert refused(head)
    handle.remove()
    assert not refused(head)


def test_a_write_the_key_cannot_see_is_caught_within_reprobe_after(monkeypatch):
    monkeypatch.setattr(head_probe, "REPROBE_AFTER", 3)
    head = Head(use_bias=False)
    assert not refused(head)
    head.bias.data.fill_(1.0)  # no version bump
    verdicts = [refused(head) for _ in range(4)]
    assert verdicts[-1] and len(PROBES) == 2


def test_a_kept_verdict_does_not_keep_the_head_alive():
    head = Head()
    head.forward = head.forward  # a bound method on the instance: a reference cycle
    assert not refused(head)
    alive = weakref.ref(head)
    del head
    gc.collect()
    assert alive() is None and len(head_probe._VERDICTS) == 0


def test_a_head_with_an_equality_of_its_own_is_probed_every_call():
    """Such a class has no identity hash (or a hash by value): nothing is kept for it."""

    class EqHead(Head):
        def __eq__(self, other):
            return isinstance(other, EqHead)

    head = EqHead()
    assert not refused(head) and not refused(head)
    assert len(PROBES) == 2


def test_a_verdict_under_a_dispatch_mode_is_not_kept():
    """Under FakeTensorMode the probe's comparison cannot run (its verdict: a failing
    forward); outside it the same unchanged head is a linear map."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    head = Float32Linear(D, V)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert refused(head)
    assert not refused(head)
