"""The nn.Module wrappers (grpo_kernels/modules.py): their settings are checked when the module
is built, and a hyperparameter cannot be changed by assigning an attribute that the loss would
never read."""

import copy
import dataclasses
import pickle

import pytest
import torch

import grpo_kernels as gk


@pytest.mark.parametrize("value", ["False", 1, None])
def test_grpo_loss_module_refuses_a_non_bool_inplace(value):
    # "False" is truthy: the backward would write d logits over the caller's logits
    with pytest.raises(TypeError, match="inplace must be a bool"):
        gk.GRPOLoss(inplace=value)


@pytest.mark.parametrize("cls", [gk.FusedLinearGRPOLoss, gk.GRPOLoss])
def test_assigning_a_hyperparameter_attribute_is_refused(cls):
    module = cls(beta=0.04, loss_type="grpo")
    with pytest.raises(AttributeError, match="params"):
        module.beta = 0.0  # once silently ignored: the loss kept beta = 0.04
    with pytest.raises(AttributeError, match="params"):
        module.loss_type = "dapo"
    assert module.params.beta == 0.04 and module.params.loss_type == "grpo"
    module.params = dataclasses.replace(module.params, beta=0.0)  # the way that works
    assert module.params.beta == 0.0
    module.note = "other attributes are plain attributes"
    assert module.note == "other attributes are plain attributes"


def test_modules_read_hyperparameters_and_survive_copies():
    module = gk.FusedLinearGRPOLoss(beta=0.04, epsilon_high=0.28, softcap=30.0)
    assert (module.beta, module.epsilon_high, module.loss_type) == (0.04, 0.28, "dapo")
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert other.params == module.params and other.options == module.options
        assert repr(other) == repr(module)
    B, T, D, V = 2, 3, 4, 7
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
    ref = torch.randn(B, T, generator=g) - 2.0
    loss, _ = pickle.loads(pickle.dumps(module))(hidden, weight, ids, adv, None, None, ref)
    want, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, None, None, ref, beta=0.04,
                                        epsilon_high=0.28, softcap=30.0)
    assert torch.equal(loss, want)
