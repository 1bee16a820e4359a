"""The names of this project's code that the docs and docstrings give in backticks exist.

Where the names are collected: docs/*.md and README.md (fenced code blocks left out), and every
docstring (module, class, function) of the modules under grpo_kernels/ and grpo_train/, read
with `ast` (nothing is imported to collect them). A name is the text between single backticks
on one line.

Which names are checked, and how:

1. A dotted name that starts with `grpo_kernels`, `grpo_train` or `benchmarks` (what comes after
   the dotted part, such as a call's arguments or `.*`, is ignored): the longest prefix that
   imports is imported, and the rest must be attributes, one getattr after another.
2. A path that starts with one of the repository's top-level folders (grpo_kernels/,
   grpo_train/, benchmarks/, tests/, docs/, examples/, .ci/) and contains nothing but the
   characters of a path: it must exist; a `*` in it is a glob that must match something, and
   `file.py::name` must also define (or assign) `name` in that file.
3. A relative name, in a docstring: a dotted name or a path whose first part is a module, a
   package or a file beside the docstring's module or beside one of the packages above it. So
   `grpo_math.policy_loss` in grpo_kernels/loss_call.py is checked as rule 1 checks
   `grpo_kernels.grpo_math.policy_loss`, and `launch.py` in grpo_kernels/ops/ as the path
   grpo_kernels/ops/launch.py. In the docs, relative names are read the same way from the
   grpo_kernels package (the package they describe). A first part that is also the name of an
   installed top-level module is read as that module's (`trl.GRPOTrainer` is TRL's class).
4. A file name ending in `.py` is always this project's: in a docstring it must exist beside
   the module or one of the packages above it, in the docs in the repository root or in
   grpo_kernels/.

Everything else (`torch.compile`, `model.generate`, a dotted name whose first part is no module
of this project) is someone else's name, or a variable's, and is not checked. So a reference
to a deleted module is caught in its full form (`grpo_kernels.x.y`) or as a `.py` file, not as
a relative dotted name.

KNOWN_STALE lists the references that do not resolve yet, each to be fixed; every other
reference must resolve.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT_PACKAGES = ("grpo_kernels", "grpo_train", "benchmarks")
TOP_FOLDERS = ("grpo_kernels", "grpo_train", "benchmarks", "tests", "docs", "examples", ".ci")
DOCSTRING_PACKAGES = ("grpo_kernels", "grpo_train")

# (file, name) pairs that do not resolve yet. Each one is stale and must be fixed in its file,
# then removed from here: the test fails for an entry that resolves or is no longer referenced.
KNOWN_STALE: set[tuple[str, str]] = set()

_BACKTICKED = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_PATH = re.compile(r"[\w.*/-]+(?:::\w+)?")
_OTHER_FILE = re.compile(r"\.(md|txt|json|jsonl|png|toml|sh|yaml|yml|csv|cfg|ini)$")


# ---- collection -------------------------------------------------------------------------------


def _markdown_names(path: Path):
    """(line, backticked text) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for match in _BACKTICKED.finditer(line):
                yield number, match.group(1)


def _docstring_names(path: Path):
    """(line, backticked text) of every docstring in a Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None:
            continue
        first = node.body[0].lineno
        for match in _BACKTICKED.finditer(doc):
            yield first + doc.count("\n", 0, match.start()), match.group(1)


def _package_dirs(path: Path) -> list[Path]:
    """The folders a docstring's relative names are read from: its module's folder, then each
    package folder above it, up to the root package."""
    dirs, folder = [], path.parent
    while folder != REPO and (folder / "__init__.py").exists():
        dirs.append(folder)
        folder = folder.parent
    return dirs


def _references():
    """(source "file:line", name, check) for every name the rules above check; check() returns
    None when the name resolves, else why not."""
    sources = [(p, _markdown_names(p), [REPO / "grpo_kernels"], [REPO, REPO / "grpo_kernels"])
               for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]]
    for package in DOCSTRING_PACKAGES:
        for p in sorted((REPO / package).rglob("*.py")):
            dirs = _package_dirs(p)
            sources.append((p, _docstring_names(p), dirs, dirs))
    for path, names, relative_dirs, file_dirs in sources:
        where = path.relative_to(REPO).as_posix()
        for line, text in names:
            check = _rule_for(text.strip(), relative_dirs, file_dirs)
            if check is not None:
                yield f"{where}:{line}", text, check


def _rule_for(text: str, relative_dirs: list[Path], file_dirs: list[Path]):
    """The check of one backticked text (rules 1-4), or None if it is not this project's."""
    if "/" in text or text.endswith(".py") or "::" in text:
        if not _PATH.fullmatch(text):
            return None  # a command line or prose, not a path
        path = text.split("::")[0]
        first = path.split("/")[0]
        if first in TOP_FOLDERS and "/" in path:
            return lambda: _check_path(text, [REPO])
        if "/" not in path:  # a file name (rule 4)
            return (lambda: _check_path(text, file_dirs)) if path.endswith(".py") else None
        if _is_project_module(first.removesuffix(".py"), relative_dirs):
            return lambda: _check_path(text, relative_dirs)
        return None
    dotted = _DOTTED.match(text)
    if dotted is None or _OTHER_FILE.search(text):
        return None
    name = dotted.group(0)
    first = name.split(".")[0]
    if first in ROOT_PACKAGES:
        return lambda: _check_dotted(name)
    if "." in name and _is_project_module(first, relative_dirs):
        module = next(".".join(d.relative_to(REPO).parts) for d in relative_dirs
                      if _exists(d / first))
        return lambda: _check_dotted(f"{module}.{name}")
    return None


