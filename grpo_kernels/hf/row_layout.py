"""The row layout of a batch: how its rows reach the model body (padded, packed or shared; see
`row_plan.py`, where the layout is chosen). A name given as a string (a command-line flag, a
results row) becomes a `RowLayout` through `parse_row_layout`, the one place that reads the
names; everything else compares members.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ROW_LAYOUTS", "RowLayout", "parse_row_layout"]


class RowLayout(str, Enum):
    """How a batch's rows reach the model body (module docstring). A member is its name as a
    string: it equals it, and prints it in log lines, JSON and CSV rows."""

    PADDED = "padded"
    PACKED = "packed"
    SHARED = "shared"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ROW_LAYOUTS = tuple(layout.value for layout in RowLayout)  # the names, e.g. for argparse choices


def parse_row_layout(value, argument: str = "layout") -> RowLayout:
    """The RowLayout a name stands for ("padded", "packed" or "shared"; a member passes as it
    is); a ValueError naming `argument` and the accepted names otherwise."""
    try:
        return RowLayout(value)
    except ValueError:
        raise ValueError(f"{argument} must be one of {', '.join(ROW_LAYOUTS)}, got "
                         f"{value!r}") from None
