"""What every memx-run worker process runs (:func:`run_worker`, started by the elastic agent):
plan in the job when there is no plan yet, then run the user's script with the plan in its
environment.

Planning generation (no plan file yet): every rank detects its device (and, without a cluster
file, the job its cluster: runtime/detection.py), ranks of each device type calibrate the
minimal sample set together (skipped for types the ProfileDB already holds), rank 0 gathers and stores the samples, fits the predictor, searches, writes the plan
atomically and broadcasts it; then every rank exits with PLANNED_RESTART_EXIT_CODE and the
elastic agent restarts the workers in place. The restart is recorded in the run directory, so
that the other ranks tell it apart from a crash; memx-run's agent does not count it against the
user's --max-restarts (the failing workers exit with PLANNED_RESTART_EXIT_CODE, runtime/agent.py).

Training generation: per-rank MEMX_* variables (stage, layers, recompute, device type) on top
of the plan's, then the script runs as ``__main__``.

Launcher -> worker contract (environment): MEMX_RUN_DIR, MEMX_PLAN, MEMX_MODEL, MEMX_CLUSTER
(optional), MEMX_PROFILE_DB, MEMX_TRAINING (TrainingSpec JSON), MEMX_OBJECTIVE, MEMX_WEIGHTS,
MEMX_SEARCH_BUDGET_S, MEMX_SEARCH_RESTRICTIONS (JSON), MEMX_CALIBRATION_BUDGET_S, MEMX_REPRODUCE (the script and its arguments),
MEMX_MODEL_BUILDER (optional: [file, function, model] that builds the script's model,
whose block is calibrated). Without MEMX_CLUSTER the job detects its cluster into <run dir>/cluster.yaml.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from memx_launch.runtime.agent import EXCEPTION, MEMX_ERROR, error_record
from memx_launch.runtime.process_exit import end_process, run_exit_handlers
from memx_launch.runtime.restarts import (GENERATION_VAR, PLANNED_RESTART_EXIT_CODE, record_planned_restart,
                                          restart_generation)
from memx_launch.runtime.worker_env import detected_cluster_path, reproduce_command, search_restrictions


def _log(message: str) -> None:
    print(f"memx-run: {message}", file=sys.stderr, flush=True)


def _report(message: str, kind: str) -> None:
    """A failure of this rank, for memx-run's one line about the job (runtime/agent.py): written
    to torchrun's error file, where the agent reads it; printed when there is none."""
    from memx_launch.files import write_json_atomic

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            write_json_atomic(path, error_record(message, kind), overwrite=True)
            return
        except OSError:
            pass
    if kind == MEMX_ERROR:
        _log(f"error: {message}")


# --------------------------------------------------------------------------- planning generation


def sample_budgets(model, cluster, speeds: dict[str, float], stored) -> dict[str, tuple[int, float]]:
    """(samples, estimated seconds per sample) of each device type, from its first rank's speed and
    MEMX_CALIBRATION_BUDGET_S; the same on every rank, so that a refusal stops every rank. A type the
    profile already holds samples of is not limited (most of its samples are read back)."""
    from memx_launch.planning.layouts import tp_degrees
    from memx_launch.runtime.calibration import (CALIBRATION_BUDGET, calibration_budget_s, sample_budget,
                                                 seconds_per_sample)

    budgets = {}
    for name, tflops in speeds.items():
        slowdown = cluster.emulation.slowdown_of(name) if cluster.is_emulated else 1.0
        per_sample = seconds_per_sample(model, tp_degrees(model, cluster), tflops, slowdown)
        known = any(m.device_type == name for m in stored)
        budgets[name] = (CALIBRATION_BUDGET if known else sample_budget(model, name, per_sample, calibration_budget_s()),
                         per_sample)
    return budgets


