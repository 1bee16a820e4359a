"""Bad input of the logits calls, the reference twins and the loss's function options gets a
clear error naming the argument (the tensor and hyperparameter cases: test_validation.py)."""

import pytest
import torch
from helpers import make_head

import grpo_kernels as gk
from grpo_kernels import reference

B, T, D, V = 2, 5, 8, 21


def test_reference_logprobs_from_logits_checks_the_temperature():
    """The reference twin refuses what `logprobs_from_logits` refuses (it returned NaN)."""
    logits, ids = torch.randn(2, V), torch.zeros(2, dtype=torch.long)
    for bad in (0.0, -1.0, 1e-300):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            reference.logprobs_from_logits(logits, ids, temperature=bad)


@pytest.mark.parametrize("loss", ["fused_linear_grpo_loss", "grpo_loss"])
def test_an_entropy_gather_that_is_not_a_function_is_refused(loss):
    """It failed where the entropy quantile called it ("'int' object is not callable")."""
    hidden, weight, _, ids = make_head(B, T, D, V, torch.float32, "cpu")
    adv = torch.randn(B)
    first = (hidden, weight) if loss == "fused_linear_grpo_loss" else (hidden @ weight.T,)
    with pytest.raises(TypeError, match="entropy_gather must be None or a function"):
        getattr(gk, loss)(*first, ids, adv, top_entropy_quantile=0.5, entropy_gather=3)


LOGITS_CALLS = {  # the logits-input entry points (they take no hidden): (call, ids' name)
    "grpo_loss": (lambda lg, ids: gk.grpo_loss(lg, ids, torch.randn(B)), "completion_ids"),
    "logprobs_from_logits": (gk.logprobs_from_logits, "targets"),
    "reference.grpo_loss": (lambda lg, ids: reference.grpo_loss(lg, ids, torch.randn(B)),
                            "completion_ids"),
    "reference.logprobs_from_logits": (reference.logprobs_from_logits, "targets"),
}


@pytest.mark.parametrize("call, name", LOGITS_CALLS.values(), ids=LOGITS_CALLS.keys())
def test_token_id_errors_of_the_logits_calls_name_logits(call, name):
    """The ids' device and shape errors named hidden, which these calls do not take."""
    logits, ids = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    with pytest.raises(ValueError, match=f"{name} is on meta but logits is on cpu"):
        call(logits, ids.to("meta"))
    with pytest.raises(ValueError, match=rf"{name} must have shape \(2, 5\) \(logits.shape"):
        call(logits, ids[:, :3])


def test_reference_logprobs_from_logits_checks_its_targets():
    """A gather took targets of another shape ([2, 3] out) and failed inside on an id >= V."""
    logits, ids = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    with pytest.raises(ValueError, match="targets must have shape"):
        reference.logprobs_from_logits(logits, ids[:, :3])
    with pytest.raises(ValueError, match=f"targets has token id {V} outside"):
        reference.logprobs_from_logits(logits, ids.index_fill(1, torch.tensor([0]), V))
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        reference.logprobs_from_logits(logits, ids.float())
