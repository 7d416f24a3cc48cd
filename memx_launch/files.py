"""Writing output files: atomically, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from memx_launch.errors import ConfigError


def write_json_atomic(path: str, data: Any, overwrite: bool = False) -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", overwrite)


def write_text_atomic(path: str, text: str, overwrite: bool = False) -> None:
    """Write text through a temporary file and rename, so readers never see half a file."""
    if os.path.exists(path) and not overwrite:
        raise ConfigError("output", f"{path} already exists", "pass --force to overwrite or choose another path")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".memx-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str, overwrite: bool = False) -> None:
    """Write text through a temporary file and rename, so readers never see half a file."""
    if os.path.exists(path) and not overwrite:
        raise ConfigError("output", f"{path} already exists", "pass --force to overwrite or choose another path")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".memx-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