def calibrate_device_type(model, cluster, rank_device, descriptions, db, stored, training, budget,
                          user_parts=None, searched_tp=None, run_options=None):
    """This rank's share of calibrating its device type; returns the type's samples on the
    type's first rank (empty elsewhere). ``budget``: (samples, estimated seconds per sample).
    ``user_parts``: the model whose own block is measured (prepare.user_block_parts), with
    ``run_options`` (its records' options: how it runs, models/block_reading.py). Measured at
    the TP degrees the search can choose, ``searched_tp`` (memx-run's restriction: TP 1 for
    blocks memx does not split by TP) or all."""
    import torch.distributed as dist

    from memx_launch.planning.tp_links import tp_link
    from memx_launch.runtime.faults import Faults
    from memx_launch.runtime.calibration import TypeCalibration, calibration_timeout_s, make_groups
    from memx_launch.planning.layouts import tp_degrees

    groups = make_groups(cluster, model)
    name = rank_device.device_type.name
    emulated = rank_device.emulated is not None
    calibration = TypeCalibration(
        model, rank_device.device_type, groups[name], db, stored, device="cpu" if emulated else "cuda",
        dtype=training.dtype,
        slowdown=rank_device.emulated.slowdown if emulated else None, tp_link=lambda tp: tp_link(cluster, name, tp),
        describe_rank=lambda r: descriptions[r], faults=Faults.from_env(), timeout_s=calibration_timeout_s(),
        log=_log, user_parts=user_parts, selective_policy=training.selective_recompute, run_options=run_options)
    measurements = calibration.run([d for d in tp_degrees(model, cluster) if searched_tp is None or d in searched_tp],
                                   *budget)
    return measurements if groups[name].ranks[0] == dist.get_rank() else []


def plan_in_job(env) -> None:
    import torch.distributed as dist
    from memx_launch.errors import ConfigError
    from memx_launch.planning import report
    from memx_launch.planning.plan import Plan
    from memx_launch.profiling.kernel import CALIBRATED_AS
    from memx_launch.profiling.predictor import load_cost_model
    from memx_launch.profiling.profiledb import BridgeMeasurement, Measurement, ProfileDB
    from memx_launch.runtime.calibration import measure_bridges
    from memx_launch.runtime.communication import init_distributed
    from memx_launch.runtime.calibration import measurement_key
    from memx_launch.runtime.devices import calibration_tflops, detect_rank_device
    from memx_launch.runtime.messages import all_gather_json, broadcast_json
    from memx_launch.planning.search import search
    from memx_launch.runtime.job_planning import block_training, job_search_space
    from memx_launch.planning.objective import parse_weights
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.training import TrainingSpec
    from memx_launch.planning.runtime_support import as_memx_run_trains
    from memx_launch.specs.catalog import get_model

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = as_memx_run_trains(get_model(env["MEMX_MODEL"]))
    training = TrainingSpec(**json.loads(env["MEMX_TRAINING"]))
    cluster = ClusterSpec.from_yaml(env["MEMX_CLUSTER"]) if env.get("MEMX_CLUSTER") else None
    if cluster is not None and cluster.world_size != world:
        raise ConfigError("--cluster", f"{env['MEMX_CLUSTER']} declares {cluster.world_size} devices but the "
                          f"rendezvous gathered {world} processes", "start each node with its own device count "
                          "(memx-run takes it from the file when --nproc-per-node is not given)")
    rank_device = detect_rank_device(cluster, rank, int(env.get("LOCAL_RANK", "0")))
    described = all_gather_json([rank_device.device_type.name, rank_device.description,
                                 calibration_tflops(rank_device, cluster is not None)])
    if cluster is None:  # detected: devices, hosts and measured links, written into the run directory
        from memx_launch.runtime.detection import write_detected
        cluster = ClusterSpec.from_dict(write_detected(rank_device, detected_cluster_path(env["MEMX_RUN_DIR"]),
                                                       overwrite=True))
    if rank == 0:
        for r, (name, what, _) in enumerate(described):
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
    speeds: dict[str, float] = {}
    for name, _, tflops in described:  # each type's first rank's
        speeds.setdefault(name, tflops)
    budgets = sample_budgets(model, cluster, speeds, stored)
    # The script's own block (--model-builder), a config's own, or None: planned and calibrated as
    # it runs (GPT-2's one c_attn).
    user_parts, training, own = block_training(env, model, training)
    mine = calibrate_device_type(model, cluster, rank_device, [d[1] for d in described], db, stored, training,
                                 budgets[rank_device.device_type.name], user_parts,
                                 search_restrictions(env).get("tp_degrees"),
                                 {**CALIBRATED_AS, **own} if own else None)
    gathered = all_gather_json([m.to_json() for m in mine])
    bridges = measure_bridges(cluster.rank_domains()) if cluster.crosses_domains else []

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
        if bridges:  # this job's bridge, as it runs now: the planner prices crossings with it
            db.append_bridge(BridgeMeasurement(domains, cluster.bridge.backend, nbytes, seconds, ranks)
                             for domains, ranks, nbytes, seconds in bridges)
            for domains, _, nbytes, seconds in bridges:
                _log(f"bridge {domains[0]} <-> {domains[1]} ({cluster.bridge.backend}): "
                     f"{nbytes / 2**10:,.0f} KiB one way in {seconds * 1e3:.2f} ms (measured)")
        _log(f"profile {db.path}: {len(records)} samples of this job's device types")
        cost_model = load_cost_model(db.path, model, cluster, training)
        weights = parse_weights(env["MEMX_WEIGHTS"]) if env.get("MEMX_WEIGHTS") else None
        budget = float(env["MEMX_SEARCH_BUDGET_S"]) if env.get("MEMX_SEARCH_BUDGET_S") else None
        result = search(model, cluster, training, cost_model=cost_model, space=job_search_space(env),
                        objective=env.get("MEMX_OBJECTIVE") or None,
                        weights=weights, time_budget_s=budget)
        plan = result.best
        plan.save(env["MEMX_PLAN"], overwrite=True)
        print(report.plan_report(result, cluster), flush=True)
        print(report.search_stats_line(result.stats), file=sys.stderr, flush=True)
        print(f"plan written to {env['MEMX_PLAN']}", flush=True)
        print("reproduce this run without searching:\n  " + reproduce_command(plan, cluster, env), flush=True)
        payload = plan.to_dict()
    plan = Plan.from_dict(broadcast_json(payload, src=0), source="broadcast plan")  # every rank checks what it got
    generation = restart_generation(env)
    if int(env.get("LOCAL_RANK", "0")) == 0:  # every node's run directory (nodes need not share a disk)
        if rank != 0:
            plan.save(env["MEMX_PLAN"], overwrite=True)
        record_planned_restart(env["MEMX_RUN_DIR"], generation)
    if rank == 0:
        _log(f"restarting the workers in place with the plan (planned restart after generation {generation})")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(PLANNED_RESTART_EXIT_CODE)


