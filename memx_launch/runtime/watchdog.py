"""A training step that runs far past its prediction becomes a one-line error, not a silent hang.

Runtime.step arms the watchdog around each step. A step still running at its limit (20x the plan's
predicted iteration time, at least 60 s; MEMX_STEP_TIMEOUT_S sets it) prints which rank, stage and
collective it waits in to stderr and ends the process with STEP_TIMEOUT_EXIT_CODE, so that memx-run
(or torchrun) sees a failed worker and stops the job.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

TIMEOUT_VAR = "MEMX_STEP_TIMEOUT_S"
FACTOR = 20
# A loaded CI machine runs a tiny model's step many times slower than predicted without hanging.
FLOOR_S = 60.0
STEP_TIMEOUT_EXIT_CODE = 124  # timeout(1)'s
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def step_timeout_s(predicted_s: float, environ=os.environ) -> float:
    """The limit of one step: MEMX_STEP_TIMEOUT_S, else max(FACTOR x predicted, FLOOR_S)."""
    from memx_launch.specs.inputs import positive_seconds

    return positive_seconds(environ, TIMEOUT_VAR, max(FACTOR * predicted_s, FLOOR_S), TIMEOUT_VAR,
                            f"{TIMEOUT_VAR}=600")


def waiting_in(frame) -> str:
    """The collective or wait the innermost torch.distributed frame of ``frame``'s stack blocks in
    (a c10d call, or a function that waits on one), or "compute"."""
    while frame is not None:
        code = frame.f_code
        if _TORCH_DISTRIBUTED in code.co_filename and (
                code.co_filename.endswith("distributed_c10d.py") or "wait" in code.co_name):
            module = frame.f_globals.get("__name__", "torch.distributed")
            return f"{module}.{code.co_name}"
        frame = frame.f_back
    return "compute"


class StepWatchdog:
    """One thread per rank, started at the first step; ``exit`` ends the process (injectable for tests)."""

    def __init__(self, rank: int, stage: int, device_type: str, predicted_s: float, *,
                 limit_s: float | None = None, exit=os._exit):
        self.where = f"rank {rank} (stage {stage}, {device_type})"
        self.predicted_s = predicted_s
        self.limit_s = step_timeout_s(predicted_s) if limit_s is None else limit_s
        self._exit = exit
        self._changed = threading.Condition()
        self._deadline: float | None = None
        self._step = 0
        self._stepping_thread = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def armed(self, step: int):
        """Around step ``step``, run by this thread."""
        with self._changed:
            self._step, self._stepping_thread = step, threading.get_ident()
            self._deadline = time.monotonic() + self.limit_s
            self._changed.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="memx-step-watchdog", daemon=True)
            self._thread.start()
        try:
            yield
        finally:
            with self._changed:
                self._deadline = None
                self._changed.notify()

    def message(self, step: int, frame) -> str:
        return (f"memx: error: {self.where} step {step} has run {self.limit_s:.0f} s against "
                f"{self.predicted_s:.2f} s predicted, waiting in {waiting_in(frame)}; if it is only slow, "
                f"raise {TIMEOUT_VAR} (now {self.limit_s:.0f})")

    def _watch(self) -> None:
        with self._changed:
            while self._deadline is None or time.monotonic() < self._deadline:
                self._changed.wait(None if self._deadline is None else self._deadline - time.monotonic())
            print(self.message(self._step, sys._current_frames().get(self._stepping_thread)),
                  file=sys.stderr, flush=True)
        self._exit(STEP_TIMEOUT_EXIT_CODE)
