"""Generation time of the trainer's paths on the same prompts and the same completion lengths,
as `grpo_train.generation.generate` runs them: "per-row" (`model.generate` on the left-padded
batch, every row prefilling its own copy of its prompt, transformers' dynamic cache: the call
TRL 1.16's GRPOTrainer makes by default), "padded" (the same, each prompt's prefill computed
once and its KV cache repeated G times: the padded path's default), "continuous" (transformers'
continuous batching), "static" (a static cache, each prompt prefilled once, the decode step
compiled by torch.compile: CUDA graphs on a GPU) and "static-eager" (the static cache without
compiling).

    python -m benchmarks.generation                          # every workload, 1 and 2 threads
    python -m benchmarks.generation --workloads medium --threads 2 --repeats 5
    python -m benchmarks.generation --workloads long-prompt --paths per-row,padded --threads 2 \
        --repeats 5 --out benchmarks/results/cpu-amd-epyc-2-cores-generation.csv

Completion lengths are drawn per sequence and forced with `grpo_train.length_forcing.forced_lengths`
(EOS exactly at the drawn length, never before), so every path produces the same number of
tokens on random-weight models. "tail" lengths are long-tailed: round(exp(N(ln(max_new / 8), 1))),
clipped to [1, max_new + 1] (max_new + 1 = truncated at max_new); "full" = every sequence runs
to max_new (nothing for continuous batching to skip). Workloads (B = prompts x 8 completions):

    embedded      the embedded tiny model (hidden 64, 2 layers), B = 128, max_new 64, tail
    default-run   the embedded model at the default run's shape: B = 512, max_new 3, tail
    medium        random Qwen2, hidden 256, 4 layers, vocab 4096, B = 64, max_new 128, tail
    medium-full   the same, full lengths
    large         random Qwen2, hidden 512, 8 layers, vocab 4096, B = 64, max_new 256, tail
    long-prompt   random Qwen2 shaped as Qwen2.5-0.5B's layers (hidden 896, 14 heads, 2 KV
                  heads, MLP 4864), 2 layers, vocab 4096; B = 32 (4 prompts of 464-512 tokens,
                  left-padded to 512), max_new 128, tail
    long-prompt-1k  the same with prompts of 976-1024 tokens and max_new 256
    trainer-64    the trainer benchmark's work (benchmarks/trainer_step.py): Qwen2.5-0.5B's
                  shape (24 layers, vocab 151,936), one prompt of 64 tokens, G = 8, cap 1,024,
                  lognormal lengths (benchmarks/lengths.py, draw 0: the timed step's)
    trainer-1k    the same with a prompt of 1,024 tokens

--layers, --max_new and --prompt_tokens override a workload's depth, cap and prompt, --tiny its
model (hidden 64, 2 layers, vocab 4096; the GPU script's dry run); --device cuda and --dtype
bfloat16 run it on a GPU; --per_path times each path's calls together and writes its row at once
(a run cut short keeps the paths it finished). --sdpa_backends (a comma list of cudnn, flash,
efficient, math) runs every call of the run, untimed and timed, under
`torch.nn.attention.sdpa_kernel` with those backends (the models here use sdpa attention); the
rows' sdpa_backends column names them ("default": PyTorch's choice). Without cudnn in the list,
a padded run shows whether PyTorch's choice of cuDNN attention costs each new KV length a graph
build (benchmarks/sdpa_probe.py times the call alone).

The embedded task's prompts are a few tokens long; the long-prompt workloads use prompts of
digits and "+" (the tokenizer is character-level: one token per character), 16 characters
shorter from one prompt to the next so that the batch is left-padded.

Per workload and thread count: one untimed call per path, then --repeats rounds in which every
path runs once, in turn (interleaved, so that a change of machine load hits every path alike;
the same prompts and lengths each time). Reported per path: median seconds, completion tokens
per second, the speedup over the first path, and the prompt positions prefilled: B·Lp for
per-row; P·(Lp - 1) + B for padded and static (the prompts once, without their last token, which
`generate` runs for every row); the prompts' own tokens, each once, for continuous. A path that
falls back (continuous batching or the static cache failing; the reason is logged) is timed as
the path that ran, which the row's ran_path names. The header gives machine, date, load average
and command; --out appends one CSV row per path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from grpo_train.flags import Parser, run_cli

from . import cpu_model, device_label, git_commit
from .sdpa_probe import parse_backends
from .step_row import append_row

G = 8
QWEN_05B_2L = dict(hidden=896, layers=2, heads=14, kv_heads=2, mlp=4864)  # Qwen2.5-0.5B's layers
QWEN_05B = dict(QWEN_05B_2L, layers=24, vocab=151936)  # its whole shape
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=4096)  # trainer_step's
WORKLOADS = {  # name: (model, prompts, max_new_tokens, lengths, prompt tokens: None = the task's)
    "embedded": ("embedded", 16, 64, "tail", None),
    "default-run": ("embedded", 64, 3, "tail", None),
    "medium": (dict(hidden=256, layers=4), 8, 128, "tail", None),
    "medium-full": (dict(hidden=256, layers=4), 8, 128, "full", None),
    "large": (dict(hidden=512, layers=8), 8, 256, "tail", None),
    "long-prompt": (QWEN_05B_2L, 4, 128, "tail", 512),
    "long-prompt-1k": (QWEN_05B_2L, 4, 256, "tail", 1024),
    "trainer-64": (QWEN_05B, 1, 1024, "lognormal", 64),
    "trainer-1k": (QWEN_05B, 1, 1024, "lognormal", 1024),
}
PATHS = {  # name: (--generation, prefill_once: None = decided, False = a prefill per row,
    # other TrainConfig fields)
    "per-row": ("padded", False, {}),
    "padded": ("padded", None, {}),
    "continuous": ("continuous", None, {}),
    "static": ("static", None, dict(static_compile=True)),
    "static-eager": ("static", None, dict(static_compile=False)),
}


def build(model_spec, prompts: int, max_new: int, prompt_tokens: int | None = None):
    """(model, tokenizer, examples, cfg) for a workload, random weights, seed 0."""
    from grpo_train.config import TrainConfig, resolve_auto
    from grpo_train.data import load_examples
    from grpo_train.models import build_embedded, prepare_tokenizer

    cfg = resolve_auto(TrainConfig(max_new_tokens=max_new, num_generations=G))
    if prompt_tokens is None:
        examples = load_examples(cfg)[0][:prompts]  # the embedded task's ("1+0+2+2+1=")
    else:  # characters = tokens; the chat template adds "=": prompt j has 16·j tokens fewer
        text = "".join(f"{i % 10}+" for i in range(prompt_tokens))
        examples = [{"prompt": text[:prompt_tokens - 1 - 16 * j], "answer": "0"}
                    for j in range(prompts)]
    if model_spec == "embedded":
        model, tok = build_embedded(cfg)
        return model, tok, examples, cfg
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train.tiny import build_tokenizer

    hidden, vocab = model_spec["hidden"], model_spec.get("vocab", 4096)
    tok = build_tokenizer(vocab_size=vocab)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden,
                         intermediate_size=model_spec.get("mlp", 4 * hidden),
                         num_hidden_layers=model_spec["layers"],
                         num_attention_heads=model_spec.get("heads", hidden // 64),
                         num_key_value_heads=model_spec.get("kv_heads", max(1, hidden // 128)),
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    return model, prepare_tokenizer(tok, model), examples, cfg


def model_label(model_spec) -> str:
    if model_spec == "embedded":
        return "embedded (64 x 2)"
    return (f"Qwen2 {model_spec['hidden']} x {model_spec['layers']}, vocab "
            f"{model_spec.get('vocab', 4096)}")


def draw_lengths(kind: str, B: int, max_new: int) -> list[int]:
    """B forced lengths (max_new + 1: truncated at max_new): "full", "tail" (module docstring)
    or "lognormal" (benchmarks/lengths.py's draw 0, as trainer_step's timed step draws)."""
    rng = random.Random(1)
    if kind == "full":
        return [max_new] * B
    if kind == "lognormal":
        from .lengths import draw_lengths as profile

        return [n if n < max_new else max_new + 1
                for n in profile("lognormal", B, max_new, seed=0, call=0)]
    return [min(max_new + 1, max(1, round(math.exp(rng.gauss(math.log(max_new / 8), 1.0)))))
            for _ in range(B)]


def setups(model, tok, cfg, paths: list[str], autocast: bool = False) -> dict:
    """A `GenerationSetup` per path name; autocast: bf16 autocast around each call, as
    grpo_train's --bf16 runs generation (float32 weights)."""
    from grpo_train.generation import GenerationSetup
    from grpo_train.models import eos_token_ids

    device = next(model.parameters()).device.type
    out = {}
    for name in paths:
        mode, prefill_once, fields = PATHS[name]
        context = torch.autocast(device, dtype=torch.bfloat16) if autocast else \
            contextlib.nullcontext()
        out[name] = GenerationSetup(
            cfg=dataclasses.replace(cfg, generation=mode, bf16=autocast, **fields),
            tokenizer=tok, eos_ids=eos_token_ids(model, tok), prefill_once=prefill_once,
            autocast=context, say=lambda msg, n=name: print(f"  {n}: {msg}", flush=True))
    return out


