"""Validation helpers shared by the spec readers.
"""

from __future__ import annotations

import argparse
import difflib
import math
import unicodedata
from typing import Any, Mapping


from memx_launch.errors import ConfigError


def reject_unknown(data: Mapping, allowed: set, where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(sorted(allowed))}"
        raise ConfigError(f"{where}.{key}", "unknown key", fix)


def require_positive(value: Any, where: str, fix: str = "give the link's real GB/s") -> None:
    require_number(value, where, lo=0, lo_open=True, fix=fix)


def require_number(value: Any, where: str, *, lo: float | None = None, hi: float | None = None,
                   lo_open: bool = False, integer: bool = False, fix: str = "") -> None:
    """A finite number (an integer when ``integer``) in [lo, hi] ((lo, hi] when ``lo_open``)."""
    kinds = int if integer else (int, float)
    what = "an integer" if integer else "a number"
    if lo == 0 and lo_open:
        what = "a positive integer" if integer else "a positive number"
    if not isinstance(value, kinds) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(where, f"must be {what}, got {value!r}", fix)
    below = value <= lo if lo_open else value < lo if lo is not None else False
    if below or (hi is not None and value > hi):
        plain = lo == 0 and lo_open and hi is None
        bounds = "" if plain else f" in {'(' if lo_open else '['}{'' if lo is None else lo}, {'' if hi is None else hi}]"
        raise ConfigError(where, f"must be {what}{bounds}, got {value!r}", fix)


def require_type(value: Any, kind: type | tuple, where: str, fix: str = "") -> None:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool) and bool not in
                                       (kind if isinstance(kind, tuple) else (kind,))):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(where, f"must be a {name}, got {value!r}", fix)


MAX_NAME_CHARS = 128


def require_name(value: Any, where: str) -> None:
    """A name memx prints into tables and command lines: text of bounded length without control
    characters (a newline in a node name would start a new line of an exported shell script)."""
    require_type(value, (str, int), where, "use a short name")
    text = str(value)
    if not text or len(text) > MAX_NAME_CHARS or any(unicodedata.category(c)[0] in "CZ" and c != " " for c in text):
        raise ConfigError(where, f"{text[:40]!r} is not a name (1 to {MAX_NAME_CHARS} printable characters)",
                          "use letters, digits, '-', '_' or '.'")


def list_of(cast):
    """argparse type of a comma list (its error is the usual one line)."""
    def parse(text: str) -> list:
        try:
            return [cast(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    parse.__name__ = "comma list"
    return parse
