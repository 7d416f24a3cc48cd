"""Rows per second of ``memx estimate --cases`` (goals: 1,000 rows/s over 30 setups, 100 rows/s
with a profile DB of several models).

Three generated cases files, each run by the command in this process (``memx_launch.cli.main``)
writing its JSON lines to a file; the time covers reading, every row and writing. One bad row
in twenty (a TP degree that does not divide the heads) keeps error rows in the mix. Rows mix
(TP, DP) shapes whose stages stay on one device type, micro-batches 1-8, the three recompute
levels, even splits and random uneven ones (seeded).

- ``one_setup``: llama2-7b on examples/clusters/paper-20gpu.yaml, the analytical model; also
  with ``--phi`` (one reference search shared by every row).
- ``thirty_setups``: 3 models x 2 clusters x 5 training setups, the analytical model, no Phi.
- ``profile_db``: the models of ``thirty_setups`` on paper-20gpu.yaml, 2 training setups, with
  ``--profile-db`` holding synthetic records of all three models (the analytical costs times a
  shape-dependent ratio). The first run fits the predictor (one fit for the whole DB) and is
  reported apart; the repeats reuse its cached file.

Usage: python benchmarks/estimate_cases_speed.py [--rows 1000] [--repeats 3]
       [--out benchmarks/results/estimate_cases_speed.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.cli import main  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning.costmodel import RECOMPUTE_LEVELS, AnalyticalCostModel  # noqa: E402
from memx_launch.profiling.profiledb import Measurement, ProfileDB  # noqa: E402
from memx_launch.specs.cluster import ClusterSpec  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

CLUSTERS = os.path.join(os.path.dirname(HERE), "examples", "clusters")
PAPER20, TABLE1 = os.path.join(CLUSTERS, "paper-20gpu.yaml"), os.path.join(CLUSTERS, "table1-2vendor.yaml")
# (tp, dp) whose stages stay on one device type in the cluster's rank order; pp = world / (tp dp).
SHAPES = {PAPER20: ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1)),
          TABLE1: ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2))}
MODELS = ("llama2-7b", "llama3-8b", "tinyllama-1.1b")
TRAININGS = ({}, {"distributed_optimizer": "true"}, {"setup": "megatron"}, {"dtype": "fp16"},
             {"seq_len": 2048, "distributed_optimizer": "true"})
TRAINING_COLUMNS = ("distributed_optimizer", "setup", "dtype", "seq_len")
COLUMNS = ["id", "model", "cluster", "tp", "pp", "dp", "micro_batch_size", "global_batch_size", "layers_per_stage",
           "recompute", *TRAINING_COLUMNS]


def generate(rows: int, setups: list[tuple[str, str, dict]], seed: int = 0) -> list[dict]:
    """``rows`` layouts over ``setups`` ((model, cluster, training columns)), in random order."""
    rng = np.random.default_rng(seed)
    layers = {name: get_model(name).num_layers for name in {m for m, _, _ in setups}}
    world = {c: ClusterSpec.from_yaml(c).world_size for c in {c for _, c, _ in setups}}
    out = []
    while len(out) < rows:
        model, cluster, training = setups[rng.integers(len(setups))]
        tp, dp = SHAPES[cluster][rng.integers(len(SHAPES[cluster]))]
        pp = world[cluster] // (tp * dp)
        row = {"id": len(out), "model": model, "cluster": cluster, "tp": tp, "pp": pp, "dp": dp,
               "micro_batch_size": int(rng.choice([1, 2, 4, 8])), "global_batch_size": 64,
               "recompute": str(rng.choice(RECOMPUTE_LEVELS)), "layers_per_stage": "", **training}
        n = layers[model]
        if rng.random() < 0.5:  # uneven split, at least one layer per stage
            cuts = np.sort(rng.choice(np.arange(1, n), size=pp - 1, replace=False))
            row["layers_per_stage"] = "/".join(str(x) for x in np.diff(np.concatenate([[0], cuts, [n]])))
        if len(out) % 20 == 19:
            row["tp"] = 3
        out.append(row)
    return out


def synthetic_profile(path: str, cluster_path: str, models) -> int:
    """A profile DB of ``models`` on every device type of the cluster: the analytical block
    costs times a ratio that falls with the micro-batch (as thin matmuls do). Returns its records."""
    cluster = ClusterSpec.from_yaml(cluster_path)
    records = []
    for name in models:
        model = get_model(name)
        cost = AnalyticalCostModel(model, cluster, TrainingSpec(seq_len=model.seq_len))
        for d, device in enumerate(cluster.device_types):
            descriptors = {k: v for k, v in vars(device).items() if k != "name"}
            for tp in (1, 2):
                for mbs in (1, 2, 4):
                    for r, level in enumerate(RECOMPUTE_LEVELS):
                        c = cost.layer_costs([d], [tp], [mbs], [model.seq_len], [r])
                        records.append(Measurement(
                            device_type=device.name, device=descriptors, model=model.name,
                            model_signature=model.signature(), block_shape=model.to_dict(), tp=tp,
                            micro_batch_size=mbs, seq_len=model.seq_len, recompute=level, dtype="bf16", num_blocks=1,
                            feasible=True, time_s=float(c.time_s[0] * (1.2 + 0.4 / mbs)),
                            peak_memory_bytes=float((c.activation_bytes[0] + c.working_bytes[0]) * 1.05),
                            tp_link_gbps=100.0 if tp > 1 else None))
    ProfileDB(path).append(records)
    return len(records)


def write_cases(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def run_once(path: str, out: str, *flags: str) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one run (the CPU time is what shared machines disturb less)."""
    start, cpu = time.perf_counter(), time.process_time()
    code = main(["estimate", "--cases", path, "--out", out, "--force", *flags])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert code == 0, code
    return seconds, cpu


