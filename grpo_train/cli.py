"""grpo-train's command line: flags generated from TrainConfig (its comments are the --help),
an optional YAML/JSON config file, and `parse_config`.

Precedence: TrainConfig's defaults < `--config FILE` < explicit command-line flags. Every field
`foo_bar` is the flag `--foo_bar` (also `--foo-bar`); booleans take `--flag` / `--no_flag` (or
`--flag true|false`); list fields take several values (`--reward accuracy format:0.2`). The flag
convention itself (shared with the benchmarks) is in `flags.py`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import re
import tokenize
import typing

from . import config
from .config import AUTO, CHOICES, RESOLVED_LATER, TrainConfig, resolve_auto, validate
from .flags import BoolFlag, MissingPathError, Parser, UsageError, VersionAction


def _field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(TrainConfig)


def _scalar_type(tp):
    """(python type, optional?) of an annotation like `int`, `float | None`, `list[str]`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return str, False
    if args:  # X | None
        return args[0], True
    return tp, False


def _converter(name: str, tp):
    base, optional = _scalar_type(tp)
    auto = name in AUTO or name in RESOLVED_LATER

    def convert(text: str):
        if optional and text.lower() in (("none", "null", "auto") if auto else ("none", "null")):
            return None
        return base(text)

    convert.__name__ = getattr(base, "__name__", name)  # argparse: "invalid int value: 'x'"
    return convert


# ---- --help from the comments above ----------------------------------------------------------

_HEADING = re.compile(r"^-{3,}\s*(.*?)\s*-*$")  # "# ---- loss: TRL's names ------" -> topic


def field_docs() -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """({field: its comments as one text}, [(topic heading, [fields])]) read from the
    TrainConfig source in config.py: the comment lines right above a field plus its trailing
    comment."""
    source = inspect.getsource(config)
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    first, last = cls.body[0].end_lineno, cls.end_lineno  # after the docstring
    comments = {}  # line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and first < tok.start[0] <= last:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    fields_at = {n.lineno: n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    docs: dict[str, str] = {}
    topics: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for line in range(first + 1, last + 1):
        name, text = fields_at.get(line), comments.get(line)
        if name is None and text is not None:
            heading = _HEADING.match(text)
            if heading:
                topics.append((heading.group(1), []))
                pending = []
            else:
                pending.append(text)
        elif name is not None:
            docs[name] = " ".join(pending + ([text] if text else []))
            topics[-1][1].append(name)
            pending = []
        else:  # a blank line ends a comment block
            pending = []
    return docs, topics


def _default_text(name: str, default) -> str:
    if name in AUTO:
        embedded, pretrained = AUTO[name]
        return f"default: {embedded} for the embedded run, {pretrained} with --model"
    if name in RESOLVED_LATER:
        return f"default: {RESOLVED_LATER[name]}"
    if isinstance(default, bool):
        return f"default: {'on' if default else 'off'}"
    if default is None:
        return "default: none"
    if isinstance(default, list):
        return f"default: {' '.join(default)}"
    return 'default: ""' if default == "" else f"default: {default}"


_METAVARS = {"model": "DIR|HUB_ID", "dataset": "FILE|HUB_ID", "output_dir": "DIR",
             "resume": "PATH|auto", "grad_filter": "auto|X|none", "revision": "REV",
             "dataset_config": "NAME", "split": "NAME", "eval_split": "NAME",
             "prompt_column": "NAME", "answer_column": "NAME"}


def _metavar(name: str, tp) -> str:
    if name in _METAVARS:
        return _METAVARS[name]
    if name in CHOICES:
        return "{" + "|".join(CHOICES[name]) + "}"
    if name in RESOLVED_LATER:
        return "N|auto"
    base, optional = _scalar_type(tp)
    word = {int: "N", float: "X"}.get(base, "TEXT")
    return f"{word}|none" if optional and base is not str else word


def package_version() -> str:
    """grpo_kernels.__version__: the version of the code that runs."""
    import grpo_kernels

    return grpo_kernels.__version__


