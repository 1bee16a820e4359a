"""Positions a trainer step computes, padded against packed: a count that needs no hardware.

For one group of G completions of a P-token prompt, with the lengths `benchmarks.lengths` draws
(the same draws trainer_step forces), it counts
    body      positions one forward of the model body computes (scoring and the loss forward
              each run it once over the group): padded G·(P + longest completion); packed R·W,
              the rows `grpo_kernels.hf.choose_row_width` chooses for the model's attention
    head      positions the fused output head runs on: padded (TRL's [B, T] grid) G·longest;
              packed the N kept completion tokens
    real      prompt and completion tokens, G·P + N (what no layout can go below)

    python -m benchmarks.positions                       # the three profiles below, sdpa
    python -m benchmarks.positions --attn eager --num_generations 16

Profiles: (a) long-tailed, G = 8; (b) long-tailed, G = 16; (c) every completion at the cap.
"""

from __future__ import annotations

import argparse

from benchmarks.lengths import draw_lengths

PROFILES = {"a": ("lognormal", 8), "b": ("lognormal", 16), "c": ("fixed", 8)}


def count(profile: str, G: int, cap: int, prompt: int, config, draw: int = 0) -> dict:
    """The counts of the module docstring for draw number `draw` of `profile`."""
    from grpo_kernels.hf.row_width import choose_row_width, first_fit

    completions = draw_lengths(profile, G, cap, seed=0, call=draw)
    lengths = [prompt + n for n in completions]
    width = choose_row_width(lengths, config)
    rows = len(first_fit(lengths, width)[2])
    longest = max(completions)
    return {"profile": profile, "G": G, "real": sum(lengths),
            "body_padded": G * (prompt + longest), "body_packed": rows * width,
            "rows": rows, "width": width,
            "head_padded": G * longest, "head_packed": sum(completions)}


def qwen_config(attn: str):
    from transformers import Qwen2Config

    from benchmarks.trainer_step import QWEN25_05B

    config = Qwen2Config(**QWEN25_05B)
    config._attn_implementation = attn
    return config


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser("python -m benchmarks.positions", description=__doc__)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--draws", type=int, default=1, help="draws per profile (0, 1, ...)")
    args = parser.parse_args(argv)
    config = qwen_config(args.attn)
    out = []
    print("| profile | G | draw | real | body padded | body packed (rows × W) | packed/padded "
          "| packed/real | head padded | head packed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (profile, G) in PROFILES.items():
        for draw in range(args.draws):
            c = count(profile, G, args.cap, args.prompt_tokens, config, draw)
            out.append(c)
            print(f"| ({name}) {profile} | {G} | {draw} | {c['real']:,} | {c['body_padded']:,} | "
                  f"{c['body_packed']:,} ({c['rows']} × {c['width']}) | "
                  f"{c['body_packed'] / c['body_padded']:.2f} | "
                  f"{c['body_packed'] / c['real']:.2f} | {c['head_padded']:,} | "
                  f"{c['head_packed']:,} |")
    return out


if __name__ == "__main__":
    main()