def rank_env(plan, plan_path: str, rank: int, device_type: str | None = None) -> dict[str, str]:
    """The plan's MEMX_* variables plus this rank's own: stage, layers, recompute, device type."""
    from memx_launch.planning.launch_lines import plan_env
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

    from memx_launch.errors import ConfigError

    plan_path = os.environ["MEMX_PLAN"]
    plan = Plan.load(plan_path)
    world = int(os.environ.get("WORLD_SIZE", plan.world_size))
    if plan.world_size != world:
        raise ConfigError("--plan", f"{plan_path} needs {plan.world_size} ranks but the rendezvous gathered {world}",
                          "pass a plan made for this job's devices, or drop --plan to plan in the job")
    os.environ.update(rank_env(plan, plan_path, int(os.environ["RANK"])))
    module = argv[0] == "--module"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def run_worker(generation: str, *argv: str) -> None:
    """One worker process: ``generation`` is how many times the agent started the workers before
    (planned restarts included), ``argv`` the script (or ``--module`` and a module) and its
    arguments. Returns when the script ended well; any other end exits the process with its code."""
    import torch

    from memx_launch.errors import MemxError

    env = os.environ
    env[GENERATION_VAR] = generation
    if env.get("OMP_NUM_THREADS", "").isdigit():  # the fork server loaded torch before torchrun chose it
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # as `python -u`: the ranks' lines show as printed
    _name_process(f"memx-rank{env['RANK']}")
    code = 0
    try:
        if not os.path.exists(env["MEMX_PLAN"]):
            plan_in_job(env)
        run_script(list(argv))
    except MemxError as exc:
        _report(f"{exc}", MEMX_ERROR)
        code = exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training (calibration, search): nothing to keep yet
        code = 130
    except SystemExit as exc:  # the script's own exit, or a planned restart
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except Exception as exc:  # noqa: BLE001 - the traceback is printed; memx-run names the rank once
        import traceback

        traceback.print_exc()
        _report(f"{type(exc).__name__}: {exc}".splitlines()[0], EXCEPTION)
        code = 1
    # No interpreter finalization (process_exit.end_process): a failed run exits here, a clean one
    # returns to multiprocessing, which ends a forked worker with os._exit once the agent has its
    # result (not under --start-method spawn). The script's exit handlers run either way.
    if code:
        end_process(code)
    run_exit_handlers()


def _name_process(name: str) -> None:
    """What ps -o comm, top and psutil call this process: the workers share the fork server's
    command line. Linux only; elsewhere the name stays."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name)
    except OSError:
        pass
