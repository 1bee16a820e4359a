"""GRPO on a tensor-parallel Hugging Face model: the output head split along the vocabulary, the
fused loss on each rank's shard, no rank ever holding [tokens x vocabulary] logits.

    torchrun --nproc_per_node 2 examples/tensor_parallel.py     # CPU (gloo), no downloads

The main process writes a tiny random Qwen2 model (grpo_train.tiny) to a temporary directory;
every process loads it with transformers' tensor-parallel plan (`DistributedConfig(tp_size=N)`,
what `from_pretrained(..., tp_plan="auto")` does), so `lm_head.weight` is a DTensor with Shard(0):
each rank holds V/N rows. The steps are those of examples/hf_plain_pytorch.py:

- every rank samples the same completions (same seed; transformers' head gathers the logits for
  sampling, the one place that needs them);
- reference and old log-probs come from `causal_lm_logprobs`, the loss from
  `causal_lm_grpo_loss`: both take the DTensor head as it is (grpo_kernels.parallel). Each rank
  computes its shard's log-sum-exp, entropy and target logit, one all-gather combines them, and
  the backward all-reduces the hidden states' gradient; the model's own (gathering) head does
  not run for them, which the script counts (it runs once per model, on one position, when the
  helpers check that the hidden-state path reproduces the model's logits).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import transformers

from grpo_kernels import FusedLinearGRPOLoss
from grpo_kernels.hf import causal_lm_grpo_loss, causal_lm_logprobs, check_output_head

PROMPTS = ["12+30", "7+5", "40+2", "3+3"]
NUM_GENERATIONS = 4  # G: completions per prompt
MAX_NEW_TOKENS = 6
STEPS = 4
NUM_ITERATIONS = 2


def reward(prompt: str, completion: str) -> float:
    """1 for the right sum, else a little for every digit (a toy shaping signal)."""
    a, b = (int(x) for x in prompt.split("+"))
    if completion.strip() == str(a + b):
        return 1.0
    return 0.1 * sum(ch.isdigit() for ch in completion)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)


@torch.no_grad()
def sample(model, tokenizer, prompts):
    """Prompt+completion ids [B, L], attention mask [B, L], completion length T, completion mask
    [B, T], completion texts; the same on every rank (same seed, same gathered logits)."""
    chats = [[{"role": "user", "content": p}] for p in prompts for _ in range(NUM_GENERATIONS)]
    enc = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**enc, do_sample=True, max_new_tokens=MAX_NEW_TOKENS,
                         pad_token_id=tokenizer.pad_token_id)
    P = enc["input_ids"].shape[1]
    completion = out[:, P:]
    is_eos = completion == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    completion_mask = (torch.arange(completion.shape[1]) <= first_eos[:, None]).long()
    attention_mask = torch.cat([enc["attention_mask"], completion_mask], dim=1)
    texts = tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
    return out, attention_mask, completion.shape[1], completion_mask, texts


def load(directory: str, world: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed.configuration_utils import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(tp_size=world))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    return model, tokenizer


def main() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.simplefilter("ignore")
    if "RANK" not in os.environ:  # started as a plain script: no process group to join
        raise SystemExit("run this example under torchrun, e.g. "
                         "`torchrun --nproc_per_node 2 examples/tensor_parallel.py`")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        path = [os.path.join(scratch, "tiny")]
        if rank == 0:
            from grpo_train.tiny import save_tiny_model

            save_tiny_model(path[0])
        dist.broadcast_object_list(path)  # rank 0's directory, written before anyone reads it
        model, tokenizer = load(path[0], world)
        ref_model = load(path[0], world)[0].eval().requires_grad_(False)
        dist.barrier()  # every rank has loaded before rank 0 removes the directory
    head = model.lm_head.weight
    say = print if rank == 0 else (lambda *_: None)
    say(f"lm_head.weight: {type(head).__name__} {head.placements}, this rank's rows "
        f"{tuple(head.to_local().shape)} of {tuple(head.shape)}")
    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo", epsilon_high=0.28)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    check_output_head(model)  # once per model: its own forward on one position
    head_calls = []  # the model's own head: gathers [B, T, V] logits on every rank
    model.lm_head.register_forward_pre_hook(lambda *_: head_calls.append(1))
    torch.manual_seed(0)  # the same seed on every rank: the same completions
    start = time.perf_counter()
    for step in range(STEPS):
        model.eval()
        ids, attention_mask, T, completion_mask, texts = sample(model, tokenizer, PROMPTS)
        sampling_calls = len(head_calls)
        prompts = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)]
        advantages = group_advantages(
            torch.tensor([reward(p, c) for p, c in zip(prompts, texts)]), NUM_GENERATIONS)
        ref_logps = causal_lm_logprobs(ref_model, ids, attention_mask, T)
        old_logps = causal_lm_logprobs(model, ids, attention_mask, T)
        model.train()
        for _ in range(NUM_ITERATIONS):
            loss, metrics = causal_lm_grpo_loss(
                model, ids, attention_mask, T, advantages, completion_mask,
                old_logps=old_logps, ref_logps=ref_logps, loss_fn=loss_fn)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        fused_calls = len(head_calls) - sampling_calls
        say(f"step {step}: loss {loss.item():+.4f}  kl {metrics['kl'].item():.5f}  "
            f"entropy {metrics['entropy'].item():.3f}  gathering-head calls in scoring and "
            f"loss: {fused_calls}  sample {texts[0]!r}")
    say(f"done: {STEPS} steps on {world} ranks in {time.perf_counter() - start:.1f}s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
