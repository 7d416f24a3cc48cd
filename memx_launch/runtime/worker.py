"""What every memx-run worker process runs: plan in the job when there is no plan yet, then
run the user's script with the plan in its environment.

Planning generation (no plan file yet): every rank detects its device, ranks of each device
type calibrate the minimal sample set together (skipped for types the ProfileDB already
holds), rank 0 gathers and stores the samples, fits the predictor, searches, writes the plan
atomically and broadcasts it; then every rank exits with PLANNED_RESTART_EXIT_CODE and the
elastic agent restarts the workers in place. The restart is recorded in the run directory, so
that it is told apart from a crash and does not count against the user's --max-restarts.

Training generation: per-rank MEMX_* variables (stage, layers, recompute, device type) on top
of the plan's, then the script runs as ``__main__``.

Launcher -> worker contract (environment): MEMX_RUN_DIR, MEMX_PLAN, MEMX_MODEL, MEMX_CLUSTER
(optional), MEMX_PROFILE_DB, MEMX_TRAINING (TrainingSpec JSON), MEMX_OBJECTIVE, MEMX_WEIGHTS,
MEMX_SEARCH_BUDGET_S, MEMX_USER_MAX_RESTARTS, MEMX_REPRODUCE (the script and its arguments).
"""

from __future__ import annotations

import json
import os
import runpy
import sys

PLANNED_RESTART_EXIT_CODE = 75
PLANNED_RESTARTS_FILE = "planned-restarts.json"


