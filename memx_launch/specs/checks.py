"""Validation helpers shared by the spec readers.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping


from memx_launch.errors import ConfigError


def reject_unknown(data: Mapping, allowed: set, where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(sorted(allowed))}"
        raise ConfigError(f"{where}.{key}", "unknown key", fix)


def require_positive(value: Any, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(where, f"must be a positive number, got {value!r}", "give the link's real GB/s")
