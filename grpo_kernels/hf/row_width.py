"""The width W of packed rows for Hugging Face causal LMs (`packed_rows.py`,
`shared_prompt.py`): sequences of given lengths are placed first fit, longest first
(`first_fit`), in rows whose width `choose_row_width` picks for the model's attention.

W comes from the model's config and is a multiple of 16:
- flash implementations work on the sequences themselves: one row holding everything, which is
  also the only layout where they find the boundaries from position_ids alone;
- sdpa builds a dense [R, 1, W, W] mask and spends work on all R·W² position pairs, so W is
  chosen by a cost rule: a layer's forward + backward costs about a·R·W + b·R·W², positions
  times a position's dense work plus pairs times a pair's attention work. b / a is the ratio of
  a pair's attention FLOPs (4 · heads · head_dim) to a position's dense FLOPs (2 · a layer's
  parameters): 1.20e-4 for Qwen2.5-0.5B, where `python -m benchmarks.row_cost` measured
  1.21e-4 on a 2-core AMD EPYC (torch 2.13, transformers 5.24). The narrowest width for each
  row count, from the longest sequence's (rounded) down to one row, is priced with its
  first-fit row count, and the cheapest is taken; the search stops once the real tokens alone
  at the next width would cost more than the best so far;
- eager materializes [R, heads, W, W] attention weights in float32: rows as narrow as the
  longest sequence (rounded to 16), as for implementations this module does not know.
Without a config the narrow rows are used (`row_width_rule`: `RowWidthRule` ONE_ROW, COST,
NARROW). The rounding is for the attention kernels: CPU sdpa took 2.6x longer on rows of 15
positions than of 16 (512 rows, 4 heads of 16, one thread, torch 2.13).
"""

from __future__ import annotations

from enum import Enum

from .unwrap import config_size, text_config

__all__ = ["RowWidthRule", "choose_row_width", "first_fit", "pair_cost", "row_width_rule",
           "takes_boundaries"]


def first_fit(lengths: list[int], width: int) -> tuple[list[int], list[int], list[int]]:
    """First fit, longest first, of sequences of `lengths` [S] real tokens into rows of `width`:
    (row [S], offset [S]) of every sequence and each row's used length [R]."""
    free: list[int] = []
    row, offset = [0] * len(lengths), [0] * len(lengths)
    for s in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((i for i, f in enumerate(free) if f >= lengths[s]), len(free))
        if r == len(free):
            free.append(width)
        row[s], offset[s] = r, width - free[r]
        free[r] -= lengths[s]
    return row, offset, [width - f for f in free]


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def pair_cost(config) -> float | None:
    """b / a of the module docstring for a transformers config: a position pair's attention
    FLOPs over a position's dense FLOPs in one decoder layer; None if the config lacks the
    sizes (hidden_size, num_attention_heads, intermediate_size)."""
    text = text_config(config)
    D, H, F = (config_size(text, n)
               for n in ("hidden_size", "num_attention_heads", "intermediate_size"))
    if not all(isinstance(x, int) and x > 0 for x in (D, H, F)):
        return None
    hd = config_size(text, "head_dim") or D // H
    kv = config_size(text, "num_key_value_heads") or H
    layer_params = D * hd * (2 * H + 2 * kv) + 3 * D * F  # q, o, k, v projections; gated MLP
    return 4 * H * hd / (2 * layer_params)


class RowWidthRule(str, Enum):
    """How wide packed rows are for an attention implementation (module docstring): one row
    holding everything (flash), the cost rule (sdpa) or as narrow as the longest sequence."""

    ONE_ROW = "one_row"
    COST = "cost"
    NARROW = "narrow"


def row_width_rule(config) -> RowWidthRule:
    """The width rule for the config's attention: ONE_ROW (flash), COST (sdpa, a config with
    the sizes `pair_cost` needs) or NARROW (eager, unknown implementations, no config)."""
    impl = str(getattr(config, "_attn_implementation", None) or "")
    if "flash" in impl:  # flash_attention_2/3 and Hub kernels named after flash attention
        return RowWidthRule.ONE_ROW
    if impl == "sdpa" and pair_cost(config) is not None:
        return RowWidthRule.COST
    return RowWidthRule.NARROW


def takes_boundaries(config) -> bool:
    """Whether packed rows under the config's attention are handed their sequence boundaries
    (`packed_rows.boundaries_of`): flash implementations, whose rows are ONE_ROW."""
    return row_width_rule(config) is RowWidthRule.ONE_ROW


def choose_row_width(lengths: list[int], config=None) -> int:
    """W for sequences of `lengths` real tokens under the config's attention (module
    docstring); at least the longest sequence."""
    if not len(lengths) or min(lengths) < 0:  # max() of none failed as "an empty sequence"
        raise ValueError(f"lengths must be one or more sequence lengths >= 0, got {lengths!r}")
    longest, total = max(lengths), sum(lengths)
    rule = row_width_rule(config)
    if rule is RowWidthRule.ONE_ROW:
        return total
    if rule is RowWidthRule.NARROW:
        return _round16(longest)
    ratio = pair_cost(config)

    def cost(width: int) -> tuple[float, int]:  # (in positions' dense work, rows used)
        rows = len(first_fit(lengths, width)[2])
        return rows * width * (1 + ratio * width), rows

    best_width = _round16(longest)  # the narrow rows: the most rows any width needs
    best_cost, narrow_rows = cost(best_width)
    for rows in range(narrow_rows - 1, 0, -1):  # fewer, wider rows
        width = _round16(max(longest, -(-total // rows)))
        # rows · W >= total, so no width from here on (they only grow) can cost less than this
        if total * (1 + ratio * width) >= best_cost:
            break
        price, used = cost(width)
        for _ in range(8):  # first fit may need a little slack over total / rows
            if used <= rows:
                break
            width += 16
            price, used = cost(width)
        if price < best_cost:
            best_cost, best_width = price, width
    return best_width