def _log(message: str) -> None:
    print(f"memx-run: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- restart accounting


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


def check_crash_budget(run_dir: str, generation: int, user_max_restarts: int) -> None:
    """The agent's budget is the user's plus one per planned restart; crashes get the user's."""
    crashes = generation - len([g for g in planned_restarts(run_dir) if g < generation])
    if crashes > user_max_restarts:
        if os.environ.get("RANK", "0") == "0":  # one line per generation, not one per worker
            _log(f"error: {crashes} crash restart(s) exceed --max-restarts {user_max_restarts}; see the errors above")
        sys.exit(1)


# --------------------------------------------------------------------------- planning generation


def calibrate_device_type(model, cluster, rank_device, descriptions, db, stored, training):
    """This rank's share of calibrating its device type; returns the type's samples on the
    type's first rank (empty elsewhere)."""
    import torch.distributed as dist

    from memx_launch.planning.costmodel import tp_link_gbps
    from memx_launch.runtime.faults import Faults
    from memx_launch.runtime.calibration import TypeCalibration, calibration_timeout_s, make_groups
    from memx_launch.planning.layouts import tp_degrees

    groups = make_groups(cluster, model)
    name = rank_device.device_type.name
    emulated = rank_device.emulated is not None
    calibration = TypeCalibration(
        model, rank_device.device_type, groups[name], db, stored, device="cpu" if emulated else "cuda",
        dtype="fp32" if emulated else training.dtype,
        slowdown=rank_device.emulated.slowdown if emulated else 1.0, tp_link_gbps=lambda tp: tp_link_gbps(cluster, name, tp),
        describe_rank=lambda r: descriptions[r], faults=Faults.from_env(), timeout_s=calibration_timeout_s(),
        log=_log)
    measurements = calibration.run(tp_degrees(model, cluster))
    return measurements if groups[name].ranks[0] == dist.get_rank() else []


def plan_in_job(env) -> None:
    import torch.distributed as dist
    from memx_launch.planning import report
    from memx_launch.planning.plan import Plan
    from memx_launch.profiling.predictor import load_cost_model
    from memx_launch.profiling.profiledb import Measurement, ProfileDB
    from memx_launch.runtime.training import init_distributed
    from memx_launch.runtime.calibration import measurement_key
    from memx_launch.runtime.devices import detect_rank_device
    from memx_launch.runtime.messages import all_gather_json, broadcast_json
    from memx_launch.runtime.monitor import MonitorConfig
    from memx_launch.planning.search import SearchSpace, search
    from memx_launch.planning.objective import parse_weights
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.training import TrainingSpec
    from memx_launch.specs.model import get_model

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = get_model(env["MEMX_MODEL"])
    training = TrainingSpec(**json.loads(env["MEMX_TRAINING"]))
    cluster = ClusterSpec.from_yaml(env["MEMX_CLUSTER"]) if env.get("MEMX_CLUSTER") else None
    rank_device = detect_rank_device(cluster, rank, int(env.get("LOCAL_RANK", "0")))
    described = all_gather_json([rank_device.device_type.name, rank_device.description])
    if cluster is None:
        cluster = _cluster_of_detected(dist, rank_device, world)
    if rank == 0:
        for r, (name, what) in enumerate(described):
            _log(f"rank {r}: {what}")

    db = ProfileDB(env["MEMX_PROFILE_DB"])
    stored_lines = None
    if rank == 0:  # one reading for everyone: ranks must agree on what is left to measure
        stored_lines = [r.to_json() for r in db.read() if r.model_signature == model.signature()] \
            if os.path.exists(db.path) else []
        if stored_lines:
            _log(f"profile {db.path} already holds {len(stored_lines)} samples of {model.name}: "
                 "those are not measured again")
    stored_lines = broadcast_json(stored_lines, src=0)
    stored = [Measurement.from_dict(json.loads(line)) for line in stored_lines]
    mine = calibrate_device_type(model, cluster, rank_device, [d[1] for d in described], db, stored, training)
    gathered = all_gather_json([m.to_json() for m in mine])

    payload = None
    if rank == 0:
        # Each sample was stored by the rank that measured it; a node with its own disk
        # sends them here too.
        have = {measurement_key(m) for m in db.read()} if os.path.exists(db.path) else set()
        records = {measurement_key(m): m for part in gathered
                   for m in map(lambda line: Measurement.from_dict(json.loads(line)), part)}
        missing = [m for k, m in records.items() if k not in have]
        if missing:
            db.append(missing)
        _log(f"profile {db.path}: {len(records)} samples of this job's device types")
        cost_model = load_cost_model(db.path, model, cluster, training)
        weights = parse_weights(env["MEMX_WEIGHTS"]) if env.get("MEMX_WEIGHTS") else None
        budget = float(env["MEMX_SEARCH_BUDGET_S"]) if env.get("MEMX_SEARCH_BUDGET_S") else None
        # Leave the free memory the monitor will ask for, or the first samples would re-plan.
        space = SearchSpace(memory_headroom=0.0 if env.get("MEMX_NO_REPLAN") == "1"
                            else MonitorConfig.from_env(env).min_headroom)
        result = search(model, cluster, training, cost_model=cost_model, space=space,
                        objective=env.get("MEMX_OBJECTIVE") or None,
                        weights=weights, time_budget_s=budget)
        plan = result.best
        plan.save(env["MEMX_PLAN"], overwrite=True)
        print(report.plan_report(result, cluster), flush=True)
        print(report.search_stats_line(result.stats), file=sys.stderr, flush=True)
        print(f"plan written to {env['MEMX_PLAN']}", flush=True)
        print("reproduce this run without searching:\n  " + reproduce_command(plan, cluster, env), flush=True)
        payload = plan.to_dict()
    Plan.from_dict(broadcast_json(payload, src=0), source="broadcast plan")  # every rank checks what it got
    generation = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        record_planned_restart(env["MEMX_RUN_DIR"], generation)
        _log(f"restarting the workers in place with the plan (planned restart after generation {generation})")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(PLANNED_RESTART_EXIT_CODE)


def reproduce_command(plan, cluster, env) -> str:
    """The torchrun line that runs this plan without memx-run (the script builds it from MEMX_PLAN)."""
    import shlex

    from memx_launch.planning.exporters import torchrun_commands

    script_and_args = json.loads(env["MEMX_REPRODUCE"])
    exports = torchrun_commands(plan, cluster, script_and_args[0], script_and_args[1:])
    prefix = f"MEMX_PLAN={shlex.quote(env['MEMX_PLAN'])}"
    if env.get("MEMX_CLUSTER"):
        prefix += f" MEMX_CLUSTER={shlex.quote(env['MEMX_CLUSTER'])}"
    return "\n  ".join(f"{prefix} {shlex.join(e.args)}" for e in exports)


def _cluster_of_detected(dist, rank_device, world):
    """A one-node cluster of what the ranks detected (no cluster file given)."""
    from dataclasses import asdict

    from memx_launch.runtime.messages import all_gather_json
    from memx_launch.specs.cluster import ClusterSpec

    types = all_gather_json(asdict(rank_device.device_type))
    device_types, counts = {}, {}
    for t in types:
        name = t.pop("name")
        device_types[name] = t
        counts[name] = counts.get(name, 0) + 1
    # Links are not measured here: a conservative PCIe-class figure.
    return ClusterSpec.from_dict({"version": 1, "name": "detected", "device_types": device_types,
                                  "nodes": [{"name": "node0", "devices": counts, "intra_node_gbps": 16}]})


# --------------------------------------------------------------------------- training generation


def rank_env(plan, plan_path: str, rank: int, device_type: str | None = None) -> dict[str, str]:
    """The plan's MEMX_* variables plus this rank's own: stage, layers, recompute, device type."""
    from memx_launch.planning.exporters import plan_env
    from memx_launch.runtime.layout import rank_layout

    layout = rank_layout(plan, rank)
    stage = plan.stages[layout.stage]
    env = plan_env(plan, plan_path)
    env.update(MEMX_STAGE=str(layout.stage), MEMX_NUM_LAYERS=str(stage.num_layers),
               MEMX_LAYER_OFFSET=str(layout.chunks[0].layer_offset), MEMX_RECOMPUTE=stage.recompute,
               MEMX_DP_INDEX=str(layout.dp_index), MEMX_TP_INDEX=str(layout.tp_index),
               MEMX_DEVICE_TYPE=device_type or stage.device_type, MEMX_EMULATED=str(int(plan.emulated)))
    return env


def run_script(argv: list[str]) -> None:
    from memx_launch.planning.plan import Plan

    plan_path = os.environ["MEMX_PLAN"]
    os.environ.update(rank_env(Plan.load(plan_path), plan_path, int(os.environ["RANK"])))
    module = argv[0] == "--module"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    import atexit

    from memx_launch.errors import MemxError

    env = os.environ
    code = 0
    try:
        check_crash_budget(env["MEMX_RUN_DIR"], int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                           int(env.get("MEMX_USER_MAX_RESTARTS", "0")))
        if not os.path.exists(env["MEMX_PLAN"]):
            plan_in_job(env)
        run_script(sys.argv[1:])
    except MemxError as exc:
        _log(f"error: {exc}")
        code = exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training (calibration, search): nothing to keep yet
        code = 130
    except SystemExit as exc:  # the script's own exit, or a planned restart
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    # Leave without interpreter finalization: gloo's threads may still hold tensors then and abort
    # the process (SIGABRT) after a clean run, which the agent takes for a crash (seen about once
    # in ten 4-rank runs; pytorch/pytorch#179291). The script's exit handlers still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
