"""One GRPO trainer step on a Qwen2.5-0.5B-shaped model: peak memory and throughput of
grpo_train with the fused loss, grpo_train with the reference (materialized-logits) loss, TRL's
GRPOTrainer and grpo-kernels' TRL subclass with the same settings.

    python -m benchmarks.trainer_step --provider fused          # GPU, the real size
    python -m benchmarks.trainer_step --provider reference
    python -m benchmarks.trainer_step --provider trl            # needs trl (and datasets)
    python -m benchmarks.trainer_step --provider trl-kernels    # grpo_kernels.trl.GRPOTrainer
    python benchmarks/trainer_step.py --provider fused --tiny   # CPU smoke test, tiny sizes

One provider per process, so that peak memory is never shared between providers. Every provider
gets the same work: Qwen2.5-0.5B's configuration (random weights, float32 master weights), one
prompt of --prompt_tokens tokens, G = --num_generations completions whose lengths follow
--length_profile with cap --completion_tokens (benchmarks/lengths.py: `fixed` = every completion
at the cap; `lognormal` = long-tailed, median a third of the cap; the same draws for every
provider, enforced with EOS at the drawn length), sampling at temperature 1, one optimizer step
(AdamW) per generation batch with all G sequences in one micro-batch, beta = --beta (0), loss_type
"dapo", and on CUDA bf16 autocast + gradient checkpointing (TRL's defaults). grpo_train and the
TRL subclass pack their forwards (--padding_free on, their default) unless --padding_free off;
grpo_train also computes the group's prompt once (--share_prompt on, its default) unless
--share_prompt off; TRL pads. --synthetic (TRL-based providers): completions of the drawn
lengths are random tokens made without the model, so a step is scoring + loss + optimizer
(benchmarks/trl_providers.py).

Measured per step, after --warmup steps: wall time (CUDA-synchronized at the step's end), tokens/s =
G·(prompt + completion tokens) / step time, and memory by phase (benchmarks/phases.py): generation,
scoring (rewards; reference/old log-probs when configured), loss (forward + backward of every
micro-batch) and optimizer (clipping, AdamW step, zeroing), plus the whole step. For each: peak =
the highest memory while it ran and rise = peak - memory at its start (what its temporaries add).
Memory is the allocator's allocated bytes on CUDA (max_memory_allocated, reset at every phase
boundary) and the process' resident set size on CPU, sampled every 2 ms by a thread. On CPU the RSS
depends on glibc: run as a command, the benchmark re-executes itself with its mmap and trim
thresholds fixed at 128 KiB (benchmarks/allocator.py; the row's `malloc` column says which), and the
scoring and loss phases are also measured independently of the allocator: <phase>_alloc_rise_gib is
the peak of PyTorch's live CPU tensors above the phase's start, from torch.profiler's memory events
(--profile_bytes off skips it). Warm-up steps replay the timed steps' completion lengths
(benchmarks/lengths.py). TRL's phases are marked by a subclass and callbacks: generation =
`_generate`, scoring = the rest of `_generate_and_score_completions`, loss = `training_step` after
it, optimizer = from `on_pre_optimizer_step` to `on_step_end` (TRL clips gradients just before,
outside the phases). Reported: medians over the --steps timed steps of time, highest peak and rise;
also the process' lifetime peak (CPU: peak RSS, dominated by the first step's AdamW allocation). One
row appended to <out>/<device>-trainer.csv (default: results/ under the current directory, created
if missing) with the device, versions, commit and command.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from grpo_train.checks import CHOICES
from grpo_train.flags import Parser, run_cli

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/trainer_step.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks import allocator  # noqa: E402  (needs ROOT on the path)
from benchmarks.step_row import (  # noqa: E402
    PROFILED,
    describe,
    environment,
    phase_columns,
    report,
    route_columns,
)

# Qwen/Qwen2.5-0.5B config.json (the values that shape compute and memory)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_window_layers=24, hidden_act="silu")
TINY = dict(QWEN25_05B, vocab_size=4096, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def length_reward(prompts, completions, **columns):
    """A cheap reward with spread (the step's cost does not depend on reward values)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def build_assets(workdir: Path, args) -> tuple[Path, Path, str]:
    """Random-weight model + matching tokenizer saved for the Auto classes (in --assets, where
    a model of the same shape and seed saved by an earlier run is used as it is); a prompts
    file."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train.tiny import build_tokenizer

    shape = dict(TINY if args.tiny else QWEN25_05B)
    if args.num_layers is not None:
        shape.update(num_hidden_layers=args.num_layers, max_window_layers=args.num_layers)
    name = f"model-{'tiny' if args.tiny else 'qwen2.5-0.5b'}-{shape['num_hidden_layers']}l-" \
           f"seed{args.seed}"
    model_dir = (Path(args.assets) if args.assets else workdir) / name
    if not (model_dir / "config.json").exists():  # written last by save_pretrained
        tokenizer = build_tokenizer(vocab_size=shape["vocab_size"])
        config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.bos_token_id)
        torch.manual_seed(args.seed)
        model = Qwen2ForCausalLM(config)
        tokenizer.save_pretrained(model_dir)
        model.save_pretrained(model_dir)
    # the chat template appends "=", so the prompt text is one token shorter than the prompt
    text = ("0123456789" * (args.prompt_tokens // 10 + 1))[: args.prompt_tokens - 1]
    data = workdir / "prompts.jsonl"
    rows = args.warmup + args.steps + 1
    data.write_text("".join(json.dumps({"prompt": text, "answer": "0"}) + "\n"
                            for _ in range(rows)))
    return model_dir, data, text


def run_grpo_train(args, model_dir: Path, data: Path, workdir: Path, device,
                   recorder) -> tuple[list[dict], object, dict]:
    """Steps of our trainer (per-step numbers from its metrics.jsonl), the recorder, and what
    ran: the row layout, the attention implementation and the generation path."""
    from grpo_train import train
    from grpo_train.config import TrainConfig
    from grpo_train.logs import read_metrics

    from . import phases  # in the function: grpo_train loads this file for length_reward

    cuda = device.type == "cuda"
    cfg = TrainConfig(
        model=str(model_dir), dataset=str(data), prompt_column="prompt", answer_column="answer",
        eval_size=0, output_dir=str(workdir / "run"), steps=args.warmup + args.steps,
        num_prompts=1, num_generations=args.num_generations,
        max_new_tokens=args.completion_tokens, padding_free=args.padding_free == "on",
        share_prompt=args.share_prompt == "on", generation=args.generation,
        static_compile=args.static_compile == "on", attn_implementation=args.attn_implementation,
        micro_batch_size=args.num_generations, beta=args.beta, num_iterations=1,
        loss_type="dapo",
        loss=args.provider, learning_rate=1e-6, bf16=cuda and not args.no_bf16,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        model_dtype=args.model_dtype, reward=[f"{Path(__file__).resolve()}:length_reward"],
        eval_every=0, save_every=0, plot=False, save_final_model=False, progress=False,
        seed=args.seed, device="cuda" if cuda else "cpu", backend=args.backend)
    with phases.recording(recorder):
        result = train(cfg, phases=phases)
    steps = [dict(step_time_s=r["step_time_s"], tokens_per_s=r["tokens_per_s"],
                  peak_gib=r["peak_memory_gib"], completion_length=r["completion_length"])
             for r in read_metrics(workdir / "run" / "metrics.jsonl") if "reward" in r]
    ran = dict(row_layout=result["layout"], attention=result["attention"],
               generation_path=result["generation"])
    return steps, recorder, ran


PROVIDERS = ("fused", "reference", "trl", "trl-kernels")


def parse_args(argv):
    from benchmarks import lengths  # in the function: grpo_train loads this file as a path

    parser = Parser("python -m benchmarks.trainer_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--provider", choices=PROVIDERS, required=True)
    parser.add_argument("--tiny", action="store_true",
                        help="tiny model and sizes (CPU smoke test; not a Qwen2.5 measurement)")
    parser.add_argument("--num_generations", type=int, default=None, help="G (default 8; tiny 4)")
    parser.add_argument("--completion_tokens", type=int, default=None,
                        help="tokens per completion (default 1024; tiny 16)")
    parser.add_argument("--prompt_tokens", type=int, default=None, help="default 64; tiny 16")
    parser.add_argument("--length_profile", default="fixed", choices=lengths.PROFILES,
                        help="completion lengths: fixed = all at the cap; lognormal = "
                             "long-tailed, median cap/3 (benchmarks/lengths.py)")
    parser.add_argument("--padding_free", default="on", choices=("on", "off"),
                        help="grpo_train and trl-kernels: packed rows (on, their default) or "
                             "padded ones; TRL's own trainer always pads")
    parser.add_argument("--share_prompt", default="on", choices=("on", "off"),
                        help="grpo_train and trl-kernels with packed rows: the group's prompt "
                             "once (on, their default) or once per completion")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL coefficient (> 0: a reference model is scored every step)")
    parser.add_argument("--synthetic", action="store_true",
                        help="completions are random tokens of the drawn lengths, made without "
                             "running the model (scoring, loss and optimizer are measured as "
                             "usual; generation is not); grpo_train takes its padded path")
    parser.add_argument("--num_layers", type=int, default=None,
                        help="decoder layers (default: the shape's, 24 for Qwen2.5-0.5B)")
    parser.add_argument("--generation", default="auto", choices=CHOICES["generation"],
                        help="grpo_train providers' generation path (auto: the device's rule, "
                             "grpo_train.generation.GENERATION_RULES); TRL uses model.generate")
    parser.add_argument("--static_compile", default="on", choices=("on", "off"),
                        help="--generation static: compile the decode step (on) or not")
    parser.add_argument("--attn_implementation", default="auto",
                        choices=CHOICES["attn_implementation"],
                        help="grpo_train providers: the scoring and loss forwards' attention "
                             "(auto: the rule, grpo_kernels.hf.ATTENTION_RULES)")
    parser.add_argument("--assets", default=None, metavar="DIR",
                        help="keep the random-weight model in DIR and use a saved one of the "
                             "same shape and seed (runs on one machine share it)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first, replaying the timed steps' lengths (as many "
                             "as --steps warms every timed step's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--model_dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no_bf16", action="store_true", help="no bf16 autocast on CUDA")
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "chunked"),
                        help="grpo_train's fused-loss backend (auto: Triton on CUDA)")
    parser.add_argument("--out", "--results", dest="out", default="results", metavar="DIR",
                        help="the CSV <device>-trainer.csv is appended in this directory, "
                             "created if missing (default: results/ under the current "
                             "directory; the committed rows were written with --out "
                             "benchmarks/results)")
    parser.add_argument("--no_record", action="store_true", help="print only, write no CSV")
    parser.add_argument("--max_rss_gib", type=float, default=None,
                        help="CPU: stop the run when the process' RSS passes this (a shared "
                             "machine's guard); the row says where it stopped")
    parser.add_argument("--profile_bytes", default="on", choices=("on", "off"),
                        help="CPU: also count the scoring and loss phases' allocator bytes "
                             "with torch.profiler (<phase>_alloc_rise_gib; slows those phases)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return _checked(parser, parser.parse_args(argv))


def _checked(parser, args):
    """The parsed arguments with the tiny or full defaults filled in, or a parser error."""
    defaults = dict(num_generations=(8, 4), completion_tokens=(1024, 16), prompt_tokens=(64, 16))
    for name, (full, tiny) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    for name, low in (("prompt_tokens", 2), ("completion_tokens", 1), ("num_generations", 2),
                      ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.synthetic and not args.provider.startswith("trl"):
        if args.generation == "continuous":
            parser.error("--synthetic replaces model.generate, grpo_train's padded path: it "
                         "cannot take --generation continuous")
        args.generation = "padded"
    if args.attn_implementation != "auto" and args.provider.startswith("trl"):
        parser.error("--attn_implementation is grpo_train's flag; the TRL subclass takes the "
                     "rule's choice, TRL its model's attention")
    if args.num_layers is not None and args.num_layers < 1:
        parser.error(f"--num_layers must be >= 1, got {args.num_layers}")
    if args.beta < 0:
        parser.error(f"--beta must be >= 0, got {args.beta}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    return args


def main(argv=None) -> dict | int:
    """The result row (a dict); as a command, the exit status (2 for a bad argument)."""
    outcome = {}

    def run() -> int:
        outcome["row"] = measure(parse_args(argv), argv)
        return 0

    status = run_cli("python -m benchmarks.trainer_step", run, argv)
    return outcome.get("row", status)


def measure(args, argv) -> dict:
    from benchmarks import lengths  # in the function: grpo_train loads this file as a path

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    # the checkout as the run starts (a commit made while a long run goes on is not its code)
    env = environment(args, argv, device)
    if args.length_profile != "fixed" and args.warmup < args.steps:
        print(f"note: --warmup {args.warmup} < --steps {args.steps}: timed steps past the first "
              f"{args.warmup} run lengths no warm-up step replayed (on a GPU, kernel variants "
              "compile in them)", file=sys.stderr)
    from benchmarks.cases import routes_taken

    taken: list[str] = []  # the route of each linear-head loss call of ours
    with routes_taken(taken), tempfile.TemporaryDirectory(prefix="trainer_step_") as tmp:
        workdir = Path(tmp)
        model_dir, data, prompt_text = build_assets(workdir, args)
        forcing = lengths.ForcedLengths(args.length_profile, args.completion_tokens,
                                        eos_id=_eos_id(model_dir), seed=args.seed,
                                        warmup=args.warmup, timed=args.steps)
        recorder = make_recorder(args, device, workdir, env)
        if args.provider.startswith("trl"):
            from benchmarks.trl_providers import run_trl

            with forcing.installed(synthetic=args.synthetic):
                steps, recorder, ran = run_trl(args, model_dir, prompt_text, workdir, device,
                                               recorder, forcing, length_reward)
        elif args.synthetic:  # grpo_train's padded generation path calls model.generate
            with forcing.installed(synthetic=True):
                steps, recorder, ran = run_grpo_train(args, model_dir, data, workdir, device,
                                                      recorder)
        else:
            from grpo_train.length_forcing import forced_lengths

            with forced_lengths(forcing.draw):
                steps, recorder, ran = run_grpo_train(args, model_dir, data, workdir, device,
                                                      recorder)
    timed = steps[args.warmup:]
    if not timed:
        raise RuntimeError(f"no timed steps ({len(steps)} steps ran, --warmup {args.warmup})")
    drawn = forcing.history[args.warmup:]  # one generate call per step, for every provider
    if len(forcing.history) != len(steps):
        raise RuntimeError(f"{len(forcing.history)} generate calls in {len(steps)} steps: the "
                           "forced lengths did not cover every step")
    mean_len = statistics.mean(x for call in drawn for x in call)
    ours = [s["completion_length"] for s in timed if "completion_length" in s]
    if ours and abs(statistics.mean(ours) - mean_len) > 1e-6:  # the work must be what we claim
        raise RuntimeError(f"completions averaged {statistics.mean(ours)} tokens, drawn "
                           f"{mean_len}")
    row = {
        **describe(args, cuda), **ran, "status": "ok", "timed_steps": len(timed),
        "completion_tokens_mean": round(mean_len, 1),
        "step_time_s_median": round(statistics.median(s["step_time_s"] for s in timed), 4),
        "tokens_per_s_median": round(statistics.median(s["tokens_per_s"] for s in timed), 1),
        **phase_columns(recorder, args.warmup),
        "phase_memory_kind": "max_memory_allocated" if cuda else "RSS sampled every 2 ms",
        "alloc_kind": "" if cuda or args.profile_bytes == "off" else
        "torch.profiler CPU memory events (scoring, loss)",
        "malloc": allocator.describe(),
        "peak_memory_gib": round(max(s["peak_gib"] for s in timed), 3),
        "peak_memory_kind": "max_memory_allocated" if cuda else "process lifetime peak RSS",
        **env, **route_columns(args.provider, taken),
    }
    report(args, device, row)
    return row


def _eos_id(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).eos_token_id


def make_recorder(args, device, workdir: Path, env: dict):
    """The phase recorder; with --max_rss_gib on CPU, one that stops the process when its RSS
    passes the limit, after writing a row with what was measured up to there."""
    from . import phases  # in the function: grpo_train loads this file for length_reward

    profiled = PROFILED if args.profile_bytes == "on" else ()
    if args.max_rss_gib is None or device.type == "cuda":
        return phases.PhaseRecorder(device, profile_phases=profiled)

    def stop(recorder, seen: int) -> None:  # runs on the sampling thread
        where = "/".join(recorder.open_phases()) or "no phase"
        step = recorder.current_step
        row = {**describe(args, False),
               "status": f"stopped: RSS passed {args.max_rss_gib} GiB "
                         f"({seen / 2**30:.2f} GiB) in {where} of step {step}",
               **phase_columns(recorder, args.warmup if step > args.warmup else 0,
                               partial=True),
               "phase_memory_kind": "RSS sampled every 2 ms",
               "malloc": allocator.describe(), **env}
        report(args, device, row)
        shutil.rmtree(workdir, ignore_errors=True)  # the exit skips TemporaryDirectory's clean-up
        os._exit(3)

    return phases.PhaseRecorder(device, limit_bytes=int(args.max_rss_gib * 2**30),
                                on_limit=stop, profile_phases=profiled)


if __name__ == "__main__":
    # CPU memory figures need glibc's thresholds fixed before the process starts
    allocator.reexec_with_fixed_thresholds()
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
