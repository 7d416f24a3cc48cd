"""Run directories: where a memx-run job keeps its plan, records and checkpoints, how a run a
signal stopped is found again, and the checks of what the workers will read (profile DB,
``MEMX_*`` variables) made before any worker starts.
"""

from __future__ import annotations

import glob
import os
import warnings

from memx_launch.errors import ConfigError
from memx_launch.files import write_json_atomic
from memx_launch.planning.plan import Plan
from memx_launch.specs.inputs import load_json, parse_number


DEFAULT_RUNS_DIR = "runs"
DEFAULT_PROFILE_DB = os.path.join(DEFAULT_RUNS_DIR, "profiles.jsonl")
CHECKPOINT_DIR = "checkpoints"
STOPPED_FILE = "stopped.json"
LAUNCHER_PID_VAR = "MEMX_LAUNCHER_PID"
"""memx-run's process id, given to its workers: they stop when it is gone."""
COMMAND_VAR = "MEMX_COMMAND"
"""memx-run's command line (JSON), given to its workers for ``stopped.json``."""
DEFAULT_MAX_REPLANS = 3
DEFAULT_CHECKPOINT_EVERY = 10


def _env_int(environ, var: str, default: int) -> int:
    text = environ.get(var, "")
    if not text:
        return default
    value = parse_number(text, int, var, f"e.g. {var}={default}")
    if value < 0:
        raise ConfigError(var, f"must be a non-negative integer, got {text!r}", f"e.g. {var}={default}")
    return value


def max_replans(environ=os.environ) -> int:
    """Re-plans with a restart allowed per run (MEMX_MAX_REPLANS)."""
    return _env_int(environ, "MEMX_MAX_REPLANS", DEFAULT_MAX_REPLANS)


def checkpoint_every(environ=os.environ) -> int:
    """Steps between periodic checkpoints (MEMX_CHECKPOINT_EVERY; 0: none)."""
    return _env_int(environ, "MEMX_CHECKPOINT_EVERY", DEFAULT_CHECKPOINT_EVERY)


def record_stopped(run_dir: str, argv: list[str] | None, cause: str) -> None:
    """The run a signal stopped (or its workers, memx-run gone): the same command line continues
    it (runs.stopped_run_of)."""
    write_json_atomic(os.path.join(run_dir, STOPPED_FILE), {"argv": argv, "signal": cause}, overwrite=True)


def check_profile_db(path: str) -> None:
    """The workers append calibration samples to it and read it back: both checked here."""
    from memx_launch.profiling.profiledb import ProfileDB

    db = ProfileDB(path)
    db.check_appendable("--profile-db")
    if os.path.exists(path):
        with warnings.catch_warnings():  # corrupt lines are the workers' to report (and skip)
            warnings.simplefilter("ignore")
            db.read()


MAX_STOPPED_BYTES = 1 * 2**20
"""A command line and a signal name."""


def stopped_run_of(argv: list[str]) -> str | None:
    """The run directory (under runs/) that the same command line left stopped by a signal:
    running the same command again continues it."""
    stopped = []
    for path in glob.glob(os.path.join(DEFAULT_RUNS_DIR, "*", STOPPED_FILE)):
        try:  # the guarded reader: a FIFO or a huge file here must not stop every later memx-run
            if load_json(path, path, MAX_STOPPED_BYTES).get("argv") == argv:
                stopped.append((os.path.getmtime(path), os.path.dirname(path)))
        except (OSError, ConfigError, AttributeError):
            continue  # not a record memx wrote: ignored
    return max(stopped)[1] if stopped else None


def stopped_state(run_dir: str, profile_db: str) -> str:
    """What a stopped run kept and how to continue it."""
    from memx_launch.runtime.checkpoint import latest_checkpoint

    if not os.path.exists(os.path.join(run_dir, "plan.json")):
        return f"no plan yet; the calibration samples measured are in {profile_db}; to continue, run the same command again"
    try:
        latest = latest_checkpoint(os.path.join(run_dir, CHECKPOINT_DIR))
    except ConfigError:
        latest = None
    kept = f"checkpoint {latest}" if latest else "the plan, no checkpoint yet"
    return f"{kept}; to continue, run the same command again (or with --resume {run_dir})"


def previous_run(run_dir: str, args) -> Plan | None:
    """The plan of the run in ``run_dir`` when it holds one (that run is continued)."""
    path = os.path.join(run_dir, "plan.json")
    if not os.path.exists(path):
        if args.resume:
            raise ConfigError("--resume", f"{run_dir} holds no plan.json", "pass the run directory of a memx-run job")
        return None
    return Plan.load(path)  # the run's latest plan (re-plans rewrite it), not --plan's first one


def check_environment(environ=os.environ) -> None:
    """Every MEMX_* variable the workers read, parsed here: a bad one is one line before any
    worker starts, not a traceback in each."""
    from memx_launch.runtime.calibration import calibration_timeout_s
    from memx_launch.runtime.communication import strict_mode
    from memx_launch.runtime.faults import Faults
    from memx_launch.runtime.monitor import MonitorConfig
    from memx_launch.runtime.watchdog import step_timeout_s

    max_replans(environ)
    checkpoint_every(environ)
    MonitorConfig.from_env(environ)
    Faults.from_env(environ)
    calibration_timeout_s(environ)
    strict_mode(False, environ)
    step_timeout_s(0.0, environ)


def prediction_summary(run_dir: str) -> str | None:
    """How the run's plans held, the rows ``memx evaluate --measurements run_dir`` gives: per plan
    generation its median step against the plan's predicted step, its fullest stage's measured
    peak against the plan's, the range of its stages' compute per micro-batch against the
    plan's and, across communication domains, the bytes its ranks sent over the bridge against
    the plan's count; None where no step went through memx (no metrics file) or the file is not whole
    (evaluate names the line)."""
    from memx_launch.errors import MemxError
    from memx_launch.profiling.run_metrics import METRICS_FILE, run_rows
    from memx_launch.specs.inputs import read_text

    path, fix = os.path.join(run_dir, METRICS_FILE), "memx evaluate --measurements reads it too"
    try:
        with warnings.catch_warnings():  # a generation that measured no step or memory is left out
            warnings.simplefilter("ignore")
            rows = run_rows(read_text(path, "--measurements", fix=fix), path, os.path.basename(run_dir), fix)
    except MemxError:
        return None
    parts = []
    for row in rows:
        part = (f"gen {row['generation']}: step {row['measured_time_s']:.3g} s against {row['predicted_time_s']:.3g} s "
                f"predicted ({row['measured_time_s'] / row['predicted_time_s']:.2f}x)")
        if "measured_memory_bytes" in row:
            part += f", fullest stage's peak {row['measured_memory_bytes'] / row['predicted_memory_bytes']:.2f}x"
        if "stage_compute_over_predicted" in row:
            ratios = row["stage_compute_over_predicted"]
            part += f", stages' compute {min(ratios):.2f}-{max(ratios):.2f}x"
        if "measured_bridge_bytes" in row:
            part += f", bytes over the bridge {row['measured_bridge_bytes'] / row['predicted_bridge_bytes']:.2f}x"
        parts.append(part)
    return f"measured against the plan: {'; '.join(parts)} (memx evaluate --measurements {run_dir})" if parts else None
