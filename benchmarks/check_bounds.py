"""How far apart a cross-sequence leak and rounding are, on the inputs of the packed-row check
(`grpo_kernels.hf.check_packed_attention`: two sequences of 5 and 4 tokens, packed in one row
and run alone), per precision: the numbers behind `hf.packed_rows.agreement_atol`.

    python -m benchmarks.check_bounds --layers 24

A Qwen2.5-0.5B-shaped model with random weights (hidden 896, 14 heads, 2 KV heads, V = 151,936).
For float32 and bf16 weights it prints, relative to max(1, the largest logit):
- the rounding between two correct implementations (eager against sdpa, sequences alone);
- a packed row with a block-diagonal mask against the sequences alone (exact packing);
- a packed row whose mask lets the second sequence see the first (a leak).
On a CPU; the same command runs on a GPU (`--device cuda`).
"""

from __future__ import annotations

import argparse

import torch


def packed_row_mask(dtype, leak: bool) -> torch.Tensor:
    """[1, 1, 9, 9] additive mask of the 5 + 4 token row: causal, within each sequence unless
    `leak`."""
    allow = torch.ones(9, 9, dtype=torch.bool).tril()
    if not leak:
        seg = torch.tensor([0] * 5 + [1] * 4)
        allow &= seg[:, None] == seg[None, :]
    mask = torch.zeros(9, 9, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
    return mask[None, None]


def measure(layers: int, device: str) -> list[tuple[str, str, float]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval().to(device)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, cfg.vocab_size, (1, n), generator=g).to(device) for n in (5, 4))
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(5), torch.arange(4)])[None].to(device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        out = {}
        with torch.no_grad():
            for impl in ("eager", "sdpa"):
                model.config._attn_implementation = impl
                run = lambda **kw: model(use_cache=False, **kw).logits.float()  # noqa: E731
                out[impl] = dict(
                    alone=torch.cat([run(input_ids=x) for x in (a, b)], 1),
                    packed=run(input_ids=row, position_ids=pos,
                               attention_mask=packed_row_mask(dtype, False).to(device)),
                    leak=run(input_ids=row, position_ids=pos,
                             attention_mask=packed_row_mask(dtype, True).to(device)))
        scale = max(1.0, out["eager"]["alone"].abs().max().item())
        diff = lambda x, y, s=scale: (x - y).abs().max().item() / s  # noqa: E731
        name = str(dtype).split(".")[1]
        rows.append((name, "eager vs sdpa, alone", diff(out["eager"]["alone"],
                                                         out["sdpa"]["alone"])))
        for impl in ("eager", "sdpa"):
            rows.append((name, f"{impl}: packed vs alone", diff(out[impl]["packed"],
                                                                out[impl]["alone"])))
            rows.append((name, f"{impl}: leak vs alone", diff(out[impl]["leak"],
                                                              out[impl]["alone"])))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers must be a positive integer, got {args.layers}")
    print("| dtype | comparison | max difference / max(1, max logit) |\n|---|---|---|")
    for dtype, what, value in measure(args.layers, args.device):
        print(f"| {dtype} | {what} | {value:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
