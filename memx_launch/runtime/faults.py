"""Fault injection for tests and drills, from the environment (documented in docs/replanning.md).

MEMX_FAULT_BALLAST="rank=1,step=5,gib=0.5"
    Rank 1 allocates 0.5 GiB of ballast before step 5 and holds it from then on, also after a
    restart that resumes at step 5 or later: it stands for memory another tenant took and keeps.
    On an emulated device the ballast counts against the emulated capacity; on a GPU it is a
    real allocation. The pages are never written, so on CPU it costs no resident memory.
MEMX_FAULT_KILL_CALIBRATION="rank=2" (optional ",after=N", default 1)
    Rank 2 kills itself with SIGKILL after N calibration samples, once: a marker file in
    MEMX_FAULT_MARKER_DIR (default: a folder per TORCHELASTIC_RUN_ID under the temp dir) keeps
    the restarted rank alive.
"""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass

from memx_launch.errors import ConfigError
from memx_launch.specs.inputs import parse_number

GIB = 2**30
BALLAST_VAR = "MEMX_FAULT_BALLAST"
KILL_CALIBRATION_VAR = "MEMX_FAULT_KILL_CALIBRATION"
MARKER_DIR_VAR = "MEMX_FAULT_MARKER_DIR"


def _parse(var: str, text: str, required: tuple[str, ...], optional: dict[str, str]) -> dict[str, str]:
    example = {BALLAST_VAR: "rank=1,step=5,gib=0.5", KILL_CALIBRATION_VAR: "rank=2,after=1"}[var]
    fields = dict(optional)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in required + tuple(optional):
            raise ConfigError(var, f"cannot read {part!r}", f"use e.g. {var}=\"{example}\"")
        fields[key] = value
    missing = [k for k in required if k not in fields]
    if missing:
        raise ConfigError(var, f"missing {missing[0]}", f"use e.g. {var}=\"{example}\"")
    return fields


def _number(var: str, key: str, value: str, kind):
    out = parse_number(value, kind, f"{var}.{key}", f"e.g. {var}=\"rank=1,step=5,gib=0.5\"")
    if out < 0 or (kind is float and out == 0):
        raise ConfigError(f"{var}.{key}", f"must be a {'positive' if kind is float else 'non-negative'} "
                          f"{kind.__name__}, got {value!r}")
    return out


@dataclass
class BallastFault:
    rank: int
    step: int
    gib: float

    def __post_init__(self):
        self._ballast = None

    @classmethod
    def from_text(cls, text: str) -> "BallastFault":
        f = _parse(BALLAST_VAR, text, ("rank", "step", "gib"), {})
        return cls(_number(BALLAST_VAR, "rank", f["rank"], int), _number(BALLAST_VAR, "step", f["step"], int),
                   _number(BALLAST_VAR, "gib", f["gib"], float))

    def before_step(self, step: int, rank: int, emulated=None, device=None) -> bool:
        """Allocate the ballast on the fault's rank from its step on; True when it was allocated now.
        ``emulated``: the rank's EmulatedDevice (the ballast counts against its capacity and
        raises its out-of-memory error when it passes it); else ``device`` (e.g. cuda:0)."""
        import torch

        if rank != self.rank or step < self.step or self._ballast is not None:
            return False
        nbytes = int(self.gib * GIB)
        if emulated is not None:
            self._ballast = torch.empty(nbytes, dtype=torch.uint8)
            emulated.track([self._ballast])
        else:
            self._ballast = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return True


@dataclass
class KillCalibrationFault:
    rank: int
    after: int = 1
    marker_dir: str = ""

    @classmethod
    def from_text(cls, text: str, environ=os.environ) -> "KillCalibrationFault":
        f = _parse(KILL_CALIBRATION_VAR, text, ("rank",), {"after": "1"})
        run_id = environ.get("TORCHELASTIC_RUN_ID", "local")
        marker_dir = environ.get(MARKER_DIR_VAR) or os.path.join(tempfile.gettempdir(), f"memx-faults-{run_id}")
        return cls(_number(KILL_CALIBRATION_VAR, "rank", f["rank"], int),
                   _number(KILL_CALIBRATION_VAR, "after", f["after"], int), marker_dir)

    @property
    def marker(self) -> str:
        return os.path.join(self.marker_dir, f"kill-calibration-rank{self.rank}")

    def after_sample(self, rank: int, samples_done: int) -> None:
        """Call after each calibration sample is stored; dies once on the fault's rank."""
        if rank != self.rank or samples_done < self.after:
            return
        os.makedirs(self.marker_dir, exist_ok=True)
        try:  # O_EXCL: exactly one process ever wins the marker, so the rank dies once
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Faults:
    ballast: BallastFault | None = None
    kill_calibration: KillCalibrationFault | None = None

    @classmethod
    def from_env(cls, environ=os.environ) -> "Faults":
        ballast = environ.get(BALLAST_VAR)
        kill = environ.get(KILL_CALIBRATION_VAR)
        return cls(BallastFault.from_text(ballast) if ballast else None,
                   KillCalibrationFault.from_text(kill, environ) if kill else None)
