"""Checkpoints: one file per save, written atomically, holding everything the next step needs.

A checkpoint is `OUTPUT_DIR/checkpoints/step_000123.pt` with the model, optimizer and scheduler
states, every process' RNG states, the step and the prompt sampler's position. It is written to a
temporary file in the same directory, flushed to disk and renamed over the final name, so a crash
at any moment leaves either the old set of checkpoints or the new one, never a torn file; older
checkpoints are deleted only after the new one is in place. `StopOnSignal` turns Ctrl-C or
SIGTERM into a checkpoint at the end of the current step.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from .flags import MissingPathError, UsageError

_NAME = re.compile(r"^step_(\d+)\.pt$")
# What a run writes into OUTPUT_DIR (and what --overwrite deletes: nothing else).
RUN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "curves.png", "checkpoints", "initial_model",
             "final_model")


def capture_rng() -> dict:
    """This process' RNG states: python, numpy, torch CPU and every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def checkpoint_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Finished checkpoints in `directory`, oldest first (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(output_dir, step: int, payload: dict, keep: int = 2) -> Path:
    """Atomically write `payload` as checkpoint `step`; then prune to the newest `keep`."""
    directory = checkpoint_dir(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step:06d}.pt"
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)  # atomic on POSIX and Windows when on the same filesystem
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    if keep > 0:
        for old in list_checkpoints(directory)[:-keep]:
            if old != final:
                old.unlink(missing_ok=True)
    return final


def find_checkpoint(resume: str | None, output_dir) -> Path | None:
    """The checkpoint that `--resume` names: None (start fresh), "auto" (the latest one in
    OUTPUT_DIR if any, else start fresh), a run directory (its latest) or a checkpoint file."""
    if not resume:
        return None
    if resume in ("auto", "last", "latest"):
        found = list_checkpoints(checkpoint_dir(output_dir))
        if not found and resume != "auto":
            raise MissingPathError(f"--resume {resume}: no checkpoint in "
                                    f"{checkpoint_dir(output_dir)}")
        return found[-1] if found else None
    path = Path(resume)
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path) or list_checkpoints(checkpoint_dir(path))
        if found:
            return found[-1]
        raise MissingPathError(f"--resume {resume!r}: no step_*.pt checkpoint in that directory")
    raise MissingPathError(f"--resume {resume!r}: no such checkpoint file or run directory "
                            "(expected a step_*.pt file, a run directory, or 'auto')")


