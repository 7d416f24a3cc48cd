"""What memx-run hands its workers besides torchrun's variables: the cluster file, the search
restrictions and the line that reproduces a plan (the MEMX_* contract: runtime/worker.py)."""

from __future__ import annotations

import json
import os

DETECTED_CLUSTER_FILE = "cluster.yaml"


def search_restrictions(env) -> dict:
    """memx-run's --tp/--pp/--micro-batch-sizes/--schedules/--recompute-levels (lists) and
    --mixed-stages (a flag), as SearchSpace fields."""
    return {field: tuple(values) if isinstance(values, list) else values
            for field, values in json.loads(env.get("MEMX_SEARCH_RESTRICTIONS") or "{}").items()}


def reproduce_command(plan, cluster, env) -> str:
    """The torchrun line that runs this plan without memx-run (the script builds it from MEMX_PLAN)."""
    import shlex

    from memx_launch.planning.launch_lines import torchrun_commands

    script_and_args = json.loads(env["MEMX_REPRODUCE"])
    exports = torchrun_commands(plan, cluster, script_and_args[0], script_and_args[1:],
                                master_addr=env.get("MASTER_ADDR") if len(cluster.nodes) > 1 else None)
    prefix = f"MEMX_PLAN={shlex.quote(env['MEMX_PLAN'])}"
    if cluster_path(env):
        prefix += f" MEMX_CLUSTER={shlex.quote(cluster_path(env))}"
    return "\n  ".join(f"{prefix} {shlex.join(e.args)}" for e in exports)


def detected_cluster_path(run_dir: str) -> str:
    return os.path.join(run_dir, DETECTED_CLUSTER_FILE)


def cluster_path(environ) -> str | None:
    """The job's cluster file: --cluster's, else the one detected into the run directory."""
    if environ.get("MEMX_CLUSTER"):
        return environ["MEMX_CLUSTER"]
    detected = detected_cluster_path(environ.get("MEMX_RUN_DIR", ""))
    return detected if environ.get("MEMX_RUN_DIR") and os.path.exists(detected) else None
