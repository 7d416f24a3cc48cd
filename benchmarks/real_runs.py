"""memx's whole-plan predictions against real training runs: fit or OOM, iteration time, ranking.

Data (development sets of issue 10, in shared/peer-data):
- hagemann-dev/llama13b_runs.csv: 422 LLaMA-13B runs on A100-80GB (Hagemann et al. 2023), each
  ok or OOM with its average step time. Their setup, modelled through memx's options (not
  fitted): Aleph Alpha's Megatron-derived codebase in bf16, 1F1B, an even layer split, memx's
  ``--setup scaling``, each option read from the public code (github.com/Aleph-Alpha/scaling):
  its ZeRO optimizer keeps bf16 weights and bf16 gradients whole on every rank and shards the
  fp32 master weights and Adam moments over DP (``core/optimizer/parameter_group.py``, as
  ``zero1``); the LM head all-gathers the logits for torch's cross entropy (``lm_head.py``,
  ``losses/cross_entropy.py``: no vocab-parallel loss); the pipeline buffers keep each stage
  output until its gradient returns and the last stage's two output buffers are never
  emptied, so the previous micro-batch's logits stay (``parallel_module.py``:
  ``keep_stage_outputs``); with sequence parallelism the RMSNorm all-gathers its output and
  the next linear keeps it whole (``norm/rms_norm.py``: ``sp_keeps_gathered_input``); its
  SwiGLU has separate gate and up linears, each all-reducing its input gradient over TP
  (``core/nn/mlp.py``: ``fused_gate_up`` off); its optimizer all-reduces the whole gradients over
  DP, cast to fp32, after the backward, then all-gathers each shard's updated bf16 weights
  (``core/optimizer/allreduce.py``: ``full_gradient_allreduce``, ``fp32_allreduce``).
  Per row: LLaMA without dropout; flash attention when the kernel is flash_attention* (its
  version from the name: flash_attentionv1.0.8 is FlashAttention 1), the
  s x s scores kept for "torch" (torch's softmax: ``--no-fused-softmax``) and "fused"
  (Megatron's fused softmax, 16-bit in and out); fused norms only with "RMS kernel" (else torch
  ops that keep an fp32 copy of each norm's input, ``norm/rms_norm.py``); sequence parallelism
  and activation checkpointing (every layer = full) as the row says. One assumption, not read
  from code: "torch" runs its softmax on an fp32 copy of the scores (``--softmax-in-fp32``).
  The 2023 code of the runs is not public and today's defaults it off
  (``masked_softmax_config.py``); Megatron-derived codebases upcast there in bf16, and the
  development data's OOMs side with it (without it, 6 more real OOMs are called fits and one
  real fit less is called an OOM: accuracy 91.9% instead of 93.1%).
  Vocabulary 131,072 and 4.2M tokens per step (2,048 sequences at 2k, 512 at 8k), from the data's
  README. Cluster: DGX A100 nodes of 8 (NVLink 300 GB/s per direction), 8 HDR 200 Gb/s NICs per
  node (25 GB/s per GPU), datasheet peaks, memx's default efficiency (uncalibrated).
- sailor-plans-dev/opt350_gh96_plans.csv: 15 whole OPT-350 plans run on GH200 nodes of 4 with
  Megatron-DeepSpeed: fp32 (fp32 matmuls at the fp32 peak: PyTorch leaves TF32 off), Adam state
  whole, hidden dropout on and attention dropout off (OPT's training configuration), no fused
  attention in fp32 and torch's softmax (Megatron's fused softmax kernel takes only 16-bit
  inputs: ``--no-fused-softmax``), blocks issued as eager PyTorch ops (``--eager-block``), the plan's
  layer split. The measured peak is the device's
  used memory as nvidia-smi reports it after the step's last instruction, the largest over the
  ranks (Sailor's ``get_total_used_mem`` in ``deepspeed/pipe_engine.py``): context,
  communicator buffers and the allocator's reserve included, as memx's peak counts them.

TF32: the Sailor plans again with ``--tf32``: Sailor's Dockerfile builds on NVIDIA's NGC container
(nvcr.io/nvidia/pytorch:24.10-py3), whose PyTorch may have run the fp32 matmuls as TF32.

Host time: the Sailor plans again with ``--host-ms-per-layer`` at the fastest block of Sailor's
OPT-350 profile on GH-96 (the framework issues a layer no faster), where ``--eager-block`` counts
the block's ops.

Calibrated: the Sailor plans again with the learned model fitted on the public Sailor profile
of their GPU type and model (block, embedding and head times; no memory in that profile).

Metrics: fit/OOM confusion matrix, false fits (real OOMs called fits) as a share of real OOMs,
time MAPE and Spearman per group (runs that ran), memx's pick per group (lowest predicted time
among layouts predicted to fit) and its regret against the measured best.

Writes benchmarks/results/real_runs.json and the plot real_runs.png.
Run: .venv/bin/python benchmarks/real_runs.py   (3-60 s on 2 shared CPU cores: the calibrated
Sailor section fits the learned model once)
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import (GPUS, dgx_cluster, fit_summary, grouped, identity_axes, mape, no_nan,  # noqa: E402
                               predicted, run_summary, spearman, time_mape, time_summary)
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.specs.cluster import ClusterSpec  # noqa: E402
from memx_launch.specs.catalog import get_model  # noqa: E402
from memx_launch.specs.model import ModelSpec  # noqa: E402
from memx_launch.specs.training import TrainingSpec  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "real_runs.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "real_runs.png")
GIB = 2**30


def shared_dir() -> str:
    """shared/ beside the repository (the main checkout), or $MEMX_SHARED."""
    for candidate in (os.environ.get("MEMX_SHARED"), os.path.join(ROOT, "..", "shared"),
                      os.path.join(ROOT, "..", "..", "shared"), os.path.join(ROOT, "shared")):
        if candidate and os.path.isdir(os.path.join(candidate, "peer-data")):
            return os.path.abspath(candidate)
    raise SystemExit("real_runs: no shared/peer-data found; set MEMX_SHARED")


# --------------------------------------------------------------------------- metrics


def group_summary(rows, key) -> dict:
    """Per group: time MAPE and Spearman over the runs that ran; memx's pick and its regret."""
    out = {}
    for name, members in grouped(rows, key).items():
        ran = [r for r in members if r["real"] == "ok" and r.get("time_s") is not None]
        entry = {"runs": len(members), "ran": len(ran),
                 "time_mape_pct": round(time_mape(ran), 1),
                 "spearman": round(spearman([r["time_s"] for r in ran], [r["real_time_s"] for r in ran]), 3)}
        fits = [r for r in members if r.get("fits")]
        if ran and fits:
            pick = min(fits, key=lambda r: r["time_s"])
            best = min(ran, key=lambda r: r["real_time_s"])
            entry["measured_best"] = {"layout": best["layout"], "time_s": best["real_time_s"]}
            entry["memx_pick"] = {"layout": pick["layout"], "predicted_time_s": round(pick["time_s"], 3),
                                  "real": pick["real"], "real_time_s": pick.get("real_time_s")}
            entry["regret_pct"] = (round(100 * (pick["real_time_s"] / best["real_time_s"] - 1), 1)
                                   if pick["real"] == "ok" else "pick ran out of memory")
        out[name] = entry
    return out


