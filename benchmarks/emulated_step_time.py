"""Measured against predicted step time of every parallel form on the emulated clusters (issues 20
and 22: within 3x): examples/clusters/cpu-emulated.yaml, and cpu-two-vendors.yaml for pipelines and
DP groups that cross vendors (the bridge's staging and gloo transfers are in the step). llama-tiny,
4 gloo ranks in one launch, strict domains, each form trained for a few steps under the plan memx's
analytical model evaluates for its layout (memx estimate's); the emulated devices sleep to their
types' speed, so the ratio says how well the emulation and the model agree, not how fast a GPU is.

    python benchmarks/emulated_step_time.py [--steps 6]

Writes benchmarks/results/emulated_step_time.json (the first step of a form, which builds DTensor's
sharding caches and DDP's buckets, is left out of the median; run it on an otherwise idle machine).
tests/test_emulated_forms.py trains the same forms for three steps and bounds them looser.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "emulated_step_time.json")
CLUSTERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "clusters")
TARGET = 3.0
# One layout per form (memx estimate's arguments), near what memx's search picks when restricted to
# the form (it finds no interleaved plan here) but with memory to spare: the analytical model's
# peaks are a few MiB short on the small device, which the emulated guard would refuse. The
# cluster's two device types, two devices each, cannot hold TP 2 in one stage of all 4 ranks (a
# stage has one type): TP 2 runs as TP 2 x PP 2. A form runs on cpu-emulated.yaml unless it names
# another cluster file; on cpu-two-vendors.yaml "+" joins the types of a stage whose DP replicas
# span both vendors.
FORMS = {
    "tp2 x pp2": dict(tp=2, pp=2, dp=1, micro_batch_size=8, stage_devices=["slow-big", "fast-small"],
                      layers_per_stage=[3, 5], recompute=["none", "full"]),
    "pp4": dict(tp=1, pp=4, dp=1, micro_batch_size=4,
                stage_devices=["slow-big", "slow-big", "fast-small", "fast-small"],
                layers_per_stage=[1, 1, 3, 3], recompute=["none", "none", "full", "full"]),
    "dp2 x pp2": dict(tp=1, pp=2, dp=2, micro_batch_size=4, stage_devices=["slow-big", "fast-small"],
                      layers_per_stage=[3, 5], recompute=["none", "full"]),
    "interleaved pp4 v2": dict(tp=1, pp=4, dp=1, micro_batch_size=4, schedule="interleaved", virtual_stages=2,
                               stage_devices=["slow-big", "slow-big", "fast-small", "fast-small"],
                               layers_per_stage=[2, 2, 2, 2], recompute=["none", "none", "full", "full"]),
    "tp2 x pp2 interleaved v2": dict(tp=2, pp=2, dp=1, micro_batch_size=8, schedule="interleaved", virtual_stages=2,
                                     stage_devices=["slow-big", "fast-small"], layers_per_stage=[4, 4],
                                     recompute=["none", "full"]),
    "dp2 x pp2, pipeline across vendors": dict(cluster="cpu-two-vendors.yaml", tp=1, pp=2, dp=2, micro_batch_size=4,
                                               stage_devices=["nv-small", "amd-big"], layers_per_stage=[2, 6],
                                               recompute=["full", "none"]),
    "dp2 x pp2, DP groups across vendors": dict(cluster="cpu-two-vendors.yaml", tp=1, pp=2, dp=2, micro_batch_size=4,
                                                stage_devices=["nv-small+amd-big", "nv-small+amd-big"],
                                                layers_per_stage=[4, 4], recompute=["full", "full"]),
}


def form_plans() -> dict:
    """{form: (its ClusterSpec, the Plan memx's analytical model evaluates for its layout)}
    (memx-run's defaults for llama-tiny)."""
    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.catalog import get_model
    from memx_launch.specs.training import TrainingSpec

    training = TrainingSpec(global_batch_size=16, seq_len=64, dtype="fp32")
    plans = {}
    for name, form in FORMS.items():
        layout = dict(form)
        cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, layout.pop("cluster", "cpu-emulated.yaml")))
        plans[name] = cluster, evaluate_layout(get_model("llama-tiny"), cluster, training, references=(1, 1, 1),
                                               **layout)
    return plans


def train_forms(rank: int, port: int, steps: int, queue) -> None:
    """One rank of the 4: every form's plan for ``steps`` steps; puts ``(rank, {form: (layout,
    predicted s, [step s])})`` on ``queue`` (an empty dict if it failed: the rank's output says why)."""
    import torch.distributed as dist
    from memx_launch.planning.report import layout_summary
    from memx_launch.runtime.communication import init_distributed
    from memx_launch.profiling.emulation import device_for_rank
    from memx_launch.runtime.training import Runtime

    # As memx-run starts a rank: 4 on this machine's cores, strict domains (the emulated default).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4",
                      LOCAL_WORLD_SIZE="4", MEMX_STRICT_DOMAINS="1")
    results = {}
    try:
        for generation, (name, (cluster, plan)) in enumerate(form_plans().items()):
            # Each plan orders the stages its own way: a process group per form (a fresh key prefix),
            # ranked as memx-run ranks it.
            os.environ["MEMX_GENERATION"] = str(generation)
            init_distributed(plan, cluster)
            runtime = Runtime(plan, rank, emulated=device_for_rank(cluster, rank), cluster=cluster)
            tokens = torch.randint(0, plan.model_spec.vocab_size, (plan.global_batch_size, plan.seq_len + 1),
                                   generator=torch.Generator().manual_seed(0))
            times = [runtime.step(runtime.local_batch(tokens[:, :-1]), runtime.local_batch(tokens[:, 1:])).step_time_s
                     for _ in range(steps)]
            results[name] = (layout_summary(plan), plan.predicted_iteration_time_s, times)
            dist.destroy_process_group()
    finally:
        queue.put((rank, results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per form, the first one left out (default 6)")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step of a form is left out)")
    machine = machine_info()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=train_forms, args=(r, port, args.steps, queue)) for r in range(4)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs) or list(results[0]) != list(FORMS):
        print("emulated_step_time: a rank failed (its output above says why)", file=sys.stderr)
        return 1
    forms = {}
    for name, (layout, predicted, times) in results[0].items():  # rank 0's clock; every rank steps together
        median = statistics.median(times[1:])
        forms[name] = {"layout": layout, "predicted_s": round(predicted, 4), "steps_s": [round(t, 4) for t in times],
                       "median_s": round(median, 4), "measured_over_predicted": round(median / predicted, 2),
                       "within_target": median <= TARGET * predicted}
        print(f"{name}: {layout}: median {median:.2f} s, predicted {predicted:.2f} s, {median / predicted:.2f}x")
    result = {"machine": machine, "cluster": "examples/clusters/cpu-emulated.yaml (emulated)", "model": "llama-tiny",
              "ranks": 4, "steps_per_form": args.steps, "target": f"median of steps 2..{args.steps} within "
              f"{TARGET:g}x the predicted step time", "all_within_target": all(f["within_target"] for f in forms.values()),
              "forms": forms, "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    write_json_atomic(OUT, result, overwrite=True)
    return 0 if result["all_within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
