"""What a fully sharded pipeline stage holds under memx-run, measured against what memx counts.

memx-run runs FSDP2 under torch's pipeline schedules, which keep each stage's gathered weights and
unsharded gradients from its first backward to the step's end (``--hold-gathered``, docs/setups.md).
This runs llama-tiny on ``examples/clusters/cpu-emulated.yaml`` (4 CPU processes, gloo; memory is
the emulated guard's count of live tensor bytes on each rank) with one layout, PP 2 x DP 2, fully
sharded, in fp32 and in bf16 (autocast, FSDP2 gathering in bf16 and reducing in fp32), and holds
each stage's measured peak of the last step against the plan's prediction as memx-run runs it
(``always``, its stages' in-flight outputs kept: ``--keep-stage-outputs``) and as memx counted
every fully sharded stage before (``never``: a layer gathered at a time, its gradients
reduce-scattered every micro-batch). Uncalibrated: the plans are ``memx estimate``'s analytical
ones. Then ``memx-run --fully-sharded --tp 1 --pp 2`` plans the same job itself, after
calibrating each device type in the job (fp32, ``in_job``). Last, across communication domains
(``across_domains``, fp32): one stage of DP 4 over ``examples/clusters/cpu-two-vendors.yaml``'s
two vendors (its small type given 60 MiB, so that the stage fits), fully sharded, which memx-run
shards within each vendor's two ranks and averages over the bridge (planning/hybrid_sharding.py).

    python benchmarks/fsdp_pipeline_memory.py [--steps 3]

Writes benchmarks/results/fsdp_pipeline_memory.json (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.dropin import STAGE  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "fsdp_pipeline_memory.json")
CLUSTER = os.path.join(REPO, "examples", "clusters", "cpu-emulated.yaml")
LAYOUT = ["--model", "llama-tiny", "--cluster", CLUSTER, "--fully-sharded", "--tp", "1", "--pp", "2", "--dp", "2",
          "--micro-batch-size", "1", "--global-batch-size", "16", "--seq-len", "64",
          "--keep-stage-outputs"]


def estimate(tmp: str, dtype: str, hold: str, layout=tuple(LAYOUT)) -> tuple[str, list[float]]:
    """The plan file of the layout and its stages' predicted peaks in MiB."""
    path = os.path.join(tmp, f"{dtype}-{hold}.json")
    subprocess.run([sys.executable, "-m", "memx_launch.cli", "estimate", *layout, "--dtype", dtype,
                    "--hold-gathered", hold, "--json", path], capture_output=True, text=True, timeout=300,
                   check=True)
    with open(path) as f:
        return path, [s["predicted_peak_memory_gib"] * 1024 for s in json.load(f)["stages"]]


def memx_run(tmp: str, flags: list[str], steps: int, cluster: str = CLUSTER) -> tuple[str, str]:
    """memx-run's 4 ranks training llama-tiny with ``flags``: its plan line and its last step's line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMX_")}
    run = subprocess.run([sys.executable, "-m", "memx_launch.runtime.launcher", "--nproc-per-node", "4",
                          "--cluster", cluster, *flags, os.path.join(REPO, "examples", "train.py"),
                          "--model", "llama-tiny", "--steps", str(steps)],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=900, check=True)
    lines = run.stdout.splitlines()
    return ([line for line in lines if line.startswith("training ")][-1],
            [line for line in lines if line.startswith(f"step {steps} |")][-1])


def measure(dtype: str, steps: int) -> dict:
    """The estimate's plan run: its stages' last-step peaks against both counts."""
    with tempfile.TemporaryDirectory() as tmp:
        plan, held = estimate(tmp, dtype, "always")
        _, per_microbatch = estimate(tmp, dtype, "never")
        _, last = memx_run(tmp, ["--plan", plan], steps)
    stages = []
    for (stage, device, measured, predicted), never in zip(STAGE.findall(last), per_microbatch):
        stages.append({"stage": int(stage), "device": device, "measured_mib": float(measured),
                       "predicted_mib": round(held[int(stage)], 2), "predicted_mib_gathered_every_microbatch":
                       round(never, 2), "measured_over_predicted": round(float(measured) / held[int(stage)], 3),
                       "measured_over_predicted_gathered_every_microbatch": round(float(measured) / never, 3)})
        assert abs(float(predicted) - held[int(stage)]) < 0.06, (predicted, held)  # the run's plan is the estimate's
    return {"last_step": last, "stages": stages}


def planned_in_job(steps: int) -> dict:
    """memx-run's own fully sharded plan (calibrated in the job), its stages' last-step peaks."""
    with tempfile.TemporaryDirectory() as tmp:
        plan, last = memx_run(tmp, ["--fully-sharded", "--tp", "1", "--pp", "2"], steps)
    stages = []
    for stage, device, measured, predicted in STAGE.findall(last):
        ratio = round(float(measured) / float(predicted), 3)
        stages.append({"stage": int(stage), "device": device, "measured_mib": float(measured),
                       "predicted_mib": float(predicted), "measured_over_predicted": ratio})
    return {"plan": plan, "last_step": last, "stages": stages}


def across_domains(steps: int) -> dict:
    """A fully sharded stage whose DP group spans two vendors: its peak against the estimate."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = os.path.join(tmp, "two-vendors.yaml")
        with open(os.path.join(REPO, "examples", "clusters", "cpu-two-vendors.yaml")) as f:
            text = f.read()
        with open(cluster, "w") as f:
            f.write(text.replace("memory_gib: 0.025 ", "memory_gib: 0.06  "))
        layout = ["--model", "llama-tiny", "--cluster", cluster, "--fully-sharded", "--tp", "1", "--pp", "1",
                  "--dp", "4", "--stage-devices", "nv-small+amd-big", "--micro-batch-size", "1",
                  "--global-batch-size", "16", "--seq-len", "64", "--keep-stage-outputs"]
        plan, predicted = estimate(tmp, "fp32", "always", layout)
        _, last = memx_run(tmp, ["--plan", plan], steps, cluster)
    [(stage, device, measured, _)] = STAGE.findall(last)
    return {"last_step": last, "layout": " ".join(layout[4:]), "device": device, "measured_mib": float(measured),
            "predicted_mib": round(predicted[0], 2), "measured_over_predicted": round(float(measured) / predicted[0], 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    result = {"machine": machine_info(), "steps": args.steps, "layout": " ".join(LAYOUT[4:]),
              **{dtype: measure(dtype, args.steps) for dtype in ("fp32", "bf16")}, "in_job": planned_in_job(args.steps),
              "across_domains": across_domains(args.steps)}
    write_json_atomic(OUT, result, overwrite=True)
    for dtype in ("fp32", "bf16"):
        print(dtype, [(s["measured_over_predicted"], s["measured_over_predicted_gathered_every_microbatch"])
                      for s in result[dtype]["stages"]])
    print("in_job", [s["measured_over_predicted"] for s in result["in_job"]["stages"]])
    print("across_domains", result["across_domains"]["measured_over_predicted"])
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