# --------------------------------------------------------------------------- Hagemann et al. (LLaMA-13B, A100)


def hagemann(shared: str, predict=predicted) -> list[dict]:
    """The 422 runs, each through ``predict(row, model, cluster, training, **layout)``
    (:func:`~benchmarks.common.predicted`: memx's estimate of it)."""
    rows = []
    with open(os.path.join(shared, "peer-data", "hagemann-dev", "llama13b_runs.csv")) as f:
        data = list(csv.DictReader(f))
    for d in data:
        seq, world = int(d["seq_len"]), int(d["world_size"])
        tp, pp, mbs = int(d["tp"]), int(d["pp"]), int(d["micro_batch_size"])
        dp = world // (tp * pp)
        model = ModelSpec("llama-13b", int(d["layers"]), int(d["hidden"]), int(d["heads"]), int(d["heads"]),
                          int(d["ffn_hidden"]), 131072, seq)
        sequences = 2048 if seq == 2048 else 512
        # Micro-batches per pipeline from the step's sequences; a layout whose dp x mbs exceeds
        # them (it only OOMed) is asked with one micro-batch per stage at least.
        g = max(math.ceil(sequences / (dp * mbs)), pp)
        flash = d["kernel"].startswith("flash_attention")
        sp = d["sequence_parallel"] in ("1", "True")
        training = TrainingSpec(global_batch_size=g * dp * mbs, seq_len=seq, dtype="bf16", setup="scaling",
                                sequence_parallel=sp, flash_attention=flash, dropout=False,
                                flash_attention_version=1 if d["kernel"] == "flash_attentionv1.0.8" else 2,
                                fused_norm="RMS kernel" in d["kernel"], fused_softmax=d["kernel"] == "fused",
                                softmax_in_fp32=d["kernel"] == "torch")
        recompute = "full" if d["activation_checkpointing"] == "every_layer" else "none"
        row = {"group": f"{d['source_file'].replace('.xlsx', '')}", "real": d["status"],
               "real_time_s": float(d["avg_step_time_s"]) if d["avg_step_time_s"] else None,
               "layout": f"tp{tp} pp{pp} dp{dp} mbs{mbs} {recompute} {d['kernel']}{' sp' if sp else ''}",
               "kernel": d["kernel"], "seq_len": seq}
        rows.append(predict(row, model, dgx_cluster("a100_80gb", world), training, tp=tp, pp=pp, dp=dp,
                            micro_batch_size=mbs, layers_per_stage=[model.num_layers // pp] * pp,
                            recompute=recompute))
    return rows


# --------------------------------------------------------------------------- Sailor plans (OPT-350, GH200)


# Megatron-DeepSpeed's OPT runs in fp32: no fused attention, torch's softmax, hidden dropout on, its
# blocks issued as eager PyTorch ops.
SAILOR_RUN_OPTIONS = {"flash_attention": False, "fused_softmax": False, "dropout": True, "eager_block": True}


def gh200_cluster(nodes: int, efficiency: float | None = None) -> ClusterSpec:
    gh = {"vendor": "nvidia", "memory_gib": 96, "peak_tflops": 989, "peak_tflops_fp32": 67, "compute_capability": 9.0,
          "memory_bandwidth_gbps": 4000}
    return ClusterSpec.from_dict({
        "version": 1, "name": f"gh200-{nodes}x4",
        "device_types": {"GH-96": {**gh, **({"efficiency": efficiency} if efficiency else {})}},
        "nodes": [{"devices": {"GH-96": 4}, "intra_node_gbps": 450} for _ in range(nodes)],
        "inter_node_gbps": 25})


def sailor(shared: str, cost_model=None, efficiency: float | None = None,
           host_ms_per_layer: float | None = None, predict=predicted, tf32: bool = False) -> list[dict]:
    """The 15 plans predicted through ``memx estimate``'s path; ``cost_model(model, cluster,
    training)`` gives the cost model of each plan's cluster (None: the analytical one, at
    ``efficiency`` of the GH-96 peak, or the default); ``host_ms_per_layer``: the framework's
    host time per layer (``--host-ms-per-layer``; None: memx's default); ``predict`` as
    :func:`hagemann`'s; ``tf32``: the fp32 matmuls as TF32 (``--tf32``)."""
    rows = []
    model = get_model("opt-350m")
    with open(os.path.join(shared, "peer-data", "sailor-plans-dev", "opt350_gh96_plans.csv")) as f:
        data = list(csv.DictReader(f))
    for d in data:
        pp, mbs, gbs = int(d["pp"]), int(d["mbs"]), int(d["gbs"])
        dps = {int(x) for x in d["dp"].split("/")}
        tps = {int(x) for x in d["stage_tp"].split("|")}
        units = [int(x) for x in d["layer_units_per_stage"].split("/")]
        layers = list(units)
        layers[0] -= 1   # embedding unit
        layers[-1] -= 1  # head unit
        nodes = int(d["case"].split("/")[2][1:])
        row = {"group": f"N{nodes} gbs{gbs}", "real": "ok", "real_time_s": float(d["measured_iter_s"]),
               "real_peak_gib": float(d["measured_peak_mem_bytes"]) / GIB,
               "layout": f"pp{pp} dp{d['dp']} tp{d['stage_tp']} mbs{mbs} split {d['layer_units_per_stage']}"}
        if len(dps) > 1 or len(tps) > 1:
            row["error"] = "per-stage DP or TP degrees differ (not expressible yet)"
            rows.append(row)
            continue
        dp, tp = dps.pop(), tps.pop()
        training = TrainingSpec(global_batch_size=gbs, seq_len=int(d["seq_len"]), dtype="fp32",
                                host_ms_per_layer=host_ms_per_layer, tf32=tf32, **SAILOR_RUN_OPTIONS)
        cluster = gh200_cluster(nodes, efficiency)
        rows.append(predict(row, model, cluster, training, parts=True, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs,
                            layers_per_stage=layers, recompute=d["recompute"],
                            cost_model=cost_model(model, cluster, training) if cost_model else None))
    return rows


def fastest_profiled_block_ms(shared: str) -> float:
    """The fastest block (forward and backward) of Sailor's OPT-350 profile on GH-96: the host
    time per layer of its eager framework, where no device work hides it."""
    from benchmarks.predictor_accuracy import sailor_records

    records = sailor_records(os.path.join(shared, "peer-data", "sailor", "profiles"))
    return round(1e3 * min(r.time_s for r in records if r.device_type == "GH-96" and r.model == "opt-350m"), 2)


def sailor_calibrated(shared: str, trials: int = 10, fleet: bool = False) -> tuple[list[dict], dict]:
    """The same plans with the learned model fitted on the public Sailor profile of their GPU
    type and model (OPT-350 on GH-96: block, embedding and head times by micro-batch and TP;
    the profile holds no memory, so memory stays analytical), as ``memx estimate --profile-db``.
    ``fleet``: the profile DB also holds every other GPU type's Sailor profiles (all models),
    as a DB of a mixed fleet would; the GH-96 predictions must not move."""
    import warnings
    from dataclasses import replace

    from benchmarks.predictor_accuracy import sailor_records
    from memx_launch.planning.tp_links import tp_link
    from memx_launch.profiling.interpolation import augment_measurements
    from memx_launch.profiling.predictor import LearnedCostModel, fit_predictor

    # The profile was taken on the plans' GH200 nodes with the plans' framework and options: its
    # TP groups ran over the links the plan cluster describes, its blocks with dropout and
    # torch's softmax (SAILOR_RUN_OPTIONS), so the learned ratio applies to the same analytical base.
    node = gh200_cluster(1)
    profiles = sailor_records(os.path.join(shared, "peer-data", "sailor", "profiles"))
    links = {r.tp: tp_link(node, "GH-96", r.tp) for r in profiles}
    records = [replace(r, tp_link_gbps=links[r.tp].gbps if r.tp > 1 else None, tp_over_pcie=r.tp > 1 and links[r.tp].over_pcie,
                       run_options=SAILOR_RUN_OPTIONS)
               for r in profiles if r.device_type == "GH-96" and r.model == "opt-350m"]
    if fleet:
        records += [r for r in profiles if r.device_type != "GH-96"]
    predictor = fit_predictor(records, augmented=augment_measurements(records).points, trials=trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan clusters' only type is the profiled one
        rows = sailor(shared, lambda model, cluster, training: LearnedCostModel(model, cluster, training, predictor))
    efficiency = predictor.meta["efficiency"]["GH-96"]
    analytical_rows = sailor(shared, efficiency=efficiency)
    fitted = {"profile": "shared/peer-data/sailor/profiles/OPT-350/GH-96 (fp32, Megatron-DeepSpeed)"
                         + (" + every other GPU type's Sailor profiles" if fleet else ""),
              "records": len(records), "trials": trials,
              "device_types_with_own_trees": sorted(predictor.own_boosters),
              "parts_fixed_ms_and_scale_of_analytical": {
                  part: {k.split("|")[0]: {"fixed_ms": round(1e3 * fixed, 3), "scale": round(scale, 3)}
                         for k, (scale, fixed) in levels.items()}
                  for part, levels in predictor.meta["part_levels"].items()},
              "memory_overhead_gib_measured": predictor.meta["memory_overhead_gib"] or None,
              "efficiency_measured": round(efficiency, 3),
              "analytical_at_measured_efficiency": {**sailor_summary(analytical_rows), "rows": analytical_rows}}
    return rows, fitted


# The parts of a peak that memx counts as tensors (the rest: communicator buffers, fixed overhead).
TENSOR_PARTS = ("parameters", "gradients", "optimizer_states", "optimizer_step", "backward_end", "activations",
                "logits_loss", "pipeline_buffers")


def above_tensors(rows: list[dict]) -> dict:
    """What each plan held above the tensors memx counts, measured (its peak less those tensors)
    against memx's communicator buffers and fixed overhead, GiB: min, median, max over the plans."""
    done = [r for r in rows if "parts_gib" in r]
    tensors = [sum(r["parts_gib"][p] for p in TENSOR_PARTS) for r in done]

    def spread(values):
        return [round(min(values), 2), round(float(np.median(values)), 2), round(max(values), 2)]
    return {"measured_min_median_max": spread([r["real_peak_gib"] - t for r, t in zip(done, tensors)]),
            "predicted_min_median_max": spread([r["peak_gib"] - t for r, t in zip(done, tensors)])}


def sailor_summary(rows: list[dict]) -> dict:
    done = [r for r in rows if "time_s" in r]
    return {**run_summary(rows), "above_tensors_gib": above_tensors(done),
            "memory_mape_pct": round(mape([r["peak_gib"] for r in done], [r["real_peak_gib"] for r in done]), 1),
            "spearman_all_plans": round(spearman([r["time_s"] for r in done], [r["real_time_s"] for r in done]), 3),
            "groups": group_summary(rows, lambda r: r["group"])}


def real_runs_plot(hagemann_rows, sailor_rows, calibrated_rows, path: str) -> None:
    """Three panels: Hagemann step time, Hagemann peak memory by real outcome, Sailor plans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memx_launch.planning.report import save_png_atomic

    fig, (time_ax, memory_ax, sailor_ax) = plt.subplots(1, 3, figsize=(16, 5))
    ran = [r for r in hagemann_rows if r["real"] == "ok" and r.get("time_s")]
    for colour, group in zip(plt.cm.tab10.colors, sorted({r["group"] for r in ran})):
        members = [r for r in ran if r["group"] == group]
        time_ax.scatter([r["real_time_s"] for r in members], [r["time_s"] for r in members], s=14,
                        color=colour, label=group.replace("llama_13B_bfloat16_", ""))
    identity_axes(time_ax, [r[k] for r in ran for k in ("real_time_s", "time_s")], "measured step time (s)", "memx (s)",
              f"LLaMA-13B on A100 (Hagemann): {len(ran)} runs, MAPE "
              f"{time_mape(ran):.1f}%")
    time_ax.legend(fontsize=7, loc="upper left")
    labelled = [r for r in hagemann_rows if r.get("peak_gib") is not None]
    for x, outcome, colour in ((0, "ok", "tab:green"), (1, "OOM", "tab:red")):
        peaks = np.array([r["peak_gib"] for r in labelled if r["real"] == outcome])
        jitter = np.random.default_rng(x).uniform(-0.25, 0.25, len(peaks))
        memory_ax.scatter(x + jitter, peaks, s=10, color=colour, alpha=0.6)
    capacity = GPUS["a100_80gb"][0]["memory_gib"]
    memory_ax.axhline(capacity, color="0.3", lw=1, ls="--", label=f"A100-80GB capacity ({capacity} GiB)")
    memory_ax.set(xticks=[0, 1], xticklabels=["ran", "ran out of memory"], yscale="log",
                  ylabel="memx's predicted peak (GiB)", title="Fit or OOM: every run on the predicted peak")
    memory_ax.legend(fontsize=8, loc="upper left")
    for rows, marker, name in ((sailor_rows, "o", "analytical"), (calibrated_rows, "^", "calibrated")):
        done = [r for r in rows if r.get("time_s")]
        sailor_ax.scatter([r["real_time_s"] for r in done], [r["time_s"] for r in done], marker=marker, s=24,
                          label=f"{name}: MAPE {time_mape(done):.1f}%")
    identity_axes(sailor_ax, [r[k] for r in sailor_rows + calibrated_rows for k in ("real_time_s", "time_s") if r.get(k)],
              "measured iteration time (s)", "memx (s)",
              "OPT-350 whole plans on GH200 (Sailor)")
    sailor_ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=100)


def main() -> None:
    shared = shared_dir()
    started = time.perf_counter()
    result = {"machine": machine_info(), "cost_model": "analytical, datasheet peaks, default efficiency"}
    h = hagemann(shared)
    result["hagemann_llama13b_a100"] = {
        **run_summary(h),
        "time_by_kernel": {k: time_summary([r for r in h if r["kernel"] == k])
                           for k in sorted({r["kernel"] for r in h})},
        "fit_by_seq_len": {str(s): fit_summary([r for r in h if r["seq_len"] == s]) for s in (2048, 8192)},
        "groups": group_summary(h, lambda r: r["group"]),
        "setup": "--setup scaling (Aleph Alpha's codebase, read from its public code; see the script's "
                 "docstring); per row: flash_attention, fused_norm, fused_softmax, softmax_in_fp32 (torch rows), "
                 "sequence_parallel, recompute",
        "rows": h}
    groups = result["hagemann_llama13b_a100"]["groups"]
    rhos = [g["spearman"] for g in groups.values() if not math.isnan(g["spearman"])]
    result["hagemann_llama13b_a100"]["spearman_mean_over_groups"] = round(float(np.mean(rhos)), 3)
    s = sailor(shared)
    result["sailor_opt350_gh200"] = {**sailor_summary(s), "rows": s}
    calibrated, fitted = sailor_calibrated(shared)
    result["sailor_opt350_gh200_calibrated"] = {
        "cost_model": "learned (XGBoost over the analytical model), fitted on the plans' GPU type and model",
        **fitted, **sailor_summary(calibrated), "rows": calibrated}
    host_ms = fastest_profiled_block_ms(shared)
    hosted = sailor(shared, host_ms_per_layer=host_ms)
    result["sailor_opt350_gh200_host_time"] = {
        "cost_model": f"analytical with --host-ms-per-layer {host_ms}: the fastest block of Sailor's OPT-350 profile "
                      "on GH-96 (its eager framework's host time per layer)",
        "host_ms_per_layer": host_ms, **sailor_summary(hosted), "rows": hosted}
    as_tf32 = sailor(shared, tf32=True)
    result["sailor_opt350_gh200_tf32"] = {
        "cost_model": "analytical with --tf32: the plans' fp32 matmuls at the TF32 peak. Sailor's Dockerfile builds "
                      "on nvcr.io/nvidia/pytorch:24.10-py3, an NGC container; the plans above take PyTorch's default "
                      "(TF32 off), this reading the container's",
        **sailor_summary(as_tf32), "rows": as_tf32}
    fleet_rows, fleet_fitted = sailor_calibrated(shared, fleet=True)
    result["sailor_opt350_gh200_calibrated_fleet_db"] = {
        "cost_model": "learned, fitted on a DB holding the plans' GPU type and model and every other GPU type's "
                      "Sailor profiles (GH-96 keeps trees of its own: the other types must not move it)",
        **{k: v for k, v in fleet_fitted.items() if k != "analytical_at_measured_efficiency"},
        **sailor_summary(fleet_rows), "rows": fleet_rows}
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json_atomic(OUT, no_nan(result), overwrite=True)
    real_runs_plot(h, s, calibrated, PLOT)
    brief = {k: result["hagemann_llama13b_a100"][k] for k in ("fit", "time", "spearman_mean_over_groups")}
    print("hagemann", brief)
    for name, g in groups.items():
        print(" ", name, {k: v for k, v in g.items() if k in ("time_mape_pct", "spearman", "regret_pct")})
    for key in ("sailor_opt350_gh200", "sailor_opt350_gh200_host_time", "sailor_opt350_gh200_tf32",
                "sailor_opt350_gh200_calibrated", "sailor_opt350_gh200_calibrated_fleet_db"):
        print(key, {k: result[key][k] for k in ("time", "memory_mape_pct", "spearman_all_plans")})
    print(f"{result['seconds']} s")


if __name__ == "__main__":
    main()
