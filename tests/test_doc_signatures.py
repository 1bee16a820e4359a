"""The table of functions in docs/integrations.md gives the real signatures: each documented
parameter exists, in the documented order and kind (positional, or keyword-only after `*`),
with the documented default, and no parameter of these functions goes unmentioned."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import grpo_kernels as gk
from grpo_kernels.params import FIELD_NAMES

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
_CALL = re.compile(r"`(\w+)\(([^`]*?)\)(?:\(([^`]*)\))?`")


def _table() -> str:
    text = DOC.read_text()
    start = text.index("## The functions")
    return text[start:text.index("\n\n", text.index("| function", start))]


def _documented():
    """{name: [(params text, callable), ...]} for the table's calls written out in full."""
    calls = {}
    first_cells = [row.split(" | ")[0] for row in _table().splitlines() if row.startswith("| `")]
    for match in _CALL.finditer("\n".join(first_cells)):  # the function column only
        name, first, second = match.groups()
        obj = getattr(gk, name, None)
        if obj is None or "..." in first or "..." in (second or ""):
            continue  # `grpo_loss(logits, ..., inplace=False)`: an abbreviation
        if second is not None:  # `Module(constructor)(forward)`
            calls.setdefault(name, []).extend([(first, obj), (second, obj.forward)])
        else:
            calls.setdefault(name, []).append((first, obj))
    return calls


def _params(text: str):
    """[(name, kind, default source | None)] of a documented parameter list."""
    args = ast.parse(f"def f({text}): pass").body[0].args
    out = []
    positional = args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    for arg, default in zip(positional, defaults):
        out.append((arg.arg, "positional", None if default is None else ast.unparse(default)))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append((arg.arg, "keyword", None if default is None else ast.unparse(default)))
    if args.kwarg is not None:
        out.append((args.kwarg.arg, "**", None))
    return out


def _real(fn):
    sig = inspect.signature(fn)
    out = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        kind = "keyword" if p.kind is p.KEYWORD_ONLY else "positional"
        default = None if p.default is p.empty else repr(p.default)
        out.append((p.name, kind, default))
    return out


def test_the_table_has_the_calls():
    assert {"fused_linear_grpo_loss", "FusedLinearGRPOLoss", "selective_logprobs",
            "logprobs_from_logits"} <= set(_documented())


@pytest.mark.parametrize("name", sorted(_documented()))
def test_documented_signature_is_the_real_one(name):
    table = _table()
    for text, fn in _documented()[name]:
        real = {p[0]: p for p in _real(fn)}
        doc = _params(text)
        for pname, kind, default in doc:
            if kind == "**":  # `**hyperparameters`: the GRPOParams fields
                assert pname == "hyperparameters" and set(FIELD_NAMES) <= set(real), name
                continue
            assert pname in real, f"{name}: documented {pname!r} is no parameter of {fn}"
            assert real[pname][1:] == (kind, None if default is None else repr(
                ast.literal_eval(default))), (name, pname, real[pname], kind, default)
        order = [p[0] for p in doc if p[1] == "positional"]
        assert order == [p[0] for p in _real(fn) if p[1] == "positional"][:len(order)], name
        missing = [p for p in real if p not in table and p not in FIELD_NAMES]
        assert not missing, f"{name}: parameters the table never mentions: {missing}"


def test_semantics_hyperparameter_defaults_are_the_real_ones():
    """docs/semantics.md's Hyperparameters table: every keyword of fused_linear_grpo_loss it
    lists has its real default ("None (= epsilon_low)" reads as None)."""
    text = (DOC.parent / "semantics.md").read_text()
    start = text.index("## Hyperparameters")
    rows = [r for r in text[start:text.index("\n## ", start + 1)].splitlines()
            if r.startswith("| `")]
    real = {p.name: p.default for p in
            inspect.signature(gk.fused_linear_grpo_loss).parameters.values()}
    seen = set()
    for row in rows:
        names_cell, default_cell = row.split(" | ")[:2]
        names = re.findall(r"`(\w+)`", names_cell)
        defaults = [d.strip().split(" (")[0].strip("`") for d in default_cell.split(",")]
        assert len(names) == len(defaults), row
        for name, default in zip(names, defaults):
            assert name in real, f"semantics.md lists {name!r}, no keyword of the loss"
            assert ast.literal_eval(default) == real[name], (name, default, real[name])
            seen.add(name)
    assert set(FIELD_NAMES) <= seen, set(FIELD_NAMES) - seen
