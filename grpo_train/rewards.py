"""Reward functions, their loading from `--reward` specs, scoring, and group-normalized advantages.

A reward function has TRL's signature `f(prompts, completions, **columns) -> list[float | None]`
and is called with keywords, as TRL calls it (so `f(completions, **kwargs)` works too):
`completions` is a list of strings (P·G, grouped contiguously), `prompts` the dataset's prompts
aligned with them (strings, or lists of chat messages), `columns` every other dataset column as
a list aligned with them (`answer` among them) plus `completion_ids` (lists of token ids). None
means "cannot score this one".
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch

from .flags import UsageError

# ---- answer extraction and comparison -----------------------------------------------------------

# A number as written: thousands separators only in groups of three ("1,234", never "1,2" or
# "3, 4"), a decimal part, an exponent of at most three digits ("1e3"; a longer one would build
# a huge integer) and a "/denominator". Its sign only where no digit, letter or bracket stands
# before the minus: "3-4" is 3 and 4, "x = -4" is -4.
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d{1,3}(?!\d))?"
_NUMBER = re.compile(rf"(?<![\d.])(?:(?<![A-Za-z0-9_)\]}}])-)?(?:{_DIGITS}|\.\d+)(?:/\d+)?")
_SIGNED = r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?"
_RATIO = re.compile(rf"({_SIGNED})(?:/({_SIGNED}))?")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last \\boxed{}, else the last <answer>...</answer>,
    else what follows the last "####", else the last number in the text; None if none. Unicode
    minus signs read as "-"."""
    text = text.translate(_MINUS_SIGNS)
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _plain(text: str) -> str:
    """An answer as models write it, less its LaTeX dressing: "\\$1{,}000" -> "$1,000",
    "42 \\text{ dollars}" -> "42 dollars", "\\frac12" -> "1/2", "90^\\circ" -> "90"."""
    s = re.sub(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}", r" \1", text)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    s = s.replace("{,}", ",").replace("\\,", ",").replace("\\$", "$").replace("\\%", "%")
    return re.sub(r"\^\s*\{?\\circ\}?|\u00b0", "", s.replace("\\!", "")).strip()


def parse_number(text: str) -> Fraction | None:
    """"1,234" / "-0.5" / "1/2" / "$42" / "42%" / "42." / "1e3" / "\\frac{1}{2}" / "x = 5" /
    "5 apples" -> Fraction; None for anything else ("3, 4", "1,2", "1 2", "5x", "1e999").

    A percent sign is dropped, not divided by: "50%" is 50, as GSM8K writes its answers. Unit
    words after a space go ("42 dollars"), and so does a one-letter variable ("x = 5")."""
    s = _plain(text.translate(_MINUS_SIGNS)).rstrip(".").strip().strip("$%").strip()
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)  # "x = 5"
    s = re.sub(r"(?<=\d)\s+[A-Za-z][A-Za-z .]*$", "", s)  # "5 apples", "12 km."
    s = s.strip().strip("$%").strip()
    s = re.sub(r"^([-+])\s+", r"\1", re.sub(r"\s*/\s*", "/", s)).rstrip(".")
    match = _RATIO.fullmatch(s)
    if match is None:
        return None
    try:
        num, den = (Fraction(g.replace(",", "")) if g else None for g in match.groups())
        return num if den is None else num / den
    except (ValueError, ZeroDivisionError):  # 1/0; digits beyond Python's int parsing limit
        return None


def answers_match(predicted: str | None, truth: str) -> bool:
    """Numbers compare exactly as fractions ("0.5" == "1/2" == "1,000/2000"); other strings
    compare after stripping whitespace and case."""
    if predicted is None or not truth.strip():  # a blank truth is none: "" is no answer
        return False
    p, t = parse_number(predicted), parse_number(truth)
    if p is not None and t is not None:
        return p == t
    return predicted.strip().lower() == truth.strip().lower()


# ---- built-in reward functions ------------------------------------------------------------------


