"""grpo-train's command line: flags generated from TrainConfig (each field's metadata["help"] is
its --help text, grouped by config.TOPICS), an optional YAML/JSON config file, and `parse_config`.

Precedence: TrainConfig's defaults < `--config FILE` < explicit command-line flags. Every field
`foo_bar` is the flag `--foo_bar` (also `--foo-bar`); booleans take `--flag` / `--no_flag` (or
`--flag true|false`); list fields take several values (`--reward accuracy format:0.2`). The flag
convention itself (shared with the benchmarks) is in `flags.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing

from .checks import CHOICES, validate
from .config import AUTO, RESOLVED_LATER, TOPICS, TrainConfig, resolve_auto
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


# ---- --help from TrainConfig's field metadata ------------------------------------------------


def field_docs() -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """({field: its metadata["help"]}, [(topic heading, [fields])]): the fields in declaration
    order, each topic of config.TOPICS from its first field up to the next topic's."""
    fields = dataclasses.fields(TrainConfig)
    starts = dict(TOPICS)
    unknown = set(starts) - {f.name for f in fields}
    if unknown or fields[0].name not in starts:  # else a heading or a field would go missing
        raise ValueError(f"config.TOPICS: {sorted(unknown)} are not TrainConfig fields, or the "
                         f"first field ({fields[0].name}) begins no topic")
    docs: dict[str, str] = {}
    topics: list[tuple[str, list[str]]] = []
    for f in fields:
        if f.name in starts:
            topics.append((starts[f.name], []))
        topics[-1][1].append(f.name)
        docs[f.name] = f.metadata.get("help", "")
    return docs, topics


def _default_text(name: str, default) -> str:
    if name in AUTO:
        embedded, pretrained = (("on" if v else "off") if isinstance(v, bool) else v
                                for v in AUTO[name])
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
    """One flag per TrainConfig field, grouped by topic, in the convention of `flags.py`.

    Not transformers' HfArgumentParser, although it reads the same metadata: what it would add
    differs from what this command line promises for most fields. Booleans off by default get no
    --no_flag and show as `--bf16 [BF16]`; `int | None` fields take no `none`; groups are one per
    dataclass, not per topic; "auto" fields would show "(default: None)"; an unknown flag is a
    ValueError from parse_args_into_dataclasses, not a one-line error. And importing transformers
    costs --help and every error exit about a second (1.0 s vs 0.2 s for this module, 2 cores).
    """
    docs, topics = field_docs()
    parser = Parser(
        "grpo-train",
        usage="grpo-train [--config FILE] [--FIELD VALUE ...]",
        description="Compact GRPO trainer on grpo_kernels' fused loss. With no arguments it "
        "trains a tiny model\non a generated arithmetic task (about 35 s on a 2-core CPU).\n\n"
        "Every flag is also accepted with hyphens (--num-generations); booleans take --flag / "
        "--no_flag.\nPrecedence: the defaults below < --config FILE < flags on the command "
        "line. Exit status: 0 done,\n2 bad arguments or inputs, or no completion scored for "
        "--max_unscored_steps steps in a row\n(one line on stderr), 130 interrupted (a "
        "checkpoint was saved).",
    )
    parser.renamed = {"--epsilon": "--epsilon_low"}
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
            # metadata["help"] is an argparse help string, as for HfArgumentParser (a literal
            # percent sign is written %%); only the default's text is escaped here
            default_text = _default_text(name, default).replace("%", "%%")
            help_text = f"{docs[name]} ({default_text})".lstrip()
            if _scalar_type(tp)[0] is bool:  # bool, or bool | None (an "auto" flag)
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
    """The fields set in a YAML or JSON file, typed as flags are. Ours rather than TrlParser's
    --config, which reads YAML only and passes `steps: 2.5` on unchecked, or HfArgumentParser's
    parse_yaml_file / parse_json_file, which check no value's type."""
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
