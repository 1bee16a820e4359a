"""One of two processes (torchrun, gloo) of test_fsdp2_two_processes.py: the fused loss and
log-probs of FSDP2-sharded copies of a tiny model through `run_as_forward`, each rank on its own
batch, against the unsharded model on both ranks' batches (the gradients FSDP's reduce-scatter
averages). Roots built with reshard_after_forward=True, as accelerate's FSDP2 builds them and as
TRL shards its reference model. The route lines of the grpo_kernels logger go with the results.
Writes {case: result} to $OUT/rank{RANK}.json."""

import copy
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel"))
from mp_launch import leave_after_barrier  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, force_backend  # noqa: E402
from grpo_kernels.hf import causal_lm_grpo_loss, causal_lm_logprobs, run_as_forward  # noqa: E402
from grpo_train.tiny import build_tiny_model, build_tokenizer  # noqa: E402

B, P, T = 2, 4, 3  # sequences per micro-batch, prompt and completion lengths
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
TOKENIZER = build_tokenizer()


def batch(seed: int):
    """(ids [B, P+T], attention mask [B, P+T], advantages [B]); one padded completion token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, len(TOKENIZER), (B, P + T), generator=g)
    am = torch.ones_like(ids)
    am[1, -1] = 0
    return ids, am, torch.randn(B, generator=g)


def loss_of(seed: int):
    ids, am, adv = batch(seed)
    return lambda m: causal_lm_grpo_loss(m, ids, am, T, adv, am[:, -T:].float(),
                                         loss_fn=FusedLinearGRPOLoss(beta=0.0))[0]


def model(tied: bool, lora: bool = False):
    base = build_tiny_model(TOKENIZER, hidden_size=32, num_layers=2, tie_word_embeddings=tied,
                            seed=1)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)  # the same adapter on every rank
        base = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0, init_lora_weights=False))
    return base


def grad_error(base, sharded) -> float:
    """Largest |sharded grad - base grad| relative to the largest base grad (every rank takes
    part in each full_tensor, a collective)."""
    err, scale = 0.0, 0.0
    for p, q in zip(base.parameters(), sharded.parameters()):
        if p.grad is None:
            assert q.grad is None
            continue
        err = max(err, (q.grad.full_tensor() - p.grad).abs().max().item())
        scale = max(scale, p.grad.abs().max().item())
    return err / scale


def train_case(tied: bool, lora: bool) -> dict:
    """Two micro-batches per rank, gradient sync off for the first (FSDP's no_sync)."""
    base = model(tied, lora)
    sharded = copy.deepcopy(base)
    layers = (sharded.get_base_model() if lora else sharded).model.layers
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(sharded, reshard_after_forward=True)
    for r in range(world):
        for k in range(2):
            (loss_of(10 * r + k)(base) / world).backward()
    losses = []
    for k in range(2):
        sharded.set_requires_gradient_sync(k == 1)
        loss = run_as_forward(sharded, loss_of(10 * rank + k))
        loss.backward()
        losses.append(abs(loss.item() - loss_of(10 * rank + k)(base).item()))
    head = sharded.get_output_embeddings().weight
    return {"loss": max(losses), "grad": grad_error(base, sharded),
            "head_resharded": type(head).__name__ == "DTensor"}


def mixed_precision_case() -> dict:
    """bf16 parameters in the forward and backward, float32 gradient reduction; the error
    against the float32 model is compared with a plain bf16 copy's."""
    base = model(tied=True)
    sharded, plain = copy.deepcopy(base), copy.deepcopy(base).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in sharded.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(sharded, mp_policy=policy, reshard_after_forward=True)
    for r in range(world):
        (loss_of(r)(base) / world).backward()
        (loss_of(r)(plain) / world).backward()
    seen = []

    def loss(m):
        seen.append(str(m.get_output_embeddings().weight.dtype))
        return loss_of(rank)(m)

    run_as_forward(sharded, loss).backward()
    errors = {}
    for name, p, q, b in zip(dict(base.named_parameters()), base.parameters(),
                             sharded.parameters(), plain.parameters()):
        scale = p.grad.abs().max().item()
        errors[name] = ((q.grad.full_tensor() - p.grad).abs().max().item() / scale,
                        (b.grad.float() - p.grad).abs().max().item() / scale)
    return {"head_dtype": seen, "grad_dtype": str(sharded.lm_head.weight.grad.dtype),
            "errors": errors}


def reference_case() -> dict:
    """TRL's reference model under FSDP2: the root alone, resharded after each forward."""
    base = model(tied=True)
    ref = copy.deepcopy(base)
    fully_shard(ref, reshard_after_forward=True)
    ids, am, _ = batch(rank)
    want = causal_lm_logprobs(base, ids, am, T)
    got = run_as_forward(ref, lambda m: causal_lm_logprobs(m, ids, am, T))
    return {"logps": (got - want).abs().max().item()}


def outside_forward_case() -> dict:
    """The head of an FSDP2-sharded model passed to the loss outside the model's forward: a
    DTensor Shard(0) on the data-parallel group, whose ranks hold other batches. Refused on
    both ranks, the error naming FSDP2 and where the loss belongs."""
    from grpo_kernels import fused_linear_grpo_loss
    from grpo_kernels.parallel import VocabParallelError

    sharded = model(tied=False)
    fully_shard(sharded)
    weight = sharded.lm_head.weight  # [V / 2, D] on each rank
    D, V = weight.shape[1], weight.shape[0] * world
    g = torch.Generator().manual_seed(rank)  # another batch on each rank
    hidden = torch.randn(B, T, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    try:
        fused_linear_grpo_loss(hidden, weight, ids, torch.randn(B, generator=g))
    except VocabParallelError as exc:
        return {"error": str(exc)}
    return {"error": None}


class Routes(logging.Handler):
    """The route lines of the grpo_kernels logger (one per route and reason, per process)."""

    lines: list = []

    def emit(self, record):
        self.lines.append(record.getMessage())


logging.getLogger("grpo_kernels").addHandler(Routes())
logging.getLogger("grpo_kernels").setLevel(logging.INFO)
results = {}
with force_backend("chunked"):
    results["reference"] = reference_case()
    results["tied"] = train_case(tied=True, lora=False)
    results["untied_lora"] = train_case(tied=False, lora=True)
    results["mixed_precision"] = mixed_precision_case()
    results["outside_forward"] = outside_forward_case()
results["routes"] = [line for line in Routes.lines if " route: " in line]
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as fh:
    json.dump(results, fh)
leave_after_barrier()
