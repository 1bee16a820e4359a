"""Checkpoints: one file per save, written atomically, holding everything the next step needs.

A checkpoint is `OUTPUT_DIR/checkpoints/step_000123.pt` with the model, optimizer and scheduler
states, every process' RNG states, the step and the prompt sampler's position. It is written to a
temporary file in the same directory, flushed to disk and renamed over the final name, so a crash
at any moment leaves either the old set of checkpoints or the new one, never a torn file; older
checkpoints are deleted only after the new one is in place.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

_NAME = re.compile(r"^step_(\d+)\.pt$")


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
            raise FileNotFoundError(f"--resume {resume}: no checkpoint in "
                                    f"{checkpoint_dir(output_dir)}")
        return found[-1] if found else None
    path = Path(resume)
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path) or list_checkpoints(checkpoint_dir(path))
        if found:
            return found[-1]
        raise FileNotFoundError(f"--resume {resume!r}: no step_*.pt checkpoint in that directory")
    raise FileNotFoundError(f"--resume {resume!r}: no such checkpoint file or run directory "
                            "(expected a step_*.pt file, a run directory, or 'auto')")


def load_checkpoint(path) -> dict:
    # Our own files: they hold numpy/python RNG states, which weights_only loading rejects.
    return torch.load(path, map_location="cpu", weights_only=False)
