"""The README's main job, measured against its own plan: memx-run calibrates the emulated devices in
the job, plans from what it measured and trains; how far is the step time it predicted from the one
its steps take, and each stage's compute per micro-batch from its prediction?

    python benchmarks/main_job_step_time.py [--runs 3] [--steps 30]

Each run is the README's command (``memx-run --nproc-per-node 4 --cluster
examples/clusters/cpu-emulated.yaml examples/train.py --model llama-tiny``) in a fresh directory,
so that it calibrates afresh; the numbers are read from the run's ``metrics.jsonl`` (the median
of steps 2 and later: the first allocates and warms up). Emulated devices share this machine's
cores, so run it on an otherwise idle machine. Also what the emulated device's dispatch mode
costs the job's block (``guard_cost``): calibration times blocks under it, as the steps run.
Writes benchmarks/results/main_job_step_time.json.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.profiling.run_metrics import METRICS_FILE, run_rows  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "main_job_step_time.json")
CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
SCRIPT = os.path.join(REPO, "examples", "train.py")


def main_job(steps: int) -> dict:
    """One run of the main job in a fresh directory: its plan and its measured against predicted times."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                        "--cluster", CLUSTER, SCRIPT, "--model", "llama-tiny", "--steps", str(steps)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=900, check=True)
        [metrics] = glob.glob(os.path.join(tmp, "runs", "*", METRICS_FILE))
        with open(os.path.join(os.path.dirname(metrics), "plan.json")) as f:
            plan = json.load(f)
        with open(metrics) as f:
            text = f.read()
    # memx evaluate's reading of the run (the medians after the first step, which warms up): the
    # step, and each stage's compute per micro-batch against the plan's
    [row] = run_rows(text, metrics, "main job", "benchmarks/main_job_step_time.py")
    predicted, median = row["predicted_time_s"], row["measured_time_s"]
    stages = []
    for stage, ratio in zip(plan["stages"], row["stage_compute_over_predicted"]):
        wanted = stage["predicted_stage_time_s"]
        stages.append({"device": stage["device_type"], "layers": stage["num_layers"], "recompute": stage["recompute"],
                       "microbatch_ms": round(1e3 * ratio * wanted, 1), "predicted_microbatch_ms": round(1e3 * wanted, 1),
                       "measured_over_predicted": round(ratio, 2)})
    return {"layout": f"tp={plan['tp']} pp={plan['pp']} dp={plan['dp']} mbs={plan['micro_batch_size']} "
                      f"{plan['schedule']}",
            "predicted_step_s": round(predicted, 4), "median_step_s": round(median, 4),
            "measured_over_predicted": round(median / predicted, 2), "stages": stages}


def guard_cost(repeats: int = 40) -> dict:
    """What the emulated device's dispatch mode costs the main job's block: llama-tiny's block
    (micro-batch 2, 64 tokens) forward and backward on one CPU thread, bare, under a dispatch mode
    that only passes each operator on, and under the emulated device at slowdown 1 (its books on
    every tensor); medians of ``repeats`` steps, in turns so that a slow spell of the host lands on all."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from memx_launch.models.llama import TransformerBlock
    from memx_launch.profiling.emulation import EmulatedDevice
    from memx_launch.specs.catalog import get_model

    class PassOn(TorchDispatchMode):
        operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            PassOn.operators += 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    spec = get_model("llama-tiny")
    block = TransformerBlock(spec, "none", "attention", False)
    x = torch.randn(2, 64, spec.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        block(x).backward(dy)

    modes = {"bare": contextlib.nullcontext, "dispatch_mode": PassOn,
             "emulated_device": lambda: EmulatedDevice("guard", 1.0, 1.0)}
    times = {name: [] for name in modes}
    for _ in range(repeats):
        for name, mode in modes.items():
            with mode():
                step()  # the mode's first operators
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    PassOn.operators = 0
    with PassOn():
        step()
    return {"operators_per_step": PassOn.operators,
            **{f"{name}_ms": round(1e3 * statistics.median(t), 2) for name, t in times.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of the main job, each calibrating afresh (default 3)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run, as the README's command (default 30)")
    args = p.parse_args()
    if args.runs < 1 or args.steps < 2:
        p.error("--runs must be at least 1 and --steps at least 2 (the first step is left out)")
    machine = machine_info()
    runs = []
    for n in range(args.runs):
        runs.append(main_job(args.steps))
        r = runs[-1]
        print(f"run {n + 1}: {r['layout']}: median {r['median_step_s']:.3f} s, predicted {r['predicted_step_s']:.3f} s, "
              f"{r['measured_over_predicted']:.2f}x", flush=True)
    cost = guard_cost()
    print(f"llama-tiny block: {cost}", flush=True)
    result = {"machine": machine, "guard_cost": cost, "command": "memx-run --nproc-per-node 4 --cluster examples/clusters/cpu-emulated.yaml "
              f"examples/train.py --model llama-tiny --steps {args.steps}", "runs": runs,
              "measured_over_predicted_median": statistics.median(r["measured_over_predicted"] for r in runs),
              "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    write_json_atomic(OUT, result, overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
