"""LoRA on the output head, trained through grpo-kernels' fused GRPO loss.

    python examples/lora_head.py          # CPU, a few seconds, no downloads

A tiny random Qwen2 (built from a config, untied head) gets a PEFT LoRA adapter on every linear
layer *and on lm_head* (`grpo_kernels.hf.head_adapters.add_lora`). The fused loss folds the head's
adapter into one linear call (hidden' = [h, s·h·Aᵀ], weight' = [W, B]): no [B, T, V] logits and
no merged [V, D] weight. The script

1. checks that the fused log-probs equal those of the wrapped model's own logits,
2. takes a few GRPO steps on fixed completions with made-up advantages,
3. shows that the head's LoRA factors trained (a PEFT-unaware fused loss would leave them
   untouched) while the frozen base head did not move.
"""

from __future__ import annotations

import time

import torch

from grpo_kernels import FusedLinearGRPOLoss, reference
from grpo_kernels.hf import causal_lm_grpo_loss, causal_lm_logprobs
from grpo_kernels.hf.head_adapters import add_lora
from grpo_train.flags import Parser  # the flag convention of grpo-train and the benchmarks
from grpo_train.tiny import build_tiny_model, build_tokenizer

B, P, T = 8, 6, 5  # sequences, prompt length, completion length
STEPS = 5


def parse_args(argv: list[str] | None = None):
    """No options: --help describes the example, and any other argument is an error."""
    parser = Parser("examples/lora_head.py", description=__doc__.splitlines()[0])
    return parser.parse_args(argv)


def main() -> None:
    parse_args()
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    base = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, tie_word_embeddings=False)
    model = add_lora(base, r=8, alpha=16, init_lora_weights=False)  # random B: visible at once
    model.print_trainable_parameters()
    head = model.get_base_model().lm_head
    lora_a, lora_b = head.lora_A["default"].weight, head.lora_B["default"].weight
    start_b, start_w = lora_b.detach().clone(), head.base_layer.weight.detach().clone()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(8, len(tokenizer), (B, P + T), generator=g)
    attention_mask = torch.ones_like(ids)
    attention_mask[1::2, -2:] = 0  # every other completion is 2 tokens shorter
    completion_mask = attention_mask[:, -T:].float()
    advantages = torch.randn(B, generator=g)

    # 1. the fused log-probs are the wrapped model's own (adapter included)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=T + 1).logits
        want = reference.logprobs_from_logits(logits[:, :-1], ids[:, -T:])
        got = causal_lm_logprobs(model, ids, attention_mask, T)
    err = (got - want).abs().max().item()
    print(f"log-probs vs the model's own logits: max |diff| = {err:.2e}")
    assert err < 1e-4, err

    # 2. a few GRPO steps (old log-probs = the first step's, so later steps clip)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss_fn = FusedLinearGRPOLoss(loss_type="dapo", beta=0.0, epsilon_high=0.28)
    old = got
    t0 = time.perf_counter()
    for step in range(STEPS):
        loss, metrics = causal_lm_grpo_loss(model, ids, attention_mask, T, advantages,
                                            completion_mask, old_logps=old, loss_fn=loss_fn)
        loss.backward()
        print(f"step {step}: loss {loss.item():+.4f}  |grad lm_head.lora_A| "
              f"{lora_a.grad.norm().item():.3e}  clip {metrics['clip_ratio/region_mean']:.2f}")
        opt.step()
        opt.zero_grad(set_to_none=True)

    # 3. the head's adapter moved; its frozen base weight did not
    moved = (lora_b.detach() - start_b).abs().max().item()
    frozen = (head.base_layer.weight - start_w).abs().max().item()
    print(f"lm_head.lora_B moved by {moved:.3e}; lm_head base weight moved by {frozen:.1e}")
    assert moved > 0 and frozen == 0
    print(f"done: {STEPS} steps in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