def checkpoint_step(path) -> int | None:
    """The step in a checkpoint's file name (step_000123.pt -> 123); None for other names."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


# What every checkpoint holds (`save_run`), besides the config of the run that wrote it.
CHECKPOINT_KEYS = ("step", "model", "optimizer", "scheduler", "data", "rng")


def load_checkpoint(path, required: tuple[str, ...] = (), mmap: bool = False) -> dict:
    """A checkpoint's contents; a UsageError naming --resume for a file that is not one (a
    model's weights, another program's pickle, a truncated copy) or lacks a `required` key
    (a resume requires CHECKPOINT_KEYS). mmap: tensors mapped from the file, not read (to
    look at its config)."""
    expected = "expected a step_*.pt file that grpo-train wrote into OUTPUT_DIR/checkpoints"
    try:  # our own files: they hold numpy/python RNG states, which weights_only loading rejects
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - pickle, zip and I/O errors alike
        raise UsageError(f"--resume {str(path)!r} could not be read as a checkpoint "
                         f"({type(err).__name__}: {err}); {expected}") from err
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"--resume {str(path)!r} is not a grpo-train checkpoint (it has no "
                         f"{', '.join(missing)}); {expected}")
    return state


# Settings a resumed run may change: how it runs and what it reports, and the reward (fixing a
# broken reward function and resuming is the way out of --max_unscored_steps). Every other field
# must be the checkpoint's: it decides the data, its split and order, the batch, the sampling,
# the loss and the model, and the optimizer and scheduler states restore the checkpoint's
# learning rate, betas and weight decay whatever the flags say.
RESUME_MAY_CHANGE = frozenset({
    "steps", "output_dir", "resume", "overwrite", "progress", "plot", "eval_every",
    "eval_batch_size", "eval_size", "save_every", "keep_checkpoints", "save_final_model",
    "max_unscored_steps", "reward", "num_threads", "device", "backend", "generation",
    "static_compile", "micro_batch_size", "max_tokens_per_microbatch", "padding_free",
    "share_prompt", "attn_implementation", "gradient_checkpointing", "fsdp", "tp_size",
    "trust_remote_code"})


def _flag_value(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return "none" if value is None else repr(value) if value == "" else str(value)


# Fields added after checkpoints were written without them, with the value every such run
# trained with: a checkpoint that lacks one is compared as holding it (use_bias_correction_kl
# was off in every run before it became a flag; it is on with --model now)
ADDED_FIELDS = {"use_bias_correction_kl": False}


def check_resumed_config(state: dict, cfg, path, say) -> None:
    """Refuse to resume checkpoint `path` (its contents: `state`) with settings that change what
    the run trains: a UsageError naming each flag with this run's value and the checkpoint's.
    The settings of RESUME_MAY_CHANGE that differ are said in one line. A field that the
    checkpoint's config lacks (written by an older release) is not compared, except those of
    ADDED_FIELDS, compared as the value those releases used."""
    saved, now = state.get("config") or {}, dataclasses.asdict(cfg)
    if saved:
        saved = {**ADDED_FIELDS, **saved}
    changed = [k for k in now if k in saved and saved[k] != now[k]
               and k not in ("resume", "overwrite", "output_dir")]
    may_change = RESUME_MAY_CHANGE
    if cfg.dataset and not cfg.eval_split:  # its held-out rows come out of training: another
        may_change = may_change - {"eval_size"}  # --eval_size is another training set
    refused = [k for k in changed if k not in may_change]
    if refused:
        shown = ", ".join(f"--{k} {_flag_value(now[k])} (the checkpoint's: "
                          f"{_flag_value(saved[k])})" for k in refused)
        raise UsageError(
            f"--resume {str(path)!r}: this run's settings differ from the run that wrote the "
            f"checkpoint: {shown}. A resumed run trains on with the settings it started with: "
            "drop these flags or give the checkpoint's values, or start a new run in another "
            "--output_dir")
    if changed:
        say("resume: settings changed from the checkpoint's run: " + ", ".join(
            f"--{k} {_flag_value(saved[k])} -> {_flag_value(now[k])}" for k in changed))


# ---- a run's state ------------------------------------------------------------------------------


def save_run(step: int, cfg, accel, model, optimizer, scheduler, sampler, say,
             prune: bool = True) -> None:
    """Checkpoint `step` of a run: the model and optimizer states (full tensors, gathered under
    --fsdp), the scheduler, the prompt sampler, every process' RNG states and the config. Every
    process must call it; the main process writes the file. prune=False keeps every older
    checkpoint (the trainer's save while no completion is scored)."""
    from accelerate.utils import gather_object

    from . import sharding  # torch.distributed: loaded when a run saves, not for --resume checks

    rng = gather_object([capture_rng()])  # every process' RNG state, in rank order
    model_sd, optim_sd = sharding.state_dicts(model, optimizer)  # FSDP: gathered, full
    if accel.is_main_process:
        payload = dict(step=step, model=model_sd, optimizer=optim_sd,
                       scheduler=scheduler.state_dict(), data=sampler.state_dict(), rng=rng,
                       config=dataclasses.asdict(cfg))
        path = save_checkpoint(cfg.output_dir, step, payload,
                               cfg.keep_checkpoints if prune else 0)
        say(f"checkpoint {path}")
    accel.wait_for_everyone()


def resume_run(state: dict, path, model, optimizer, scheduler, sampler, rank: int, world: int,
               say) -> int:
    """Load checkpoint `path` (its contents: `state`, from `load_checkpoint`) into a run's model,
    optimizer, scheduler, prompt sampler and this process' RNG (when the process count is the
    one saved); returns its step."""
    from . import sharding

    sharding.load_state_dicts(model, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["data"])
    if len(state["rng"]) == world:
        restore_rng(state["rng"][rank])
    else:
        say(f"warning: checkpoint has RNG states for {len(state['rng'])} processes, this run "
            f"has {world}; sampling will differ from an uninterrupted run")
    say(f"resumed from {path} at step {state['step']}")
    return state["step"]


# ---- the output directory -----------------------------------------------------------------------


def check_output_dir(output_dir, resume: str | None, overwrite: bool,
                     inputs: dict[str, str] | None = None) -> None:
    """Refuse to start a new run over files already in OUTPUT_DIR (they would be mixed with or
    replaced by this run's), unless --overwrite (they are deleted first, see `clear_run_files`)
    or --resume (this run continues them) says what to do with them. inputs: {flag: path} this
    run reads (--model, --dataset), which --overwrite must not delete."""
    out = Path(output_dir)
    if overwrite:
        _check_inputs_survive(out, inputs or {})
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output_dir {str(out)!r} is a file; expected a directory")
    if not out.is_dir():
        _create_output_dir(out)
        return
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir {str(out)!r} is not writable; expected a directory "
                         "this run can write its files to")
    if overwrite:
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if resume:
        if resume == "auto" and not list_checkpoints(checkpoint_dir(out)) and any(
                name in RUN_FILES for name in entries):
            raise UsageError(
                f"--resume auto: {str(out)!r} holds a previous run's files but no checkpoint to "
                "continue from; pass --overwrite to replace that run, or another --output_dir")
        found = find_checkpoint(resume, out)
        if found is not None:
            _check_resume_target(found, out, [name for name in entries if name in RUN_FILES])
        return
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise UsageError(
        f"--output_dir {str(out)!r} already holds files ({shown}); pass --resume auto to continue "
        "that run, --overwrite to delete its files and start again, or another --output_dir")


