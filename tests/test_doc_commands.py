"""The docs' command lines, links and the trainer's option table agree with the code.

- Every command line of README.md and docs/*.md (inline code and fenced blocks, continuation
  lines joined) that runs one of this project's command-line tools (`python -m grpo_train`,
  `grpo-train`, `torchrun ... -m grpo_train`, `python -m benchmarks[.name]`,
  `python benchmarks/name.py`, `python examples/name.py`, `python -m
  grpo_kernels.compile_check`) uses only that tool's flags. The benchmarks' and examples' flags
  are read from their source with `ast` (the `add_argument` calls), grpo_train's from its own
  parser; nothing is run.
- Every relative Markdown link resolves to a file, and a `#fragment` into a Markdown file to one
  of its headings (GitHub's slugs).
- docs/trainer.md's "All options" table lists every flag of `grpo-train --help`, each with the
  TrainConfig default (`auto` for the fields resolved at start).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_TOOL = re.compile(r"(?:python3? -m |(?:torchrun|accelerate launch)\b[^`|;#]*?-m |python3? )"
                   r"((?:benchmarks|examples)/\w+\.py|"
                   r"(?:grpo_train|benchmarks(?:\.\w+)?|grpo_kernels\.compile_check)\b)"
                   r"|\bgrpo-train\b")
_FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+\s+(.*)$", re.MULTILINE)
_FENCED = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.MULTILINE | re.DOTALL)


def _source_flags(path: Path) -> set[str]:
    """The long flags of every `add_argument` call in a file (underscored)."""
    flags = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value[2:].replace("-", "_") for a in node.args
                      if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags | {"help"}


def _train_flags() -> set[str]:
    from grpo_train.cli import build_parser

    flags = set()
    for action in build_parser()._actions:
        flags |= {s[2:] for s in action.option_strings if s.startswith("--")}
    # booleans also take --no_flag
    bools = {f.name for f in dataclasses.fields(_config()) if f.type in (bool, "bool")}
    return flags | {f"no_{name}" for name in bools}


def _config():
    from grpo_train.config import TrainConfig

    return TrainConfig


def _tool_flags(tool: str) -> set[str] | None:
    """The flags of a tool named as the command line names it (None: not one of ours)."""
    if tool in ("grpo_train", "grpo-train"):
        return _train_flags()
    if tool == "grpo_kernels.compile_check":
        return _source_flags(REPO / "grpo_kernels" / "compile_check" / "check.py")
    if tool == "benchmarks":
        return _source_flags(REPO / "benchmarks" / "__main__.py")
    path = REPO / (tool if tool.endswith(".py") else tool.replace(".", "/") + ".py")
    return _source_flags(path) if path.is_file() else None


def _command_lines(path: Path):
    """(line number, text) of each line, continuation lines (ending in \\) joined."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        i += 1
        yield start + 1, text


def _commands():
    """(doc:line, tool, [flags]) of every command line that runs one of our tools."""
    for doc in DOCS:
        for number, text in _command_lines(doc):
            for match in _TOOL.finditer(text):
                tool = match.group(1) or "grpo-train"
                rest = re.split(r"`|\||;|&&|#|\)", text[match.end():])[0]
                yield (f"{doc.relative_to(REPO)}:{number}", tool,
                       [f.replace("-", "_") for f in _FLAG.findall(rest)])


def test_the_commands_are_found():
    found = {(where.split(":")[0], tool) for where, tool, _ in _commands()}
    assert ("README.md", "grpo_train") in found
    assert ("docs/trainer.md", "benchmarks.generation") in found
    assert ("docs/benchmarks.md", "benchmarks/ab_cpu.py") in found
    assert ("docs/compatibility.md", "grpo_kernels.compile_check") in found


def test_documented_command_lines_use_real_flags():
    cache, wrong = {}, []
    for where, tool, flags in _commands():
        if tool not in cache:
            cache[tool] = _tool_flags(tool)
        known = cache[tool]
        if known is None:
            wrong.append(f"{where}: {tool}: no such command-line tool")
            continue
        wrong += [f"{where}: {tool} has no flag --{f}" for f in flags if f not in known]
    assert not wrong, "\n".join(wrong)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_markdown_links_resolve():
    anchors = {doc: {_slug(h) for h in _HEADING.findall(_FENCED.sub("", doc.read_text()))}
               for doc in DOCS}
    broken = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in _LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                path, _, fragment = target.partition("#")
                file = (doc.parent / path).resolve() if path else doc
                where = f"{doc.relative_to(REPO)}:{number}: {target}"
                if not file.exists():
                    broken.append(f"{where}: no such file")
                elif fragment and file.suffix == ".md" and fragment not in anchors.get(
                        file, {_slug(h) for h in _HEADING.findall(file.read_text())}):
                    broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)


def _options_table() -> list[tuple[list[str], list[str]]]:
    text = (REPO / "docs" / "trainer.md").read_text()
    start = text.index("### All options")
    rows = []
    for row in text[start:text.index("\n### ", start + 1)].splitlines():
        if row.startswith("| `--"):
            names_cell, default_cell = row.split(" | ")[:2]
            names = re.findall(r"`--(\w+)", names_cell)
            defaults = [d.strip() for d in default_cell.split(",")] if len(names) > 1 else [
                default_cell.strip()]
            rows.append((names, defaults))
    return rows


def _matches(doc: str, name: str, default) -> bool:
    """Does the table's default cell text `doc` state TrainConfig's `default` of `name`?"""
    from grpo_train.config import AUTO, RESOLVED_LATER

    word = doc.split(" (")[0].strip('"')
    if name in AUTO or name in RESOLVED_LATER:
        return word == "auto"
    if isinstance(default, bool):
        return word == ("on" if default else "off")
    if default is None:
        return word == "none"
    if isinstance(default, (int, float)):
        try:
            return float(word) == default
        except ValueError:
            return False
    if isinstance(default, list):
        return word == " ".join(default)
    return word == str(default)


def test_trainer_options_table_has_every_flag_and_its_default():
    fields = {f.name: f for f in dataclasses.fields(_config())}
    rows = _options_table()
    listed = [name for names, _ in rows for name in names]
    wrong = [f"--{name}: no such flag" for name in listed
             if name not in fields and name not in ("config", "debug", "version")]
    wrong += [f"--{name}: missing from the table" for name in fields if name not in listed]
    for names, defaults in rows:
        if len(names) != len(defaults):
            wrong.append(f"{names}: {len(defaults)} defaults for {len(names)} flags")
            continue
        for name, doc in zip(names, defaults):
            field = fields.get(name)
            if field is None:
                continue
            default = (field.default_factory() if field.default is dataclasses.MISSING
                       else field.default)
            if not _matches(doc, name, default):
                wrong.append(f"--{name}: the table says {doc!r}, TrainConfig {default!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, flags", [
    ("`python -m benchmarks --quick --bogus`", ["quick", "bogus"]),
    ("torchrun --nproc_per_node 2 -m grpo_train --tp_size 2", ["tp_size"]),
])
def test_the_flag_reader_sees_what_follows_the_tool(text, flags):
    """A positive control of `_commands`' parsing: the launcher's own flags are not the tool's."""
    match = _TOOL.search(text)
    rest = re.split(r"`|\||;|&&|#|\)", text[match.end():])[0]
    assert [f.replace("-", "_") for f in _FLAG.findall(rest)] == flags
