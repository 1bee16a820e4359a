"""What the command lines (grpo-train, python -m benchmarks, python -m benchmarks.trainer_step)
share: one flag convention, one-line errors, and a `--debug` switch for tracebacks.

Flag convention: every long flag is written with underscores (`--num_generations`, the
TrainConfig field names, TRL's spelling); the hyphenated spelling (`--num-generations`) is
accepted as an alias. Booleans are `--flag` / `--no_flag` (also `--no-flag`). Flags are never
matched by prefix (`allow_abbrev=False`), so a typo is an error, not another flag.

A user error (a bad value, a missing file, a model that cannot be reached) raises `UsageError`;
`run_cli` prints it as one line `PROG: error: ...` on stderr and returns exit status 2, the
status argparse uses for its own errors. With `--debug` the traceback is shown instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class UsageError(ValueError):
    """A setting that cannot work, with a message that names the flag and what it expects."""


class MissingPathError(UsageError, FileNotFoundError):
    """A user-given path that does not exist (also a FileNotFoundError for library callers)."""


def canonical_flag(token: str) -> str:
    """"--num-generations=4" -> "--num_generations=4"; values and short options unchanged."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token.partition("=")
    return "--" + name[2:].replace("-", "_") + eq + value


class BoolFlag(argparse.Action):
    """`--flag` (True), `--no_flag` (False), `--flag true|false`; shown as `--flag/--no_flag`."""

    def __init__(self, option_strings, dest, **kwargs):
        name = option_strings[0][2:]
        super().__init__([f"--{name}", f"--no_{name}"], dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no_"):
            if value is not None:
                parser.error(f"{option_string} takes no value (got {value!r})")
            setattr(namespace, self.dest, False)
            return
        if value is None:
            setattr(namespace, self.dest, True)
            return
        low = value.lower()
        if low not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            parser.error(f"{option_string}: expected true or false, got {value!r}")
        setattr(namespace, self.dest, low in ("1", "true", "yes", "on"))


class VersionAction(argparse.Action):
    """`--version`: print `PROG VERSION` and exit 0; `version` is called only then (it may
    import something heavy)."""

    def __init__(self, option_strings, dest, version: Callable[[], str], **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {self.version()}", flush=True)
        parser.exit(0)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout at 100 columns; booleans as `--flag/--no_flag`."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=100)

    def _format_action_invocation(self, action):
        if isinstance(action, BoolFlag):
            return "/".join(action.option_strings)
        if action.option_strings and action.nargs != 0:
            # "--steps N" once, not once per spelling
            return f"{action.option_strings[0]} {self._format_args(action, action.dest.upper())}"
        return super()._format_action_invocation(action)


class Parser(argparse.ArgumentParser):
    """ArgumentParser with the shared convention: no prefix matching, both spellings of every
    long flag (argv is rewritten to underscores before parsing), one-line errors."""

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if "--" in args:  # everything after "--" is a value, not a flag
            cut = args.index("--")
            args = [canonical_flag(a) for a in args[:cut]] + args[cut:]
        else:
            args = [canonical_flag(a) for a in args]
        return super().parse_known_args(args, namespace)

    # flags of other trainers (TRL's GRPOConfig) that this command line spells otherwise
    renamed: dict[str, str] = {}

    def error(self, message: str):
        # argparse prints the whole usage first (dozens of lines here); one line is enough
        for old, new in self.renamed.items():
            if message.startswith("unrecognized arguments") and old in message.split():
                message += f" ({old} is TRL's GRPOConfig name of {new})"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def wants_debug(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args[: args.index("--")] if "--" in args else "--debug" in args


def run_cli(prog: str, main: Callable[[], int], argv: list[str] | None = None) -> int:
    """`main()`'s exit status; a UsageError becomes one line on stderr and status 2 (with
    --debug in argv: the traceback). Ctrl-C before training is status 130 without a trace."""
    try:
        return main()
    except UsageError as err:
        if wants_debug(argv):
            raise
        message = " ".join(str(err).split())  # one line, whatever the message held
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        if wants_debug(argv):
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
