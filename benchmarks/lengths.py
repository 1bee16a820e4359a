"""Completion lengths for trainer benchmarks on random-weight models.

A random model never emits EOS on its own, so every completion would run to the cap and padding
would never show. Here each provider's `generate` calls get lengths drawn from a profile and
enforced with EOS at exactly the drawn length (and never before), so every provider does the
same work: the same lengths, in the same order, step after step.

    fixed      every completion is `cap` tokens (EOS suppressed: truncated at the cap)
    lognormal  long-tailed, as real GRPO completions are: log-length ~ N(log(cap / 3), 0.75²),
               so the median is a third of the cap; clipped to [1, cap]; a completion drawn at
               the cap ends without EOS (truncated), as a real one would

Draws depend on (seed, draw index) only: the k-th timed generate call of any provider gets the
same lengths. Warm-up calls replay the timed calls' draws (warm-up call k draws those of timed
call k mod the timed calls), so a warm-up sees the shapes the timed steps will run: kernels are
compiled and allocator pools sized for them, not for other lengths. grpo_train takes them
through its `forced_lengths` hook; for TRL, `with ForcedLengths(...).installed():` patches
transformers' `GenerationMixin.generate` while it runs (restored after) and checks every output
against the draw.
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
    """The profile's draws, one list per generate call (`history`), and two ways to enforce
    them: `draw(B)` is grpo_train's `forced_lengths` hook (both of its generation paths);
    `installed()` patches transformers' `GenerationMixin.generate` (TRL's generation) with
    grpo_train's own logits processor. A draw at the cap becomes cap + 1 for both, i.e. a
    completion truncated at the cap without EOS."""

    def __init__(self, profile: str, cap: int, eos_id: int, seed: int = 0, warmup: int = 0,
                 timed: int = 1):
        if warmup < 0 or timed < 1:
            raise ValueError(f"warmup must be >= 0 and timed >= 1, got {warmup} and {timed}")
        self.profile, self.cap, self.eos_id, self.seed = profile, cap, eos_id, seed
        self.warmup, self.timed = warmup, timed
        self.history: list[list[int]] = []  # the drawn lengths of every call

    def draw_index(self, call: int) -> int:
        """Which draw generate call `call` gets: warm-up calls replay the timed calls'."""
        return call - self.warmup if call >= self.warmup else call % self.timed

    def draw(self, batch: int) -> list[int]:
        lengths = draw_lengths(self.profile, batch, self.cap, self.seed,
                               self.draw_index(len(self.history)))
        self.history.append(lengths)
        return [n if n < self.cap else self.cap + 1 for n in lengths]

    def check(self, sequences: torch.Tensor, prompt_len: int) -> None:
        """Every row of the latest call ends as drawn (EOS at the drawn length, or none)."""
        comp = sequences[:, prompt_len:]
        for i, want in enumerate(self.history[-1]):
            is_eos = (comp[i] == self.eos_id).nonzero()
            got = int(is_eos[0]) + 1 if len(is_eos) else comp.shape[1]
            if got != want or (want >= self.cap) != (len(is_eos) == 0):
                raise RuntimeError(f"completion {i} ended at {got} tokens, drawn {want}: the "
                                   "forced lengths did not take effect")

    def synthetic(self, prompt_ids: torch.Tensor, pad_id: int, vocab: int) -> torch.Tensor:
        """[B, P + n] sequences as generate returns them, without running a model: random tokens
        of the next draw's lengths (EOS last unless truncated at the cap), pad_id after, n the
        longest completion. Tokens avoid EOS and pad_id, and depend on (seed, call) only."""
        lengths = self.draw(prompt_ids.shape[0])  # cap + 1: truncated at the cap, no EOS
        n = min(max(lengths), self.cap)
        g = torch.Generator().manual_seed(self.seed * 1_000_003
                                          + self.draw_index(len(self.history) - 1) + 8)
        plain = torch.tensor([i for i in range(vocab) if i not in (self.eos_id, pad_id)])
        tokens = plain[torch.randint(0, len(plain), (len(lengths), n), generator=g)]
        for i, length in enumerate(lengths):
            if length <= self.cap:
                tokens[i, length - 1] = self.eos_id
                tokens[i, length:] = pad_id
        return torch.cat([prompt_ids, tokens.to(prompt_ids.device)], dim=1)

    @contextlib.contextmanager
    def installed(self, synthetic: bool = False):
        """GenerationMixin.generate patched to force the lengths, inside the block; synthetic:
        to return `synthetic` sequences instead of running the model."""
        from transformers import GenerationMixin, LogitsProcessorList

        from grpo_train.length_forcing import EosSchedule

        original = GenerationMixin.generate
        forcing = self

        def generate(model, *args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if synthetic:
                config = kwargs.get("generation_config") or model.generation_config
                pad = config.pad_token_id if config.pad_token_id is not None else forcing.eos_id
                out = forcing.synthetic(ids, pad, model.config.get_text_config().vocab_size)
                forcing.check(out, ids.shape[1])
                return out
            lengths = torch.tensor(forcing.draw(ids.shape[0]))
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(EosSchedule(lengths, [forcing.eos_id], ids.shape[1]))
            kwargs["min_new_tokens"] = 0  # the schedule decides where EOS goes
            out = original(model, *args, logits_processor=processors, **kwargs)
            forcing.check(out if isinstance(out, torch.Tensor) else out.sequences, ids.shape[1])
            return out

        GenerationMixin.generate = generate
        try:
            yield self
        finally:
            GenerationMixin.generate = original
