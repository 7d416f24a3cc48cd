"""Writing output files: checked before the work, written atomically, so a reader never sees half
a file and nothing but a regular file is ever replaced.

An output path must be a regular file (replaced only with --force) or a new name, not a symbolic
link (an append would write into whatever it points at), in a directory memx may write, and not
under /proc, /sys or /dev (``check_output_path``, called before the work starts); two outputs of
one command never name the same file (``check_distinct_outputs``). A write that fails (a full
disk, ``ulimit -f``) is one ConfigError and leaves no file behind. Files get the permissions of a plain ``open``: the umask's, or the replaced file's mode;
temporary files are removed on any failure, Ctrl-C and SIGTERM included, and those a kill -9
left are removed by the next write into the same directory once an hour old.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import time
from typing import Any, Iterator

from memx_launch.errors import ConfigError

SYSTEM_TREES = ("/proc", "/sys", "/dev")
TEMP_PREFIX = ".memx-"
_TEMP_NAME = re.compile(r"\.memx-[a-z0-9_]{8}\.(tmp|png|ubj|json)")
STALE_TEMP_S = 3600
"""A temporary file this old is left from a killed write (kill -9): no write takes an hour."""


def path_component(name: str, fallback: str = "run") -> str:
    """``name`` (read from a file: a model's ``_name_or_path``, ...) as one safe file-name
    component: no separators, no ``..``, no leading dot, printable ASCII, at most 64 characters.
    A name from inside a file never chooses where memx writes."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).lstrip("._-")[:64]
    return safe or fallback


def check_output_path(path: str, flag: str = "output", force: bool = False) -> None:
    """Refuse, before any work, an output path memx must not or cannot write."""
    if not path or "\0" in path:
        raise ConfigError(flag, f"{path!r} is not a file name", "pass a file path")
    real = os.path.realpath(path)
    for tree in SYSTEM_TREES:
        if real == tree or real.startswith(tree + os.sep):
            raise ConfigError(flag, f"{path} is under {tree}, not a place for output files",
                              "write to a regular file in your own directory")
    if os.path.islink(path):
        raise ConfigError(flag, f"{path} is a symbolic link", "give the path of the file itself")
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ConfigError(flag, f"cannot use {path} ({exc.strerror})", "choose another path") from None
        if stat.S_ISDIR(mode):
            raise ConfigError(flag, f"{path} is a directory", "give a file name inside it")
        if not stat.S_ISREG(mode):
            raise ConfigError(flag, f"{path} is not a regular file", "write to a regular file")
        if not force:
            raise ConfigError(flag, f"{path} already exists", "pass --force to overwrite or choose another path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):  # the nearest existing ancestor; missing folders are created
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(flag, f"{path} lies below {parent}, which is not a directory", "choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"cannot write in {parent}", "choose a directory you can write to")


def check_distinct_outputs(outputs: dict[str, str | None]) -> None:
    """Refuse two output flags (flag -> path) naming one file: the second write would replace the first."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(flag, f"{path} is also the {seen[real]} file", f"give {flag} and {seen[real]} "
                              "different paths")
        seen[real] = flag


def write_error(path: str, flag: str, exc: OSError) -> ConfigError:
    """A write that failed after the work (a full disk, ``ulimit -f``) as one line."""
    return ConfigError(flag, f"cannot write {path} ({exc.strerror or exc}); no output file was written",
                       "free disk space (or raise the file size limit) and run again, or choose another path")


def _remove_stale_temporaries(directory: str) -> None:
    now = time.time()
    for name in os.listdir(directory):
        if _TEMP_NAME.fullmatch(name):
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > STALE_TEMP_S:
                    os.unlink(path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str, flag: str = "output", overwrite: bool = False, suffix: str = ".tmp") -> Iterator[str]:
    """A temporary path next to ``path``; renamed onto ``path`` when the block succeeds, removed
    when it fails (exceptions, Ctrl-C, SIGTERM under the memx command)."""
    check_output_path(path, flag, overwrite)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_umask()
    _remove_stale_temporaries(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=suffix)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; the output gets what open() would give
        os.close(fd)
        try:
            yield tmp
            os.replace(tmp, path)
        except OSError as exc:
            raise write_error(path, flag, exc) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str, text: str, overwrite: bool = False, flag: str = "output") -> None:
    """Write text through a temporary file and rename, so readers never see half a file."""
    with atomic_output(path, flag, overwrite) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


def write_json_atomic(path: str, data: Any, overwrite: bool = False, flag: str = "output") -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", overwrite, flag)