def time_paths(model, tok, examples, cfg, paths: list[str], lengths: list[int],
               repeats: int, per_path: bool = False, done=None, autocast: bool = False,
               warmup_tokens: int | None = None, sdpa_backends=None) -> dict[str, dict]:
    """Per path: seconds of each timed `generate` call, completion tokens and prompt positions
    prefilled. One untimed call per path (its completions cut to warmup_tokens, if given: the
    same shapes and compiled graphs, fewer decode steps), then `repeats` rounds of one call per
    path; with per_path, each path's calls one after the other, `done(path, result)` after
    each path. sdpa_backends (a list of SDPBackend): every call under
    `torch.nn.attention.sdpa_kernel(sdpa_backends)`; None: PyTorch's choice."""
    from grpo_train.length_forcing import forced_lengths

    ctx = setups(model, tok, cfg, paths, autocast)
    out = {name: {"times": []} for name in paths}
    rounds = [[(i, name) for name in paths] for i in range(repeats + 1)]  # round 0: untimed
    if per_path:
        rounds = [[(i, name) for i in range(repeats + 1)] for name in paths]
    warm = lengths if warmup_tokens is None else [min(n, warmup_tokens) for n in lengths]
    drawn = [lengths]  # what the next call's completions are forced to
    backends = contextlib.nullcontext() if sdpa_backends is None else \
        sdpa_kernel(sdpa_backends)
    with forced_lengths(lambda B: drawn[0]), backends:
        for calls in rounds:
            for i, name in calls:
                drawn[0] = lengths if i else warm
                seconds, batch = _timed_call(model, examples, ctx[name], seed=i)
                if i:
                    out[name]["times"].append(seconds)
                out[name]["tokens"] = int(batch["lengths"].sum())
                # the path that ran: after a fallback (logged), not the one asked for
                out[name]["ran"] = ctx[name].generation_path
                out[name]["prefilled"] = prefilled(out[name]["ran"], ctx[name], batch,
                                                   len(examples))
            if per_path and done is not None:
                done(calls[0][1], out[calls[0][1]])
    return out