def _check_inputs_survive(out: Path, inputs: dict[str, str]) -> None:
    """An input inside a run file of OUTPUT_DIR (--model OUTPUT_DIR/final_model: training on
    from the previous run's model) that --overwrite would delete before it is read."""
    owned = [(out / name).resolve() for name in RUN_FILES]
    for flag, path in inputs.items():
        if not path or not os.path.exists(path):
            continue
        where = Path(path).resolve()
        hit = next((p for p in owned if where == p or p in where.parents), None)
        if hit is not None:
            raise UsageError(f"--overwrite would delete {flag} {path!r} (the previous run's "
                             f"{hit.name} in --output_dir) before this run reads it: copy it out "
                             "of --output_dir, or choose another --output_dir")


def _create_output_dir(out: Path) -> None:
    """Create OUTPUT_DIR before anything is loaded: a path that cannot be a directory (under a
    file, on a read-only or virtual file system) failed only when the first file was written,
    after the model had loaded, with an OSError traceback."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--output_dir {str(out)!r} cannot be created ({err.strerror or err}); "
                         "expected a directory this run can write its files to") from err


def _check_resume_target(found: Path, out: Path, run_files: list[str]) -> None:
    """Resuming `found` continues a run in OUTPUT_DIR `out` (which holds `run_files`): refuse
    where that would mix two histories there. Checkpoints past `found` in OUTPUT_DIR belong to
    the history this resume replaces: --resume auto would take them up again later, and pruning
    (--keep_checkpoints) would delete the new ones first. A checkpoint of another directory
    must not continue into OUTPUT_DIR while it holds a run of its own."""
    own = checkpoint_dir(out)
    step = checkpoint_step(found)
    if found.resolve().parent == own.resolve():
        later = [p.name for p in list_checkpoints(own) if step is not None
                 and checkpoint_step(p) > step]
        if later:
            raise UsageError(
                f"--resume {str(found)!r}: {str(own)!r} also holds later checkpoints of that "
                f"run ({', '.join(later)}); resuming from step {step} would mix their history "
                "with the new one. Move or delete them to go back to step "
                f"{step}, or pass --resume auto to continue from the latest")
    elif run_files:
        raise UsageError(
            f"--resume {str(found)!r} would continue that run into --output_dir {str(out)!r}, "
            f"which holds another run's files ({', '.join(run_files)}); pass the checkpoint's "
            "own run directory as --output_dir, or a new one")


def clear_run_files(output_dir) -> list[str]:
    """--overwrite: delete what an earlier run wrote into OUTPUT_DIR (RUN_FILES only; other files
    are left alone). Returns the names deleted."""
    out = Path(output_dir)
    deleted = []
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        deleted.append(name)
    return deleted


class StopOnSignal:
    """Ctrl-C / SIGTERM: finish the current step, save a checkpoint, exit. A second Ctrl-C aborts
    at once (KeyboardInterrupt)."""

    def __init__(self, say):
        self.say, self.requested, self.previous = say, False, {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.say("interrupt: finishing this step, then saving a checkpoint (Ctrl-C again aborts)")

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