def accuracy(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1.0 if the completion's final answer equals the ground truth, else 0.0 (None: no truth,
    a missing or blank one)."""
    if answer is None:
        return [None] * len(completions)
    return [None if truth is None or not str(truth).strip()
            else float(answers_match(extract_answer(c), str(truth)))
            for c, truth in zip(completions, answer)]


_UNTAGGED = r"(?:(?!</?think>|</?answer>).)*"  # text holding none of the four tags
_FORMAT = re.compile(rf"^\s*<think>{_UNTAGGED}</think>\s*<answer>{_UNTAGGED}</answer>\s*$",
                     re.DOTALL)


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 if the completion is one "<think>...</think>" then one "<answer>...</answer>" (white
    space around them allowed, no other tag inside), else 0.0."""
    return [float(bool(_FORMAT.match(c))) for c in completions]


BUILTIN = {"accuracy": accuracy, "format": format_reward}


# ---- --reward specs ----------------------------------------------------------------------------


@dataclass
class RewardSpec:
    name: str
    fn: Callable
    weight: float = 1.0


def _import_function(target: str, spec: str) -> Callable:
    module_name, _, fn_name = target.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no such file {module_name!r}")
            name = "grpo_user_reward_" + re.sub(r"\W", "_", os.path.abspath(module_name))
            loader_spec = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module  # importable by name in the other processes' pickles
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, fn_name)
    except Exception as err:  # noqa: BLE001 - any import failure is the spec's fault
        raise UsageError(
            f"--reward {spec!r}: cannot import {fn_name!r} from {module_name!r} "
            f"({type(err).__name__}: {err}). Expected a built-in {sorted(BUILTIN)} or "
            "'module:function[:weight]' / 'path/to/file.py:function[:weight]'"
        ) from err
    if not callable(fn):
        raise UsageError(f"--reward {spec!r}: {module_name}:{fn_name} is not callable")
    return fn


def parse_reward_spec(spec: str) -> RewardSpec:
    """"accuracy", "format:0.5", "my_pkg.rewards:length:0.1", "rewards.py:fn" -> RewardSpec."""
    target, weight = spec, 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            weight = float(tail)
            target = head
        except ValueError:
            pass
    if not math.isfinite(weight):
        raise UsageError(f"--reward {spec!r}: weight must be finite")
    if target in BUILTIN:
        return RewardSpec(target, BUILTIN[target], weight)
    if ":" not in target:
        raise UsageError(f"--reward {spec!r}: unknown built-in; expected one of {sorted(BUILTIN)} "
                         "or 'module:function[:weight]'")
    return RewardSpec(target.rpartition(":")[2], _import_function(target, spec), weight)


def _as_list(returned, n: int) -> list:
    """A reward function's result as a list: a list, tuple, tensor, array or other iterable of
    rewards; a scalar, None, string or dict is the function's error."""
    if isinstance(returned, torch.Tensor):
        return returned.detach().float().cpu().tolist()
    if hasattr(returned, "tolist") and getattr(returned, "ndim", 0) > 0:  # numpy
        return returned.tolist()
    if isinstance(returned, (str, bytes, dict)) or not hasattr(returned, "__iter__"):
        raise ValueError(f"returned a {type(returned).__name__}; expected a list of {n} "
                         "rewards, one per completion")
    return list(returned)


def _numbers(values: list, n: int) -> list[float | None]:
    """A function's rewards as floats, None kept (unscored). A value that is neither None nor a
    number (bool, int, float, NumPy scalar, one-element tensor) is the function's error, named
    with its type: a string too, even "1.0" (TRL turns rewards into a tensor, which refuses it)."""
    out, wrong = [], []
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, (str, bytes, bytearray)):
            try:
                v = float(v)
            except (TypeError, ValueError):
                wrong.append(i)
        elif v is not None:
            wrong.append(i)
        out.append(v)
    if wrong:
        i = wrong[0]
        raise TypeError(f"returned a {type(values[i]).__name__} ({values[i]!r:.30}) for "
                        f"completion {i} ({len(wrong)} of {n} not numbers); expected a number "
                        "or None (unscored) per completion")
    return out


