"""GRPO on a Hugging Face causal LM in plain PyTorch, with grpo-kernels' fused loss.

    python examples/hf_plain_pytorch.py          # CPU, a few seconds, no downloads

A tiny random Qwen2 model and a character-level tokenizer are built locally (grpo_train.tiny).
Each step samples a group of completions per prompt, scores them with a toy reward, normalizes
the rewards within each group, and then takes `NUM_ITERATIONS` optimizer steps on that batch:

- reference log-probs (KL penalty) and old log-probs (importance ratios for the steps after the
  first) are scored with `causal_lm_logprobs`: no grad, no logits;
- the loss is `causal_lm_grpo_loss`: the model body runs on prompt+completion, only the hidden
  states of the completion positions meet the lm_head weight, inside the fused kernel.
"""

from __future__ import annotations

import copy
import time

import torch
import transformers

from grpo_kernels import FusedLinearGRPOLoss
from grpo_kernels.hf import causal_lm_grpo_loss, causal_lm_logprobs
from grpo_train.flags import Parser  # the flag convention of grpo-train and the benchmarks
from grpo_train.tiny import build_tiny_model, build_tokenizer

PROMPTS = ["12+30", "7+5", "40+2", "3+3"]
NUM_GENERATIONS = 4  # G: completions per prompt
MAX_NEW_TOKENS = 6
STEPS = 4
NUM_ITERATIONS = 2  # optimizer steps per generated batch (old log-probs matter from the 2nd)


def reward(prompt: str, completion: str) -> float:
    """1 for the right sum, else a little for every digit (a toy shaping signal)."""
    a, b = (int(x) for x in prompt.split("+"))
    if completion.strip() == str(a + b):
        return 1.0
    return 0.1 * sum(ch.isdigit() for ch in completion)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """[P·G] rewards -> [P·G] advantages: (r - group mean) / (group std + 1e-4)."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


@torch.no_grad()
def sample(model, tokenizer, prompts):
    """Prompt+completion ids [B, L] (prompts left-padded), attention mask [B, L], completion
    length T, completion mask [B, T] (real tokens up to and including the first EOS)."""
    chats = [[{"role": "user", "content": p}] for p in prompts for _ in range(NUM_GENERATIONS)]
    enc = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**enc, do_sample=True, max_new_tokens=MAX_NEW_TOKENS,
                         pad_token_id=tokenizer.pad_token_id)
    P = enc["input_ids"].shape[1]
    completion = out[:, P:]  # [B, T]
    is_eos = completion == tokenizer.eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    completion_mask = (torch.arange(completion.shape[1]) <= first_eos[:, None]).long()
    attention_mask = torch.cat([enc["attention_mask"], completion_mask], dim=1)
    texts = tokenizer.batch_decode(completion * completion_mask, skip_special_tokens=True)
    return out, attention_mask, completion.shape[1], completion_mask, texts


def parse_args(argv: list[str] | None = None):
    """No options: --help describes the example, and any other argument is an error."""
    parser = Parser("examples/hf_plain_pytorch.py", description=__doc__.splitlines()[0])
    return parser.parse_args(argv)


def main() -> None:
    parse_args()
    # only this script's lines: no transformers logging (generation notices) or progress bars
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # frozen reference policy
    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo", epsilon_high=0.28)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(STEPS):
        model.eval()
        ids, attention_mask, T, completion_mask, texts = sample(model, tokenizer, PROMPTS)
        prompts = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)]
        rewards = torch.tensor([reward(p, c) for p, c in zip(prompts, texts)])
        advantages = group_advantages(rewards, NUM_GENERATIONS)  # [B]
        # no-grad scoring without logits; old log-probs = the policy that sampled the batch
        ref_logps = causal_lm_logprobs(ref_model, ids, attention_mask, T)  # [B, T] float32
        old_logps = causal_lm_logprobs(model, ids, attention_mask, T)
        model.train()
        for _ in range(NUM_ITERATIONS):
            loss, metrics = causal_lm_grpo_loss(
                model, ids, attention_mask, T, advantages, completion_mask,
                old_logps=old_logps, ref_logps=ref_logps, loss_fn=loss_fn,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"step {step}: loss {loss.item():+.4f}  reward {rewards.mean():.3f}  "
              f"kl {metrics['kl'].item():.5f}  entropy {metrics['entropy'].item():.3f}  "
              f"clip {metrics['clip_ratio/region_mean'].item():.3f}  "
              f"sample {texts[0]!r}")
    print(f"done: {STEPS} steps in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
