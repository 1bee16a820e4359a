"""One of two processes (torchrun, gloo) of test_trl_padding_free.py's FSDP2 test: our trainer's
packed scoring and packed loss on an FSDP2-sharded copy of the policy, against the padded ones
on the full model. The ranks' batches pack into different numbers of rows and scoring forwards,
so the sharded forwards (collectives) must still pair up across processes. Writes its
differences to $GRPO_TEST_DIR/rank{RANK}.json."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from trl_harness import T, make_batch, make_trainer  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402

warnings.simplefilter("ignore")
torch.set_num_threads(1)
model_dir, out = sys.argv[1], os.environ["GRPO_TEST_DIR"]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
padded = make_trainer(GRPOTrainer, model_dir, padding_free=False, loss_type="dapo", beta=0.04)
packed = make_trainer(GRPOTrainer, model_dir, loss_type="dapo", beta=0.04)
assert dist.is_initialized() and packed.accelerator.num_processes == world
# the same weights (both loaded from model_dir); shard the packed trainer's model in place, as
# accelerate's FSDP2 does after the trainer has checked the model at construction
full, sharded = padded.model, packed.model
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded)
# rank 0: short completions (few rows, one scoring forward); rank 1: long ones (more of both)
lengths = (2, 1, 3, 1) if rank == 0 else (7, 7, 6, 7)
batch = make_batch(padded, seed=rank, lengths=lengths)
ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).repeat(4, 1)
am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).repeat(4, 1)
result = {}
with force_backend("chunked"), torch.no_grad():
    want, want_ent, _ = padded._get_per_token_logps_and_entropies(full, ids, am, T, batch_size=2,
                                                                compute_entropy=True)
    got, got_ent, _ = packed._get_per_token_logps_and_entropies(sharded, ids, am, T,
                                                              batch_size=2, compute_entropy=True)
result["scoring"] = max((got - want).abs().max().item(), (got_ent - want_ent).abs().max().item())
for tr in (padded, packed):
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
with force_backend("chunked"):
    loss_want = padded._compute_loss(full, batch)
    loss_want.backward()
    loss_got = packed._compute_loss(sharded, batch)
    loss_got.backward()
result["loss"] = abs(loss_got.item() - loss_want.item())
result["loss_value"] = loss_want.item()
grad_diff, grad_scale = 0.0, 0.0
for p, q in zip(full.parameters(), sharded.parameters()):
    g = p.grad.clone()
    dist.all_reduce(g)  # FSDP reduce-scatters the mean over processes
    g /= world
    grad_diff = max(grad_diff, (q.grad.full_tensor() - g).abs().max().item())
    grad_scale = max(grad_scale, g.abs().max().item())
result.update(grad=grad_diff, grad_scale=grad_scale,
              head_sharded=type(sharded.lm_head.weight).__name__ == "DTensor")
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(result, fh)
# every rank past its last collective before any rank tears its connections down: gloo sends
# asynchronously, and a peer that closes its pairs while the other's last send is in flight can
# abort the process ("terminate called without an active exception"). Even after the barrier,
# under load, a rank aborted in gloo's teardown with its results written (CI, 2 cores): the
# process leaves without running destructors once every rank is past the barrier.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
