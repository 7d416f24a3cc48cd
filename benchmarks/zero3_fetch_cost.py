"""What DeepSpeed ZeRO-3's way of fetching weights costs against FSDP's units, as memx prices them.

Both shard the same state; they differ in how they fetch it (docs/setups.md, ``--max-live-params``):
FSDP gathers a block in one all-gather with the next one prefetched; DeepSpeed ZeRO-3 gathers each
linear module in an all-gather of its own, each paying its ring's latency, holds up to its live
budget gathered, and its module hooks cost the host time of their own
(``benchmarks/deepspeed_zero3_fetch.py`` and ``deepspeed_zero3_host.py`` measured both under
DeepSpeed; a model within the live budget, OPT-350M here, is gathered whole once a step, a
prefetch bucket at a time). This script asks ``memx estimate``'s path for LLaMA-2 7B, 13B and 70B
and OPT-350M on DGX A100 nodes
(8 HDR NICs a node), pure data parallelism with full recompute, sequence 2,048, one micro-batch a
step, at 8 to 1,536 GPUs, with ``--setup zero3`` (DeepSpeed) and with ``--setup zero3
--max-live-params 0`` (FSDP's units): the step times, their ratio and each one's peak memory; and
DeepSpeed again with the buckets Hugging Face's integration writes for ``auto`` (reduce hidden^2,
prefetch 0.9 hidden^2), as a Trainer's DeepSpeed config most often asks, and with ZeRO++'s hpZ
over a node (``--hpz-partition-size 8``: the backward gathers from a second shard over NVLink).
Last, both with the states sharded over a node instead of the whole group (``--shard-degree 8``:
PyTorch's HSDP for FSDP's units, DeepSpeed's MiCS), each against itself over the whole group:
the gathers stay on NVLink, each reduced shard is all-reduced over the nodes, and a rank keeps
1/8 of the states. Predictions, not measurements: no run here checks them.

Writes benchmarks/results/zero3_fetch_cost.json and the plot zero3_fetch_cost.png.
Run: .venv/bin/python benchmarks/zero3_fetch_cost.py   (seconds)
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import dgx_cluster  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning.estimate import evaluate_layout  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "zero3_fetch_cost.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "zero3_fetch_cost.png")
MODELS = ("llama2-7b", "llama2-13b", "llama2-70b", "opt-350m")
GPUS = (8, 64, 256, 768, 1536)
MICRO_BATCHES = (1, 4)
SEQ = 2048
GPUS_PER_NODE = 8  # ZeRO++'s hpZ second shard over a node (zero_hpz_partition_size); HSDP's and MiCS's shard group


def huggingface_auto(model) -> dict:
    """The buckets Hugging Face's DeepSpeed integration writes for ``auto`` (hidden^2 to reduce,
    0.9 hidden^2 to prefetch), where DeepSpeed's own defaults are 5e8 and 5e7."""
    return {"reduce_bucket_params": model.hidden_size**2, "prefetch_bucket_params": 0.9 * model.hidden_size**2}


def predicted(model, gpus: int, mbs: int, max_live_params: float, **buckets) -> dict:
    training = TrainingSpec(global_batch_size=gpus * mbs, seq_len=SEQ, dtype="bf16", setup="zero3",
                            max_live_params=max_live_params, **buckets)
    plan = evaluate_layout(model, dgx_cluster("a100_80gb", gpus), training, references=(1.0, 1.0, 1.0), tp=1, pp=1,
                           dp=gpus, micro_batch_size=mbs, layers_per_stage=[model.num_layers], recompute="full")
    return {"step_s": round(plan.predicted_iteration_time_s, 4),
            "peak_gib": round(plan.stages[0].predicted_peak_memory_gib, 2)}


