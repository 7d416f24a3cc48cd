"""A run's summary over all its generations: a re-plan restarts the workers and a stopped run is
resumed in new processes, so what a script reports at the end (its first loss, the time spent in
steps) travels in the checkpoints (Runtime.save_checkpoint keeps it with the data state)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memx_launch.errors import ConfigError


@dataclass
class RunRecord:
    first_loss: float | None = None
    last_loss: float | None = None
    steps_s: float = 0.0
    """Time in steps, over every generation (restarts and calibration not counted)."""
    resumed_at: list[int] = field(default_factory=list)
    """The steps a generation began at by resuming from a checkpoint."""

    def add(self, loss: float, step_time_s: float) -> None:
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        self.steps_s += step_time_s

    def summary(self, steps: int) -> str:
        """e.g. ``6 steps in 5.2 s, loss 6.3151 -> 6.1022 (resumed at step 4)``."""
        if self.first_loss is None:
            return f"{steps} steps, none run here"
        resumed = f" (resumed at step {', '.join(map(str, self.resumed_at))})" if self.resumed_at else ""
        return f"{steps} steps in {self.steps_s:.1f} s, loss {self.first_loss:.4f} -> {self.last_loss:.4f}{resumed}"

    def to_dict(self) -> dict:
        return {"first_loss": self.first_loss, "last_loss": self.last_loss, "steps_s": self.steps_s,
                "resumed_at": list(self.resumed_at)}

    @classmethod
    def from_dict(cls, record, source: str) -> RunRecord:
        """A checkpoint's record, checked; None (a checkpoint written without one) starts afresh."""
        if record is None:
            return cls()
        losses = ("first_loss", "last_loss")
        if not (isinstance(record, dict) and set(record) == {*losses, "steps_s", "resumed_at"}
                and all(record[k] is None or _finite(record[k]) for k in losses)
                and _finite(record["steps_s"]) and record["steps_s"] >= 0
                and isinstance(record["resumed_at"], list) and all(type(s) is int for s in record["resumed_at"])):
            raise ConfigError(source, "data_state's memx.run is not a run record memx wrote",
                              "resume from another checkpoint, or delete that entry")
        return cls(**record)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