def score(specs: list[RewardSpec], prompts: list[str], completions: list[str],
          columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, int]]:
    """Rewards [N, F] float32 (NaN = unscored) and, per function, how many it could not score.

    A function that raises, or returns something other than a list of numbers and None,
    leaves all its rewards NaN for this batch (counted under "name: Error: message"); the run
    goes on. A None leaves its completion unscored (counted under the function's name), and so
    does an infinite or NaN value (counted apart): an infinite reward would turn its whole
    group's advantages into NaN, and so into 0, while the step's reward read inf.
    """
    n = len(completions)
    out = torch.full((n, len(specs)), float("nan"))
    failures: dict[str, int] = {}
    for j, spec in enumerate(specs):
        try:
            # by keyword, as TRL calls them: `f(completions, **kwargs)` is a common form
            values = _as_list(spec.fn(prompts=prompts, completions=completions, **columns), n)
            if len(values) != n:
                raise ValueError(f"returned {len(values)} rewards for {n} completions")
            values = _numbers(values, n)
        except Exception as err:  # noqa: BLE001 - a reward bug must not kill a long run
            failures[f"{spec.name}: {type(err).__name__}: {err}"[:200]] = n
            continue
        bad = non_finite = 0
        for i, v in enumerate(values):
            if v is None:
                bad += 1
            elif not math.isfinite(v):
                non_finite += 1
            else:
                out[i, j] = v
        if bad:
            failures[spec.name] = bad
        if non_finite:
            failures[f"{spec.name}: non-finite rewards (inf or NaN)"] = non_finite
    return out, failures


def explain_none(failures: dict[str, int], said: set[str]) -> str | None:
    """One line the first time in a run that a reward function returns None (a key of
    `score`'s failures without ": "), saying what the trainer does with it; None when every
    such function was explained already (`said`, updated)."""
    names = [k for k in failures if ": " not in k and k not in said]
    if not names:
        return None
    said.update(names)
    why = " (accuracy returns it for a row without an answer)" if "accuracy" in names else ""
    return (f"note: {', '.join(names)} returned None for some completions: None means the "
            f"function cannot score that completion{why}, which is then unscored (advantage 0, "
            "as in TRL); each step's warning line counts them, and --max_unscored_steps stops a "
            "run in which no completion at all is scored")


class RewardsFailedError(UsageError, RuntimeError):
    """--max_unscored_steps consecutive steps without a single scored completion: the reward
    functions are broken (or their server is down), and training on all-zero advantages would
    only spend compute. A UsageError, so the command line prints one line and exits with 2."""


def rewards_failed(failures: dict[str, int], steps: int, last_step: int, n: int,
                   checkpoint) -> RewardsFailedError:
    """The error that stops a run: what each reward function did at `last_step` (`score`'s
    failures over all processes: "name: Type: message" for a function that raised, "name" for
    one that returned None), out of `n` completions, and the checkpoint a resume starts from."""
    what = "; ".join(f"{key} ({count} of {n} completions)" if ": " in key
                     else f"{key} returned None for {count} of {n} completions"
                     for key, count in failures.items()) or "no function scored any completion"
    kept = (f"the last checkpoint, {checkpoint}, is kept: fix the reward and continue with "
            "--resume auto" if checkpoint else "no checkpoint was written")
    span = f"step {last_step}" if steps == 1 else f"steps {last_step - steps + 1}-{last_step}"
    return RewardsFailedError(
        f"--reward: no completion was scored in {steps} consecutive steps ({span}, "
        f"--max_unscored_steps {steps}): {what}. Stopped; {kept} "
        "(--max_unscored_steps 0 never stops)")


def combine(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, F] -> [N]: weighted sum of the scored entries; NaN where no function scored it."""
    total = (rewards_per_func * weights).nansum(dim=1)
    total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    return total


# ---- advantages ---------------------------------------------------------------------------------


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN when fewer than 2 values)."""
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims)
    sq = ((x - mean) ** 2).nansum(dim=dims)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, math.nan))
    return var.sqrt()


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale_rewards: str = "group") -> torch.Tensor:
    """docs/semantics.md advantages: rewards [P·G] grouped contiguously -> advantages [P·G].

    A = r - nanmean(group); divided by (nanstd + 1e-4) over the group ("group") or over all
    rewards ("batch"), not at all for "none"; NaN (unscored) -> 0.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group|batch|none, got {scale_rewards!r}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of "
                         f"{num_generations}")
    grouped = rewards.float().view(-1, num_generations)  # [P, G]
    adv = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (_nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    elif scale_rewards == "batch":
        adv = adv / (_nanstd(grouped.reshape(-1)) + 1e-4)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)
