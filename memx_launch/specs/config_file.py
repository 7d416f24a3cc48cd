"""``--config FILE`` and ``--print-config`` for an argparse command, as LightningCLI users know them.

A config file is YAML: one key per long option, named as the option's destination
(``global_batch_size``; ``global-batch-size`` is read too), holding the value the flag would
take. The file's values go into the command line in front of the flags given there, so the
real parser checks them like typed flags and a flag on the command line overrides the file,
wherever it stands. ``--print-config`` writes the effective options as YAML that ``--config``
reads back. Positional arguments (memx-run's script and its arguments) stay on the command line.

jsonargparse validates each value against the option's type (``Literal`` choices, numbers,
booleans) and writes the YAML; memx's own parsers stay argparse (torchrun's, for memx-run) so
every flag, spelling and help text is unchanged.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Literal, Optional, Union

from memx_launch.errors import ConfigError
from memx_launch.specs.inputs import float_flag, int_flag, load_yaml, parse_number

_OWN = ("config", "print_config")


def add_config_args(parser) -> None:
    """Add ``--config`` and ``--print-config`` to ``parser`` (or to one of its argument groups)."""
    parser.add_argument("--config", action="append", metavar="FILE",
                        help="YAML file of option values, keys as --print-config writes them; flags on the command "
                             "line override it; may be repeated (later files win)")
    parser.add_argument("--print-config", "--print_config", action="store_true",
                        help="print the effective options as YAML (what --config reads), then exit")


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the ``--config`` files' values under the command line's flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Find --config where the real parser would (never among a script's own arguments); options
    # the file may provide are not required yet.
    first = _parse_relaxed(parser, argv)
    target = _selected_parser(parser, first)
    if getattr(first, "config", None):
        values: dict = {}
        for path in first.config:
            values.update(_load(target, path))
        at = argv.index(getattr(first, _subcommand_dest(parser))) + 1 if target is not parser else 0
        argv = argv[:at] + _as_flags(target, values) + argv[at:]
    if getattr(first, "print_config", False):  # a template may leave required options empty
        return _parse_relaxed(parser, argv, known_only=False)
    return parser.parse_args(argv)


def add_version_arg(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed package's version (its metadata, as pip shows it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("memx")
    except PackageNotFoundError:  # run from a source tree that was never installed
        installed = "unknown (not installed)"
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed}")


def one_line_error(parser: argparse.ArgumentParser, message: str, name: str):
    """argparse's error as memx's one line (never the usage dump), with the nearest known flag
    when one was mistyped."""
    parser.exit(2, f"{name}: error: {message}{_flag_suggestion(parser, message)} (see '{parser.prog} --help')\n")


def _flag_suggestion(parser, message: str) -> str:
    if not message.startswith("unrecognized arguments:"):
        return ""
    typed = next((word.split("=")[0] for word in message.split()[2:] if word.startswith("--")), None)
    owners = {}  # flag -> the commands that take it
    for p in _parsers(parser):
        for action in p._actions:
            for flag in action.option_strings:
                owners.setdefault(flag, []).append(p.prog)
    if typed in owners:  # another command's flag, not a typo
        return f"; {typed} is a flag of {', '.join(sorted(set(owners[typed])))}"
    close = difflib.get_close_matches(typed, sorted(f for f in owners if f.startswith("--")), n=1) if typed else []
    return f"; did you mean {close[0]}?" if close else ""


def config_yaml(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options of ``args`` that a config file can hold, as YAML ``--config`` reads back."""
    target = _selected_parser(parser, args)
    schema = _schema(target)
    values = {dest: getattr(args, dest) for dest in _options(target)}
    return schema.dump(schema.parse_object(values), skip_unset=False)


# --------------------------------------------------------------------------- parsing


def _parse_relaxed(parser, argv, known_only: bool = True):
    relaxed = [a for p in _parsers(parser) for a in p._actions if a.option_strings and a.required]
    for action in relaxed:
        action.required = False
    try:
        return parser.parse_known_args(argv)[0] if known_only else parser.parse_args(argv)
    finally:
        for action in relaxed:
            action.required = True


