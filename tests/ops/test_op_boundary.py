"""The token-terms operators take only what the per-token loss reads (`params.TokenLossArgs`),
the temperature as an argument of their own, and a public call builds GRPOParams once: the op
never rebuilds it."""

import dataclasses

import pytest
import torch
from helpers import make_grpo_batch, make_head

import grpo_kernels as gk
from grpo_kernels import params as params_mod
from grpo_kernels.ops.custom_ops import OPS
from grpo_kernels.params import GRPOParams, TokenLossArgs

pytestmark = pytest.mark.usefixtures("one_thread")
TOKEN_FIELDS = [f.name for f in dataclasses.fields(TokenLossArgs)]


@pytest.mark.parametrize("op", ["linear_grpo_terms", "logits_grpo_terms"])
def test_op_schema_holds_the_token_loss_args_and_nothing_else_of_grpo_params(op):
    names = [a.name for a in getattr(OPS, op).default._schema.arguments]
    start = names.index("importance_sampling_ratio") + 1
    assert names[start:start + len(TOKEN_FIELDS)] == TOKEN_FIELDS
    assert names[start + len(TOKEN_FIELDS):] == ["softcap", "logit_scale"]
    assert names.count("temperature") == 1 and names.index("temperature") < start
    # what only the aggregation or the per-sequence route reads stays out of the kernel's call
    for field in ("entropy_coef", "max_completion_length", "vespo_k_pos", "top_entropy_quantile",
                  "off_policy_mask_threshold", "importance_sampling_level"):
        assert field not in names


def test_token_loss_args_resolve_epsilon_high_and_refuse_per_sequence_types():
    args = GRPOParams(epsilon_low=0.2, beta=0.04, loss_type="sapo").token_loss_args
    assert args.epsilon_high == 0.2 and args.clip_range == (0.8, 1.2)
    assert TokenLossArgs.of_op_args(args.to_op_args()) == args
    for loss_type in ("vespo", "gmpo"):
        with pytest.raises(ValueError, match="no per-token epilogue"):
            _ = GRPOParams(loss_type=loss_type).token_loss_args


@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_one_public_call_builds_grpo_params_once(backend, monkeypatch):
    built = []
    original = params_mod.GRPOParams.__post_init__

    def counting(self):
        built.append(self.loss_type)
        original(self)

    monkeypatch.setattr(params_mod.GRPOParams, "__post_init__", counting)
    hidden, weight, bias, ids = make_head(2, 5, 8, 24, torch.float32, "cpu", seed=3)
    mask, adv, old, ref = make_grpo_batch(hidden, weight, bias, ids, seed=3)
    hidden.requires_grad_(True)
    with gk.force_backend(backend):
        loss, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old, ref, beta=0.04,
                                            loss_type="dapo", temperature=0.9)
        loss.backward()
    assert built == ["dapo"]
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