def main() -> None:
    rows = []
    for name in MODELS:
        model = get_model(name)
        for mbs in MICRO_BATCHES:
            for gpus in GPUS:
                deepspeed, fsdp = predicted(model, gpus, mbs, 1e9), predicted(model, gpus, mbs, 0.0)
                auto = predicted(model, gpus, mbs, 1e9, **huggingface_auto(model))
                hpz = predicted(model, gpus, mbs, 1e9, hpz_partition_size=GPUS_PER_NODE)
                mics, hsdp = (predicted(model, gpus, mbs, live, shard_degree=GPUS_PER_NODE) for live in (1e9, 0.0))
                rows.append({"model": name, "gpus": gpus, "micro_batch": mbs, "deepspeed": deepspeed, "fsdp_units": fsdp,
                             "step_ratio": round(deepspeed["step_s"] / fsdp["step_s"], 3),
                             "deepspeed_huggingface_auto": auto,
                             "huggingface_auto_step_ratio": round(auto["step_s"] / fsdp["step_s"], 3),
                             "deepspeed_hpz_node": hpz, "hpz_node_step_ratio": round(hpz["step_s"] / fsdp["step_s"], 3),
                             "deepspeed_mics_node": mics, "mics_node_over_deepspeed": round(mics["step_s"]
                                                                                             / deepspeed["step_s"], 3),
                             "fsdp_units_hsdp_node": hsdp, "hsdp_node_over_fsdp_units": round(hsdp["step_s"]
                                                                                             / fsdp["step_s"], 3)})
                print(rows[-1], flush=True)
    write_json_atomic(OUT, {"what": "memx's predicted step time and peak of DeepSpeed ZeRO-3's fetching against "
                                    "FSDP's units (--setup zero3 with --max-live-params 1e9 and 0), and with the "
                                    "buckets Hugging Face's 'auto' writes (--reduce-bucket-params hidden^2 "
                                    "--prefetch-bucket-params 0.9 hidden^2), and with ZeRO++'s hpZ over a node "
                                    "(--hpz-partition-size 8); and each sharded over a node (--shard-degree 8: "
                                    "MiCS, HSDP) against itself over the whole group",
                            "setup": {"cluster": "DGX A100 nodes of 8, 8 x 200 Gb/s NICs", "seq_len": SEQ,
                                      "recompute": "full", "layout": "tp 1, pp 1, dp = GPUs, one micro-batch a step"},
                            "rows": rows, "machine": machine_info()}, overwrite=True)
    plot(rows, PLOT)
    print(f"wrote {OUT} and {PLOT}")


def plot(rows: list[dict], path: str) -> None:
    """DeepSpeed's step over FSDP's by GPUs: at its defaults, one line per model and micro-batch
    (left); at micro-batch 1 with its defaults, Hugging Face's auto buckets and hpZ (middle); each
    sharded over a node over itself over the whole group, micro-batch 1 (right; hollow: over 80 GB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memx_launch.planning.report import save_png_atomic

    fig, (defaults, options, node) = plt.subplots(1, 3, figsize=(19, 5.5))
    for colour, name in zip(plt.cm.tab10.colors, MODELS):
        for mbs, style in zip(MICRO_BATCHES, ("-", "--")):
            line = [r for r in rows if r["model"] == name and r["micro_batch"] == mbs]
            defaults.plot([r["gpus"] for r in line], [r["step_ratio"] for r in line], style, marker="o",
                          color=colour, label=f"{name}, micro-batch {mbs}")
        line = [r for r in rows if r["model"] == name and r["micro_batch"] == 1]
        for key, style, marker, what in (("step_ratio", "-", "o", "DeepSpeed's buckets"),
                                         ("huggingface_auto_step_ratio", ":", "x", "Hugging Face's auto buckets"),
                                         ("hpz_node_step_ratio", "-.", "s", "hpZ over a node")):
            options.plot([r["gpus"] for r in line], [r[key] for r in line], style, marker=marker, color=colour,
                         label=f"{name}, {what}")
        for key, sharded, style, what in (("mics_node_over_deepspeed", "deepspeed_mics_node", "--", "DeepSpeed: MiCS"),
                                          ("hsdp_node_over_fsdp_units", "fsdp_units_hsdp_node", "-", "FSDP: HSDP")):
            node.plot([r["gpus"] for r in line], [r[key] for r in line], style, color=colour, label=f"{name}, {what}")
            for r in line:
                fits = r[sharded]["peak_gib"] <= 80
                node.plot(r["gpus"], r[key], "o", color=colour, markerfacecolor=colour if fits else "none")
    defaults.set(ylabel="step time, DeepSpeed / FSDP units",
                 title="DeepSpeed's defaults (per linear; OPT-350M within\nits live budget: per prefetch bucket)")
    options.set(title="micro-batch 1: DeepSpeed's defaults, Hugging Face's auto\nbuckets, ZeRO++'s hpZ over a node")
    options.sharey(defaults)
    node.set(ylabel="step time, sharded over a node / over the whole group",
             title="micro-batch 1, the states sharded over a node (--shard-degree 8)\n"
                   "against the whole group (hollow: over an 80 GB A100)")
    for ax in (defaults, options, node):
        ax.set(xscale="log", xlabel="GPUs (data parallel, A100 DGX nodes)")
        ax.axhline(1.0, color="0.5", lw=1)
        ax.legend(fontsize=7)
    fig.suptitle("ZeRO-3 at scale: DeepSpeed's fetching over FSDP's units, and each sharded over a node, "
                 "predicted by memx")
    fig.tight_layout()
    save_png_atomic(fig, path)


if __name__ == "__main__":
    main()