def measure(name: str, what: str, rows: list[dict], tmp: str, repeats: int, *flags: str, cold: bool = False) -> dict:
    path, out = os.path.join(tmp, f"{name}.csv"), os.path.join(tmp, f"{name}.jsonl")
    write_cases(path, rows)
    first = run_once(path, out, *flags)[0] if cold else None
    seconds, cpu = zip(*(run_once(path, out, *flags) for _ in range(repeats)))
    with open(out) as f:
        results = [json.loads(line) for line in f]
    median = statistics.median(seconds)
    errors = sum("error" in r for r in results)
    fits = sum(r.get("fits", False) for r in results)
    setups = {(r["model"], r["cluster"], *(r[c] for c in TRAINING_COLUMNS if c in r)) for r in rows}
    report = {"what": what, "flags": list(flags), "rows": len(results), "distinct_setups": len(setups),
              "rows_with_error": errors, "rows_fit": fits, "rows_do_not_fit": len(results) - errors - fits,
              "rows_with_phi": sum("phi" in r for r in results),
              "seconds": [round(s, 3) for s in seconds], "seconds_median": round(median, 3),
              "rows_per_second": round(len(results) / median, 1),
              "cpu_seconds": [round(s, 3) for s in cpu],
              "rows_per_cpu_second": round(len(results) / statistics.median(cpu), 1)}
    if cold:
        report["first_run_seconds_with_the_fit"] = round(first, 3)
        report["first_run_rows_per_second"] = round(len(results) / first, 1)
    print(name, json.dumps(report), flush=True)
    return report


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "estimate_cases_speed.json"))
    args = parser.parse_args()
    machine = machine_info()
    thirty = [(m, c, t) for m in MODELS for c in (PAPER20, TABLE1) for t in TRAININGS]
    one = [("llama2-7b", PAPER20, {})]
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        one_rows = generate(args.rows, one)
        cases["one_setup"] = measure("one_setup", "llama2-7b on paper-20gpu.yaml, analytical model, no Phi",
                                     one_rows, tmp, args.repeats)
        cases["one_setup_phi"] = measure("one_setup_phi", "the same rows with --phi (one reference search)",
                                         one_rows, tmp, args.repeats, "--phi")
        cases["thirty_setups"] = measure(
            "thirty_setups", "3 models x 2 clusters x 5 training setups, analytical model, no Phi",
            generate(args.rows, thirty), tmp, args.repeats)
        db = os.path.join(tmp, "profile.jsonl")
        records = synthetic_profile(db, PAPER20, MODELS)
        cases["profile_db"] = measure(
            "profile_db", f"3 models x 2 training setups on paper-20gpu.yaml, --profile-db of {records} synthetic "
            "records of the 3 models (first run: fits the predictor once; repeats: its cached file)",
            generate(args.rows, [(m, PAPER20, t) for m in MODELS for t in TRAININGS[:2]]), tmp, args.repeats,
            "--profile-db", db, cold=True)
    report = {"what": "memx estimate --cases in one process, rows per second by cases file",
              "goal_rows_per_second": {"thirty_setups": 1000, "profile_db": 100}, "cases": cases,
              "machine": machine}
    write_json_atomic(args.out, report, overwrite=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main_benchmark()
