"""Rows per second of ``memx estimate --cases`` with the analytical model (goal: at least 100).

A generated cases file of llama2-7b layouts on examples/clusters/paper-20gpu.yaml: every
(TP, DP) whose stages stay on one device type, micro-batches 1-8, the three recompute levels,
each with an even split and with random uneven splits (seeded), plus one bad row in twenty
(a TP degree that does not divide the heads), so error rows are part of the mix. The command
runs in this process (``memx_launch.cli.main``) and writes the JSON lines to a file; the time
covers reading, every row, the one reference search for Phi the rows share, and writing.

Usage: python benchmarks/estimate_cases_speed.py [--rows 2000] [--repeats 3]
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

CLUSTER = os.path.join(os.path.dirname(HERE), "examples", "clusters", "paper-20gpu.yaml")
COLUMNS = ["id", "model", "cluster", "tp", "pp", "dp", "micro_batch_size", "global_batch_size", "layers_per_stage",
           "recompute"]


def generate(rows: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    shapes = [(tp, dp) for tp, dp in ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1))]
    out = []
    while len(out) < rows:
        tp, dp = shapes[rng.integers(len(shapes))]
        pp = 20 // (tp * dp)
        row = {"id": len(out), "model": "llama2-7b", "cluster": CLUSTER, "tp": tp, "pp": pp, "dp": dp,
               "micro_batch_size": int(rng.choice([1, 2, 4, 8])), "global_batch_size": 64,
               "recompute": str(rng.choice(["none", "selective", "full"])), "layers_per_stage": ""}
        if rng.random() < 0.5:  # uneven split: 32 layers, at least one per stage
            cuts = np.sort(rng.choice(np.arange(1, 32), size=pp - 1, replace=False))
            row["layers_per_stage"] = "/".join(str(x) for x in np.diff(np.concatenate([[0], cuts, [32]])))
        if len(out) % 20 == 19:
            row["tp"] = 3
        out.append(row)
    return out


def run_once(path: str, out: str) -> float:
    start = time.perf_counter()
    code = main(["estimate", "--cases", path, "--out", out, "--force"])
    seconds = time.perf_counter() - start
    assert code == 0, code
    return seconds


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "estimate_cases_speed.json"))
    args = parser.parse_args()
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "cases.csv"), os.path.join(tmp, "out.jsonl")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(generate(args.rows))
        seconds = [run_once(path, out) for _ in range(args.repeats)]
        with open(out) as f:
            results = [json.loads(line) for line in f]
    median = statistics.median(seconds)
    errors = sum("error" in r for r in results)
    fits = sum(r.get("fits", False) for r in results)
    report = {
        "what": "memx estimate --cases, analytical model, llama2-7b on paper-20gpu.yaml, in one process",
        "rows": len(results), "rows_with_error": errors, "rows_fit": fits, "rows_do_not_fit": len(results) - errors - fits,
        "seconds": [round(s, 3) for s in seconds], "seconds_median": round(median, 3),
        "rows_per_second": round(len(results) / median, 1), "goal_rows_per_second": 100,
        "machine": machine,
    }
    write_json_atomic(args.out, report, overwrite=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main_benchmark()
