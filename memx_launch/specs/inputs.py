"""Reading inputs that may be broken or hostile: checked at the door, before any work.

Every file memx reads (cluster YAML, model config.json, plan JSON, profile records, cases files)
comes through here: a regular file of bounded size, UTF-8 text without NUL bytes and with bounded
lines; JSON and YAML parsed strictly (duplicate keys refused, NaN and infinities refused, YAML
aliases refused, nesting bounded). Numbers given as text (command-line flags, MEMX_* variables)
are plain ASCII of bounded length: Python's int() and float() also take '８' or '٣' and spend
seconds on 5,000 digits. What fails is one ConfigError naming the flag and the file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
from typing import Any

import yaml

from memx_launch.errors import ConfigError

MAX_FILE_BYTES = 16 * 2**20
"""Cluster, model and plan files: the 1,024-GPU example cluster is 2 KB."""
MAX_LINE_CHARS = 1 * 2**20
MAX_DEPTH = 64
MAX_INT_DIGITS = 30
"""No count, size or seed memx reads has more digits (2**64 has 20)."""
MAX_NUMBER_CHARS = 40


def read_bytes(path: str, flag: str, max_bytes: int = MAX_FILE_BYTES, fix: str = "pass the right file") -> bytes:
    """The file's bytes, or one error: missing, not a regular file (a FIFO, a device, a
    directory), over ``max_bytes``."""
    try:
        # O_NONBLOCK: a FIFO opens without waiting for a writer; fstat then refuses it (no race
        # between a check of the name and the open)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path!r} ({exc.strerror})", fix) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(flag, f"{path} is not a regular file", fix)
        raise ConfigError(flag, f"{path} is {info.st_size} bytes, over the limit of {max_bytes}", fix)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ConfigError(flag, f"cannot read {path!r} ({exc.strerror})", fix) from None
    if len(data) > max_bytes:
        raise ConfigError(flag, f"{path} is over the limit of {max_bytes} bytes", fix)
    return data


def read_text(path: str, flag: str, max_bytes: int = MAX_FILE_BYTES, fix: str = "pass the right file") -> str:
    """The file's text, or one error: what read_bytes refuses, binary, not UTF-8, a line too long."""
    data = read_bytes(path, flag, max_bytes, fix)
    if b"\0" in data:
        raise ConfigError(flag, f"{path} is a binary file, not text", fix)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(flag, f"{path} is not UTF-8 text (byte {exc.start})", fix) from None
    longest = max(map(len, text.splitlines()), default=0)
    if longest > MAX_LINE_CHARS:
        raise ConfigError(flag, f"{path} has a line of {longest} characters (limit {MAX_LINE_CHARS})", fix)
    return text


class _Refused(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key!r}")
        out[key] = value
    return out


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text} is out of range")
    return value


def _bounded_int(text: str) -> int:
    # Python parses a 5,000-digit integer slowly and then refuses it with a bare ValueError
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"a number of {len(text)} digits")
    return int(text)


def _no_constant(text: str):
    raise _Refused(f"{text} is not a number memx accepts")


def parse_json(text: str, flag: str, path: str, fix: str = "pass the right file") -> Any:
    """Strict JSON: duplicate keys, NaN, Infinity, numbers that overflow to inf and integers of
    more than MAX_INT_DIGITS digits refused."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite_float,
                          parse_int=_bounded_int, parse_constant=_no_constant)
    except _Refused as exc:
        raise ConfigError(flag, f"{path}: {exc}", fix) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(flag, f"{path} is not valid JSON (line {exc.lineno})", fix) from None
    except RecursionError:
        raise ConfigError(flag, f"{path} is nested too deeply", fix) from None
    check_structure(data, flag, path, fix)
    return data


def check_structure(data: Any, flag: str, path: str, fix: str) -> None:
    """Nesting bounded, every float finite (YAML's .nan and .inf included), integers bounded."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(flag, f"{path} is nested more than {MAX_DEPTH} levels", fix)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(flag, f"{path} holds {value}, not a finite number", fix)
        if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
            raise ConfigError(flag, f"{path} holds an integer of more than {MAX_INT_DIGITS} digits", fix)
        if isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]


def load_json(path: str, flag: str, max_bytes: int = MAX_FILE_BYTES, fix: str = "pass the right file") -> Any:
    return parse_json(read_text(path, flag, max_bytes, fix), flag, path, fix)


class _StrictLoader(yaml.SafeLoader):
    """safe_load without aliases (no 'billion laughs') and without duplicate keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1}: YAML aliases (*name) are not accepted")
        if self.check_event(yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent):
            event = self.peek_event()
            if getattr(event, "anchor", None):
                raise _Refused(f"line {event.start_mark.line + 1}: YAML anchors (&name) are not accepted")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise _Refused(f"line {key_node.start_mark.line + 1}: a mapping key must be a plain value") from None
            if duplicate:
                raise _Refused(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str, flag: str, max_bytes: int = MAX_FILE_BYTES, fix: str = "pass the right file") -> Any:
    text = read_text(path, flag, max_bytes, fix)
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except _Refused as exc:
        raise ConfigError(flag, f"{path}: {exc}", fix) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(flag, f"{path} is not valid YAML{at}", fix) from None
    except RecursionError:
        raise ConfigError(flag, f"{path} is nested too deeply", fix) from None
    except ValueError:  # int() of an integer over Python's 4,300-digit limit
        raise ConfigError(flag, f"{path} holds a number too long to read", fix) from None
    check_structure(data, flag, path, fix)
    return data


def parse_number(text: str, kind: type, field: str, fix: str) -> int | float:
    """``text`` as ``kind`` (int or float): ASCII only, at most MAX_NUMBER_CHARS characters,
    finite; else one ConfigError naming ``field``."""
    value = None
    if isinstance(text, str) and text.isascii() and len(text) <= MAX_NUMBER_CHARS:
        try:
            value = kind(text)
        except ValueError:
            pass
    if value is None or not math.isfinite(value):
        shown = text if len(str(text)) <= MAX_NUMBER_CHARS else f"{str(text)[:MAX_NUMBER_CHARS]}... ({len(text)} chars)"
        raise ConfigError(field, f"{shown!r} is not a plain {'integer' if kind is int else 'number'} "
                          "(ASCII digits, finite)", fix)
    return value


def _flag_type(kind: type):
    def convert(text: str):
        try:
            return parse_number(text, kind, "", "")
        except ConfigError:
            raise argparse.ArgumentTypeError(f"{text[:MAX_NUMBER_CHARS]!r} is not a plain "
                                             f"{'integer' if kind is int else 'number'} (ASCII digits, finite)") from None
    convert.__name__ = kind.__name__
    return convert


int_flag = _flag_type(int)
"""argparse's ``type=`` for an integer flag: ``int`` without its non-ASCII digits and unbounded length."""
float_flag = _flag_type(float)
"""argparse's ``type=`` for a number flag: ``float`` without its non-ASCII digits, NaN and infinities."""


def positive_seconds(environ, var: str, default: float, field: str, example: str) -> float:
    """A positive, finite number of seconds from ``var`` (``default`` when unset)."""
    text = environ.get(var, "")
    value = parse_number(text, float, field, f"e.g. {example}") if text else default
    if not 0 < value < math.inf:
        raise ConfigError(field, f"must be a positive number of seconds, got {text!r}", f"e.g. {example}")
    return value
