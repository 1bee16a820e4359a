"""Completion lengths for trainer benchmarks on random-weight models.

A random model never emits EOS on its own, so every completion would run to the cap and padding
would never show. Here each provider's `generate` calls get lengths drawn from a profile and
enforced with EOS at exactly the drawn length (and never before), so every provider does the
same work: the same lengths, in the same order, step after step.

    fixed      every completion is `cap` tokens (EOS suppressed; the last token is not EOS)
    lognormal  long-tailed, as real GRPO completions are: log-length ~ N(log(cap / 3), 0.75²),
               so the median is a third of the cap; clipped to [1, cap]; a completion drawn at
               the cap ends without EOS (truncated), as a real one would

Draws depend on (seed, call index) only: the k-th generate call of any provider gets the same
lengths. `with ForcedLengths(...).installed():` patches transformers' `GenerationMixin.generate`
while a provider runs (and restores it after) and checks every output against the draw.
"""

from __future__ import annotations

import contextlib
import math

import torch

PROFILES = ("fixed", "lognormal")
LOGNORMAL_SIGMA = 0.75


def draw_lengths(profile: str, n: int, cap: int, seed: int, call: int) -> list[int]:
    """n completion lengths in [1, cap] for generate call number `call`."""
    if profile == "fixed":
        return [cap] * n
    if profile != "lognormal":
        raise ValueError(f"length profile must be one of {PROFILES}, got {profile!r}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + call)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(cap / 3) + LOGNORMAL_SIGMA * z).round().clamp(1, cap)
    return [int(x) for x in lengths]


class ForcedLengths:
    """A logits processor: row i of the batch emits EOS exactly at completion token
    lengths[i] (if below the cap) and no EOS before it. Installed around `generate`."""

    def __init__(self, profile: str, cap: int, eos_id: int, seed: int = 0):
        self.profile, self.cap, self.eos_id, self.seed = profile, cap, eos_id, seed
        self.calls, self.history = 0, []  # drawn lengths of every call
        self._lengths, self._prompt_len = None, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores [B, V] for completion token t (from 0) = input_ids.shape[1] - prompt length
        t = input_ids.shape[1] - self._prompt_len
        lengths = self._lengths.to(scores.device)
        scores[:, self.eos_id] = float("-inf")  # never EOS before the drawn length
        # the drawn last token is EOS; a length at the cap runs out without one (truncated)
        forced = (lengths == t + 1) & (lengths < self.cap)
        if bool(forced.any()):
            scores[forced] = float("-inf")
            scores[forced, self.eos_id] = 0.0
        return scores

    def begin(self, batch: int, prompt_len: int) -> None:
        lengths = draw_lengths(self.profile, batch, self.cap, self.seed, self.calls)
        self.calls += 1
        self.history.append(lengths)
        self._lengths = torch.tensor(lengths)
        self._prompt_len = prompt_len

    def check(self, sequences: torch.Tensor, prompt_len: int) -> None:
        """Every row's completion ends as drawn (EOS at the drawn length, or the cap)."""
        comp = sequences[:, prompt_len:]
        for i, want in enumerate(self._lengths.tolist()):
            is_eos = (comp[i] == self.eos_id).nonzero()
            got = int(is_eos[0]) + 1 if len(is_eos) else comp.shape[1]
            if want < self.cap and got != want or want >= self.cap and len(is_eos):
                raise RuntimeError(f"completion {i} ended at {got} tokens, drawn {want}: the "
                                   "forced lengths did not take effect")

    @contextlib.contextmanager
    def installed(self):
        """GenerationMixin.generate patched to force the lengths, inside the block."""
        from transformers import GenerationMixin, LogitsProcessorList

        original = GenerationMixin.generate
        forcing = self

        def generate(model, *args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            forcing.begin(ids.shape[0], ids.shape[1])
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(forcing)
            kwargs.setdefault("max_new_tokens", forcing.cap)
            kwargs["min_new_tokens"] = 0  # the processor decides where EOS goes
            out = original(model, *args, logits_processor=processors, **kwargs)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            forcing.check(sequences, ids.shape[1])
            return out

        GenerationMixin.generate = generate
        try:
            yield self
        finally:
            GenerationMixin.generate = original