def _is_project_module(first: str, dirs: list[Path]) -> bool:
    """Is `first` a module, package or file in one of `dirs`, and not also an installed
    top-level module (`trl.GRPOTrainer` in a docstring means TRL's class, not
    grpo_kernels.trl's)?"""
    if not first.isidentifier() or _installed(first):
        return False
    return any(_exists(d / first) for d in dirs)


def _installed(name: str) -> bool:
    """A top-level module from outside the repository (tests/'s folders, which pytest's path
    makes importable as namespace packages, are not)."""
    spec = importlib.util.find_spec(name)
    origin = None if spec is None else spec.origin
    return origin not in (None, "namespace") and REPO not in Path(origin).resolve().parents


def _exists(stem: Path) -> bool:
    """Is there a module or package called stem (a file, stem.py or stem/__init__.py)?"""
    return stem.is_file() or stem.with_suffix(".py").is_file() or (stem / "__init__.py").is_file()


# ---- resolution -------------------------------------------------------------------------------


def _check_dotted(name: str) -> str | None:
    parts = name.split(".")
    module, error = None, None
    for end in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:end]))
            break
        except ModuleNotFoundError as exc:
            error = exc
    if module is None:
        return f"no module {parts[0]!r} ({error})"
    obj, done = module, ".".join(parts[:end])
    for part in parts[end:]:
        if not hasattr(obj, part):
            return f"{done} has no attribute {part!r}"
        obj, done = getattr(obj, part), f"{done}.{part}"
    return None


def _check_path(text: str, dirs: list[Path]) -> str | None:
    path, _, member = text.partition("::")
    for d in dirs:
        found = sorted(d.glob(path)) if "*" in path else [d / path] if (d / path).exists() else []
        if not found:
            continue
        if member and not re.search(rf"^\s*(def|class)\s+{member}\b|^{member}\s*[:=]",
                                    found[0].read_text(), re.MULTILINE):
            return f"{found[0].relative_to(REPO)} defines no {member!r}"
        return None
    return "no such path under " + ", ".join(d.relative_to(REPO).as_posix() or "." for d in dirs)


# ---- the test ---------------------------------------------------------------------------------


def test_the_collection_finds_the_references_it_should():
    """The rules see the kinds of names the docs use (a guard against a rule that silently
    matches nothing)."""
    found = {(where.split(":")[0], name) for where, name, _ in _references()}
    assert ("docs/testing.md", "tests/conftest.py") in found
    assert ("docs/semantics.md", "grpo_kernels.trl.GRPOTrainer") in found
    assert ("docs/compatibility.md", ".ci/run") in found
    assert ("grpo_kernels/loss_call.py", "grpo_math.policy_loss") in found
    assert ("grpo_kernels/ops/__init__.py", "launch.py") in found
    assert not any(name.startswith(("torch.", "trl.")) for _, name in found)


def test_every_backticked_project_name_resolves():
    stale, listed = [], set()
    for where, name, check in _references():
        key = (where.split(":")[0], name)
        problem = check()
        if key in KNOWN_STALE:
            listed.add(key)
            if problem is None:
                stale.append(f"{key} resolves now: remove it from KNOWN_STALE")
        elif problem is not None:
            stale.append(f"{where}: `{name}`: {problem}")
    stale += [f"{key} is no longer referenced: remove it from KNOWN_STALE"
              for key in sorted(KNOWN_STALE - listed)]
    assert not stale, "\n".join(stale)