def _subparsers_action(parser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _subcommand_dest(parser) -> str:
    return _subparsers_action(parser).dest


def _parsers(parser):
    yield parser
    sub = _subparsers_action(parser)
    for child in (sub.choices.values() if sub else ()):
        yield from _parsers(child)


def _selected_parser(parser, args):
    """The subcommand's parser that parsed ``args`` (``parser`` itself when it has none)."""
    sub = _subparsers_action(parser)
    if sub is None or getattr(args, sub.dest, None) is None:
        return parser
    return _selected_parser(sub.choices[getattr(args, sub.dest)], args)


def _options(parser) -> dict[str, argparse.Action]:
    """Destination -> action of every option a config file may set."""
    out = {}
    for action in parser._actions:
        plain_type = action.type in (None, str) or _number_kind(action) is not None
        if (action.option_strings and action.dest not in _OWN and action.default is not argparse.SUPPRESS
                and (action.nargs == 0 or (action.nargs is None and plain_type))):
            out[action.dest] = action
    return out


# --------------------------------------------------------------------------- the file


def _load(parser, path: str) -> dict:
    # the cluster file's strict loader: no aliases (a "billion laughs" hangs safe_load), no
    # duplicate keys, regular files of bounded size only
    data = load_yaml(path, "--config", fix=f"give an option: value YAML file ({parser.prog} --print-config writes one)")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} holds a {type(data).__name__}, not option: value lines",
                          f"see {parser.prog} --print-config")
    options, schema = _options(parser), _schema(parser)
    values = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in options:
            raise ConfigError(f"{path}: {key}", "unknown key", _unknown_key_fix(parser, options, dest))
        kind = _number_kind(options[dest])
        if kind is not None and isinstance(value, str) and not value.isascii():  # jsonargparse's int() takes '８'
            value = parse_number(value, kind, f"{path}: {key}", f"see {parser.prog} --help")
        try:
            values[dest] = schema.parse_object({dest: value})[dest]
        except (argparse.ArgumentError, TypeError, ValueError):
            raise ConfigError(f"{path}: {key}", f"expected {_describe(options[dest])}, got {value!r}",
                              f"see {parser.prog} --help") from None
    return values


def _unknown_key_fix(parser, options, dest) -> str:
    if any(a.dest == dest for a in parser._actions if not a.option_strings):
        return "give it on the command line (the script and its arguments come after the options)"
    close = difflib.get_close_matches(dest, sorted(options), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}{parser.prog} --print-config lists the keys"


def _as_flags(parser, values: dict) -> list[str]:
    """The file's values as the flags that set them (an off switch sets nothing)."""
    flags = []
    for dest, value in values.items():
        action = _options(parser)[dest]
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x; null leaves the default
            flags += [] if value is None else [flag if value else "--no-" + flag[2:]]
        elif action.nargs == 0:
            flags += [flag] if value == action.const else []
        elif value is not None:
            flags.append(f"{flag}={value}")  # "=" keeps a value that starts with "-" a value
    return flags


# --------------------------------------------------------------------------- types


def _type_of(action: argparse.Action):
    if action.nargs == 0:
        return bool
    if action.choices is not None:
        return Literal[tuple(action.choices)]
    return _number_kind(action) or Union[str, int, float]  # text options; a YAML number is its text, as on the command line


def _number_kind(action: argparse.Action) -> type | None:
    """int or float for a number option (argparse's types or memx's ASCII-only ones), else None."""
    return {int: int, float: float, int_flag: int, float_flag: float}.get(action.type)


def _describe(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "true or false"
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    return {int: "an integer", float: "a number"}.get(_number_kind(action), "text or a number")


def _schema(parser):
    """A jsonargparse parser with one typed option per config key (validation and YAML only)."""
    from jsonargparse import ArgumentParser

    schema = ArgumentParser(prog=parser.prog, exit_on_error=False, add_help=False)
    for dest, action in _options(parser).items():
        schema.add_argument(f"--{dest}", type=Optional[_type_of(action)], default=None)
    return schema