def _timed_call(model, examples, ctx, seed: int) -> tuple[float, dict]:
    """(seconds, batch) of one `generate` call (CUDA: synchronized before and after)."""
    from grpo_train.generation import generate

    cuda = next(model.parameters()).device.type == "cuda"
    torch.manual_seed(seed)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch = generate(model, examples, ctx)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, batch


def prefilled(path: str, ctx, batch: dict, P: int) -> int:
    """Prompt positions the path ran the model over (module docstring)."""
    prompt_mask = batch["attention_mask"][:, :-batch["T"]]  # [B, Lp]
    B, Lp = prompt_mask.shape
    if path == "continuous":
        return int(prompt_mask[::B // P].sum())
    return P * (Lp - 1) + B if ctx.prefill_once and B > P and Lp > 1 else B * Lp


def parse_args(argv):
    parser = Parser("python -m benchmarks.generation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(n for n in WORKLOADS
                                                        if not n.startswith("trainer-")),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all but "
                             "the trainer-* ones)")
    parser.add_argument("--paths", default="padded,continuous",
                        help=f"comma-separated, of {', '.join(PATHS)}; speedups are over the "
                             "first")
    parser.add_argument("--threads", default="1,2",
                        help="torch CPU thread counts to run (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per path")
    parser.add_argument("--per_path", action="store_true",
                        help="each path's calls together, its row written at once (module "
                             "docstring); default: interleaved rounds")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny Qwen2 (hidden 64, 2 layers, vocab 4096: trainer_step's "
                             "--tiny) in place of the workload's model (smoke tests)")
    parser.add_argument("--layers", type=int, default=None, help="override the model's depth")
    parser.add_argument("--max_new", type=int, default=None, help="override the length cap")
    parser.add_argument("--prompt_tokens", type=int, default=None,
                        help="override the prompt length of the workloads that set one")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the weights' dtype")
    parser.add_argument("--autocast", action="store_true",
                        help="bf16 autocast around each call, as grpo_train's --bf16 runs "
                             "generation (with --dtype float32: float32 weights)")
    parser.add_argument("--warmup_tokens", type=int, default=None,
                        help="cut the untimed call's completions to this many tokens (the same "
                             "shapes, so the same compiled graphs; fewer decode steps)")
    parser.add_argument("--sdpa_backends", default=None,
                        help="comma list of cudnn, flash, efficient, math: every call under "
                             "torch.nn.attention.sdpa_kernel with those (default: PyTorch's "
                             "choice)")
    parser.add_argument("--out", default=None, help="a CSV file to append one row per path to")
    args = parser.parse_args(argv)
    try:
        args.backend_list = None if args.sdpa_backends is None else \
            parse_backends(args.sdpa_backends)
    except ValueError as err:
        parser.error(str(err))
    args.names, args.path_list = args.workloads.split(","), args.paths.split(",")
    unknown = ([n for n in args.names if n not in WORKLOADS]
               + [p for p in args.path_list if p not in PATHS])
    if unknown:
        parser.error(f"unknown workloads or paths {unknown}; known: {', '.join(WORKLOADS)}; "
                     f"{', '.join(PATHS)}")
    for name in ("layers", "max_new", "repeats", "prompt_tokens", "warmup_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    command = "python -m benchmarks.generation " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv)
    machine = device_label(device) if device.type == "cuda" else \
        f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"# {machine} | {dt.date.today()} | commit {git_commit()} | torch {torch.__version__}"
          f" | sdpa backends {args.sdpa_backends or 'default'}\n# {command}")
    print(f"{'workload':<14} {'threads':>7} {'path':<12} {'seconds':>8} {'tokens':>7} "
          f"{'tokens/s':>9} {'speedup':>8} {'prefilled':>9} {'load avg':>15}")
    for name in args.names:
        spec, prompts, max_new, kind, prompt_tokens = WORKLOADS[name]
        if args.tiny and spec != "embedded":
            spec = TINY
        if args.layers is not None and spec != "embedded":
            spec = dict(spec, layers=args.layers)
        max_new = args.max_new or max_new
        if prompt_tokens is not None and args.prompt_tokens is not None:
            prompt_tokens = args.prompt_tokens
        model, tok, examples, cfg = build(spec, prompts, max_new, prompt_tokens)
        model.to(device=device, dtype=getattr(torch, args.dtype))
        lengths = draw_lengths(kind, prompts * G, max_new)
        where = dict(workload=name, model=model_label(spec), prompts=prompts, G=G,
                     prompt_tokens=prompt_tokens or "", max_new=max_new, lengths=kind)
        for threads in [int(t) for t in args.threads.split(",")]:
            if threads:
                torch.set_num_threads(threads)
            first: list[float] = []  # the first path's median, once measured

            def report(path, t, where=where, threads=threads, first=first):
                seconds = statistics.median(t["times"])
                if not first:
                    first.append(seconds)
                speedup = first[0] / seconds
                load = " ".join(f"{x:.2f}" for x in os.getloadavg())
                print(f"{where['workload']:<14} {threads:>7} {path:<12} {seconds:>8.3f} "
                      f"{t['tokens']:>7} {t['tokens'] / seconds:>9.0f} "
                      f"{f'{speedup:.2f}x' if path != args.path_list[0] else '':>8} "
                      f"{t['prefilled']:>9} {load:>15}", flush=True)
                if args.out:  # row by row: a run cut short keeps what it measured
                    append_row(Path(args.out), dict(
                        date=dt.date.today().isoformat(), machine=machine, commit=git_commit(),
                        torch=torch.__version__, command=command, **where, device=device.type,
                        dtype=args.dtype, autocast=args.autocast,
                        sdpa_backends=args.sdpa_backends or "default", threads=threads, path=path,
                        repeats=args.repeats,
                        median_s=round(seconds, 4), min_s=round(min(t["times"]), 4),
                        max_s=round(max(t["times"]), 4), completion_tokens=t["tokens"],
                        prefilled_positions=t["prefilled"], ran_path=t["ran"],
                        speedup_vs_first=round(speedup, 3), load_avg=load))

            timed = time_paths(model, tok, examples, cfg, args.path_list, lengths, args.repeats,
                               per_path=args.per_path, done=report, autocast=args.autocast,
                               warmup_tokens=args.warmup_tokens,
                               sdpa_backends=args.backend_list)
            if not args.per_path:
                for path in args.path_list:
                    report(path, timed[path])
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m benchmarks.generation", main))