def build_parser() -> Parser:
    docs, topics = field_docs()
    parser = Parser(
        "grpo-train",
        usage="grpo-train [--config FILE] [--FIELD VALUE ...]",
        description="Compact GRPO trainer on grpo_kernels' fused loss. With no arguments it "
        "trains a tiny model\non a generated arithmetic task (CPU, about a minute and a half).\n\n"
        "Every flag is also accepted with hyphens (--num-generations); booleans take --flag / "
        "--no_flag.\nPrecedence: the defaults below < --config FILE < flags on the command "
        "line. Exit status: 0 done,\n2 bad arguments or inputs (one line on stderr), "
        "130 interrupted (a checkpoint was saved).",
    )
    general = parser.add_argument_group("general")
    general.add_argument("--config", metavar="FILE",
                         help="YAML or JSON file of the settings below (field: value)")
    general.add_argument("--debug", action="store_true",
                         help="show the Python traceback of an error instead of one line")
    general.add_argument("--version", action=VersionAction, version=package_version,
                         help="print the version of grpo-kernels (this trainer's package) and exit")
    defaults, types = TrainConfig(), _field_types()
    for topic, names in topics:
        title, _, about = topic.partition(": ")  # "loss: TRL's names ..." -> title, description
        group = general if title == "general" else parser.add_argument_group(title, about or None)
        for name in names:
            tp, default = types[name], getattr(defaults, name)
            help_text = f"{docs[name]} ({_default_text(name, default)})".lstrip()
            help_text = help_text.replace("%", "%%")  # argparse formats help with %
            if tp is bool:
                group.add_argument(f"--{name}", action=BoolFlag, dest=name,
                                   default=argparse.SUPPRESS, help=help_text)
            elif typing.get_origin(tp) is list:
                group.add_argument(f"--{name}", dest=name, nargs="+", metavar="SPEC",
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(f"--{name}", dest=name, type=_converter(name, tp),
                                   choices=CHOICES.get(name), metavar=_metavar(name, tp),
                                   default=argparse.SUPPRESS, help=help_text)
    return parser


# ---- config files ------------------------------------------------------------------------


def _coerce(name: str, value, tp, where: str):
    """A config-file value as the field's type (YAML/JSON already typed it; ints may be
    floats; strings are converted as on the command line)."""
    base, optional = _scalar_type(tp)
    if typing.get_origin(tp) is list:
        value = [value] if isinstance(value, str) else value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif value is None:
        if optional:
            return None
    elif isinstance(value, bool):
        if base is bool:
            return value
    elif base is str:
        return str(value)
    elif isinstance(value, base) or (base is float and isinstance(value, int)):
        return base(value)
    elif isinstance(value, str):
        try:
            return _str2bool(value) if base is bool else _converter(name, tp)(value)
        except ValueError:
            pass
    kind = "a list of strings" if typing.get_origin(tp) is list else base.__name__
    raise UsageError(f"{where}: {name} must be {kind}, got {value!r}")


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return low in ("1", "true", "yes", "on")
    raise ValueError(f"expected true/false, got {text!r}")


def load_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise MissingPathError(f"--config {path!r}: no such file (expected a YAML or JSON file "
                               "of TrainConfig fields)")
    try:
        with open(path) as fh:
            if path.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(fh) or {}
            else:
                data = json.load(fh)
    except Exception as err:  # noqa: BLE001 - OSError, JSON's ValueError, yaml.YAMLError
        raise UsageError(f"--config {path!r} could not be read as YAML/JSON: {err}") from err
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r} must hold a mapping of TrainConfig fields")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UsageError(f"--config {path!r}: unknown fields {unknown}; known: {sorted(names)}")
    types = _field_types()
    return {k: _coerce(k, v, types[k], f"--config {path!r}") for k, v in data.items()}


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from defaults, then `--config FILE`, then the other flags."""
    args = vars(build_parser().parse_args(argv))
    args.pop("debug", None)
    values: dict = {}
    path = args.pop("config", None)
    if path:
        values.update(load_config_file(path))
    values.update(args)
    return validate(resolve_auto(TrainConfig(**values)))
