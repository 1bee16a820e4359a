"""Generation throughput of the trainer's two paths on the same prompts and the same completion
lengths: "padded" (`model.generate` on the left-padded batch) and "continuous" (transformers'
continuous batching), as `grpo_train.generation.generate` runs them.

    python -m benchmarks.generation                          # every workload, 1 and 2 threads
    python -m benchmarks.generation --workloads medium --threads 2 --repeats 5

Completion lengths are drawn per sequence and forced with `grpo_train.generation.forced_lengths`
(EOS exactly at the drawn length, never before), so both paths produce the same number of tokens
on random-weight models. "tail" lengths are long-tailed: round(exp(N(ln(max_new / 8), 1))),
clipped to [1, max_new + 1] (max_new + 1 = truncated at max_new); "full" = every sequence runs
to max_new (nothing for continuous batching to skip). Workloads (B = prompts x 8 completions):

    embedded      the embedded tiny model (hidden 64, 2 layers), B = 128, max_new 64, tail
    default-run   the embedded model at the default run's shape: B = 512, max_new 3, tail
    medium        random Qwen2, hidden 256, 4 layers, vocab 4096, B = 64, max_new 128, tail
    medium-full   the same, full lengths
    large         random Qwen2, hidden 512, 8 layers, vocab 4096, B = 64, max_new 256, tail

Per workload, thread count and path: one untimed call, then --repeats timed calls (the same
prompts and lengths each time); reported: median seconds, completion tokens per second and the
continuous / padded speedup. The header gives machine, date, load average and command.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import random
import shlex
import statistics
import sys
import time

import torch

from grpo_train.flags import Parser, run_cli

from . import cpu_model, git_commit

G = 8
WORKLOADS = {  # name: (model, prompts, max_new_tokens, lengths)
    "embedded": ("embedded", 16, 64, "tail"),
    "default-run": ("embedded", 64, 3, "tail"),
    "medium": ((256, 4), 8, 128, "tail"),
    "medium-full": ((256, 4), 8, 128, "full"),
    "large": ((512, 8), 8, 256, "tail"),
}


def build(model_spec, prompts: int, max_new: int):
    """(model, tokenizer, examples, cfg) for a workload, random weights, seed 0."""
    from grpo_train.config import TrainConfig, resolve_auto
    from grpo_train.data import load_examples
    from grpo_train.models import build_embedded, prepare_tokenizer

    cfg = resolve_auto(TrainConfig(max_new_tokens=max_new, num_generations=G))
    examples = load_examples(cfg)[0][:prompts]  # the embedded task's prompts ("1+0+2+2+1=")
    if model_spec == "embedded":
        model, tok = build_embedded(cfg)
        return model, tok, examples, cfg
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train.tiny import build_tokenizer

    hidden, layers = model_spec
    tok = build_tokenizer(vocab_size=4096)
    config = Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    return model, prepare_tokenizer(tok, model), examples, cfg


def draw_lengths(kind: str, B: int, max_new: int) -> list[int]:
    rng = random.Random(1)
    if kind == "full":
        return [max_new] * B
    return [min(max_new + 1, max(1, round(math.exp(rng.gauss(math.log(max_new / 8), 1.0)))))
            for _ in range(B)]


def time_path(model, tok, examples, cfg, path: str, lengths: list[int], repeats: int):
    """(median seconds, completion tokens) of `generate` on one path."""
    from grpo_train.generation import GenerationSetup, forced_lengths, generate
    from grpo_train.models import eos_token_ids

    ctx = GenerationSetup(cfg=dataclasses.replace(cfg, generation=path), tokenizer=tok,
                          eos_ids=eos_token_ids(model, tok),
                          say=lambda msg: print(f"  {msg}", flush=True))
    times, tokens = [], 0
    with forced_lengths(lambda B: lengths):
        for i in range(repeats + 1):  # the first call is not timed
            torch.manual_seed(i)
            t0 = time.perf_counter()
            batch = generate(model, examples, ctx)
            if i:
                times.append(time.perf_counter() - t0)
            tokens = int(batch["lengths"].sum())
    return statistics.median(times), tokens


def main(argv: list[str] | None = None) -> int:
    parser = Parser("python -m benchmarks.generation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--threads", default="1,2", help="torch CPU thread counts to run")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per path")
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    command = "python -m benchmarks.generation " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv)
    print(f"# {cpu_model()}, {os.cpu_count()} cores | {dt.date.today()} | commit {git_commit()}"
          f" | torch {torch.__version__}\n# {command}")
    print(f"{'workload':<12} {'threads':>7} {'path':<10} {'seconds':>8} {'tokens':>7} "
          f"{'tokens/s':>9} {'speedup':>8} {'load avg':>15}")
    for name in names:
        spec, prompts, max_new, kind = WORKLOADS[name]
        model, tok, examples, cfg = build(spec, prompts, max_new)
        lengths = draw_lengths(kind, prompts * G, max_new)
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            padded_s = None
            for path in ("padded", "continuous"):
                seconds, tokens = time_path(model, tok, examples, cfg, path, lengths,
                                            args.repeats)
                padded_s = seconds if path == "padded" else padded_s
                speedup = f"{padded_s / seconds:.2f}x" if path == "continuous" else ""
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                print(f"{name:<12} {threads:>7} {path:<10} {seconds:>8.3f} {tokens:>7} "
                      f"{tokens / seconds:>9.0f} {speedup:>8} {load:>15}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m benchmarks.generation", main))
