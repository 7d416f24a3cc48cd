"""Restart accounting shared by memx-run's agent, its workers and the supervisor: which worker
generations ended in a planned restart (a new plan), so that they are told apart from crashes and
not counted against the user's --max-restarts."""

from __future__ import annotations

import os

PLANNED_RESTART_EXIT_CODE = 75
PLANNED_RESTARTS_FILE = "planned-restarts.json"
GENERATION_VAR = "MEMX_GENERATION"


def planned_restarts(run_dir: str) -> list[int]:
    from memx_launch.errors import ConfigError
    from memx_launch.specs.inputs import load_json

    path = os.path.join(run_dir, PLANNED_RESTARTS_FILE)
    if not os.path.exists(path):
        return []
    data = load_json(path, path, fix="delete it (memx-run rewrites it)")
    if not isinstance(data, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in data):
        raise ConfigError(path, "not a list of generations", "delete it (memx-run rewrites it)")
    return data


def record_planned_restart(run_dir: str, generation: int) -> None:
    from memx_launch.files import write_json_atomic
    write_json_atomic(os.path.join(run_dir, PLANNED_RESTARTS_FILE),
                      sorted(set(planned_restarts(run_dir)) | {generation}), overwrite=True)


def restart_generation(environ=os.environ) -> int:
    """How many times this job's workers were started before: memx-run's agent counts planned
    restarts and crash restarts (MEMX_GENERATION); under plain torchrun, its crash restarts."""
    return int(environ.get(GENERATION_VAR) or environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
