"""What the real-run benchmarks share: memx's estimate of a layout for a results row, the
summaries of predicted against real (fit or OOM, time), DGX-style clusters at datasheet numbers,
strict-JSON cleaning and the predicted-against-measured axes of their plots."""

from __future__ import annotations

import functools
import math

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.profiling.metrics import error_summary, ranking_summary
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.efficiency import TRAINING_SHARE_OF_BEST_MATMUL

# Datasheet numbers (dense 16-bit peak, HBM bandwidth, NVLink per direction, compute capability). The capacity is
# what CUDA reports of the marketing size, the most a run can fill.
AMPERE, HOPPER = {"vendor": "nvidia", "compute_capability": 8.0}, {"vendor": "nvidia", "compute_capability": 9.0}
# Blackwell: B200 and GB200 are compute capability 10.0, GB300 (Blackwell Ultra) 10.3 (NVIDIA's CUDA GPU
# list). HBM capacity as nvidia-smi reports it (183,359, 189,471 and 284,208 MiB); dense BF16 2,250 (B200)
# and 2,500 TFLOPS (GB200, GB300), 8 TB/s, NVLink 5 at 900 GB/s per direction; their FP8 and FP4 peaks are
# memx's defaults (2x; 4x, and 6x on Blackwell Ultra). The host link: PCIe Gen5 on DGX B200; NVLink-C2C to
# the Grace CPU on GB200 and GB300, about 200 GB/s per GPU and direction (Azure's ND GB200 v6 measured
# 193 and 201: github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_GB200_v6_results.md).
BLACKWELL, BLACKWELL_ULTRA = ({"vendor": "nvidia", "compute_capability": 10.0, "memory_bandwidth_gbps": 8000},
                              {"vendor": "nvidia", "compute_capability": 10.3, "memory_bandwidth_gbps": 8000})
GPUS = {
    "a100_80gb": ({**AMPERE, "memory_gib": 79.3, "peak_tflops": 312, "memory_bandwidth_gbps": 2039}, 300),
    "a100_40gb": ({**AMPERE, "memory_gib": 39.4, "peak_tflops": 312, "memory_bandwidth_gbps": 1555}, 300),
    "h100_80gb": ({**HOPPER, "memory_gib": 79.1, "peak_tflops": 989, "memory_bandwidth_gbps": 3350}, 450),
    # Meta's Grand Teton hosts (torchtitan's H100 tables): 96 GB of HBM2e at 2.4 TB/s, "the default
    # 500W power limit" of the 700 W board (torchtitan's docs/performance.md).
    "h100_96gb": ({**HOPPER, "memory_gib": 95.0, "peak_tflops": 989, "memory_bandwidth_gbps": 2400,
                   "power_limit_w": 500, "rated_power_w": 700}, 450),
    # H200 SXM: 143,771 MiB as nvidia-smi reports it, H100's dense BF16 peak, 4.8 TB/s.
    "h200": ({**HOPPER, "memory_gib": 140.4, "peak_tflops": 989, "memory_bandwidth_gbps": 4800}, 450),
    "b200": ({**BLACKWELL, "memory_gib": 179.0, "peak_tflops": 2250, "host_link_gbps": 50}, 900),
    # GB200's own best matmul, 72.9% of its peak (B200's 77.6% is the generation's default), at Blackwell's
    # training share of it.
    "gb200": ({**BLACKWELL, "memory_gib": 185.0, "peak_tflops": 2500, "host_link_gbps": 200,
               "efficiency": TRAINING_SHARE_OF_BEST_MATMUL["blackwell"] * 0.729}, 900),
    "gb300": ({**BLACKWELL_ULTRA, "memory_gib": 277.5, "peak_tflops": 2500, "host_link_gbps": 200}, 900),
    # DGX B300: 275,040 MiB, 2,250 TFLOPS dense BF16, PCIe Gen6 to the host.
    "b300": ({**BLACKWELL_ULTRA, "memory_gib": 268.6, "peak_tflops": 2250, "host_link_gbps": 100}, 900),
}
# Per GPU: one 400 Gb/s NIC (ConnectX-7), 800 Gb/s on GB300 and B300 (ConnectX-8).
INTER_NODE_GBPS = {"a100_80gb": 25, "a100_40gb": 25, "h100_80gb": 50, "h100_96gb": 50, "h200": 50, "b200": 50,
                   "gb200": 50, "gb300": 100, "b300": 100}
# GPUs one NVLink domain holds: 8 in a DGX or HGX node; an NVL72 rack's NVLink switches join 72, of which
# a job of 64-GPU multiples is taken to use 64 (16 of its 18 compute trays).
NVLINK_DOMAIN = {"gb200": 64, "gb300": 64}


@functools.lru_cache(maxsize=None)
def dgx_cluster(gpu: str, world: int) -> ClusterSpec:
    """``world`` GPUs of one type in NVLink domains of 8 (:data:`NVLINK_DOMAIN` where larger; fewer
    GPUs in one), at the datasheet numbers."""
    domain = NVLINK_DOMAIN.get(gpu, 8)
    if world > domain and world % domain:
        raise ValueError(f"{world} {gpu} GPUs do not fill NVLink domains of {domain}")
    device, nvlink = GPUS[gpu]
    return ClusterSpec.from_dict({
        "version": 1, "name": f"{gpu}-{world}", "device_types": {gpu: device},
        "nodes": [{"devices": {gpu: min(domain, world)}, "intra_node_gbps": nvlink}
                  for _ in range(max(world // domain, 1))],
        "inter_node_gbps": INTER_NODE_GBPS[gpu]})


def predicted(row: dict, model, cluster, training, parts: bool = False, **layout) -> dict:
    """``row`` with memx's estimate of the layout: fits, peak GiB and iteration time, or the error;
    with ``parts``, the fullest stage's peak by part (``parts_gib``)."""
    try:
        plan = evaluate_layout(model, cluster, training, references=(1.0, 1.0, 1.0), **layout)
    except ConfigError as exc:
        return {**row, "error": str(exc)}
    fullest = max(plan.stages, key=lambda s: s.predicted_peak_memory_gib)
    return {**row, "fits": all(s.predicted_peak_memory_gib <= s.memory_capacity_gib for s in plan.stages),
            "peak_gib": round(fullest.predicted_peak_memory_gib, 2),
            "time_s": plan.predicted_iteration_time_s,
            **({"parts_gib": {k: round(v, 3) for k, v in fullest.memory_parts_gib.items()}} if parts else {})}


def spearman(a, b) -> float:
    """memx's rank correlation; NaN for fewer than three runs or no spread (a group of one or two
    ranks nothing)."""
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan
    return ranking_summary(a, b)["spearman"]


def mape(pred, real) -> float:
    return error_summary(pred, real)["mape_pct"] if len(real) else math.nan


def fit_summary(rows) -> dict:
    """Confusion matrix of predicted fit against the real ok/OOM label."""
    labelled = [r for r in rows if r["real"] in ("ok", "OOM") and r.get("fits") is not None]
    cm = {"real_ok_pred_fit": 0, "real_ok_pred_oom": 0, "real_oom_pred_fit": 0, "real_oom_pred_oom": 0}
    for r in labelled:
        cm[f"real_{r['real'].lower()}_pred_{'fit' if r['fits'] else 'oom'}"] += 1
    n_oom = cm["real_oom_pred_fit"] + cm["real_oom_pred_oom"]
    n_ok = cm["real_ok_pred_fit"] + cm["real_ok_pred_oom"]
    right = cm["real_ok_pred_fit"] + cm["real_oom_pred_oom"]
    return {"runs": len(labelled), "confusion": cm,
            "accuracy_pct": round(100 * right / max(len(labelled), 1), 1),
            "false_fit_pct_of_real_ooms": round(100 * cm["real_oom_pred_fit"] / max(n_oom, 1), 1),
            "false_oom_pct_of_real_oks": round(100 * cm["real_ok_pred_oom"] / max(n_ok, 1), 1)}


def time_mape(rows) -> float:
    """Time MAPE (%) of predicted ``time_s`` against ``real_time_s`` over ``rows``."""
    return mape([r["time_s"] for r in rows], [r["real_time_s"] for r in rows])


def grouped(rows, key) -> dict:
    """{key(row): its rows}, sorted by key."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return dict(sorted(groups.items()))


def time_summary(rows) -> dict:
    ran = [r for r in rows if r["real"] == "ok" and r.get("time_s") is not None]
    ratio = np.array([r["time_s"] / r["real_time_s"] for r in ran]) if ran else np.array([math.nan])
    return {"runs": len(ran),
            "time_mape_pct": round(time_mape(ran), 1),
            "predicted_over_measured_median": round(float(np.median(ratio)), 3),
            "predicted_over_measured_p10_p90": [round(float(np.percentile(ratio, q)), 3) for q in (10, 90)]}


def run_summary(rows) -> dict:
    """Fit or OOM, time, and how many rows memx refused (their ``error``)."""
    return {"fit": fit_summary(rows), "time": time_summary(rows), "errors": sum("error" in r for r in rows)}


def no_nan(value):
    """NaN (a group too small to rank) as null: the results file stays strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def identity_axes(ax, values, xlabel, ylabel, title) -> None:
    """Log-log axes around the measured and predicted values with the y = x line and a 20% band."""
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], color="0.3", lw=1)
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="0.9", zorder=0)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel=xlabel, ylabel=ylabel, title=title)
    from matplotlib.ticker import NullFormatter  # a span under a decade labels every minor tick, overlapping
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())


def step_time_by_group(ax, rows, title, colors, size=12, label=None) -> None:
    """Published against predicted step time of the rows that got a prediction, one colour per
    group with its MAPE, on :func:`identity_axes`; ``label(row)`` annotates each point."""
    done = [r for r in rows if "time_s" in r]
    for colour, group in zip(colors, sorted({r["group"] for r in done})):
        members = [r for r in done if r["group"] == group]
        ax.scatter([r["real_time_s"] for r in members], [r["time_s"] for r in members], s=size, color=colour,
                   label=f"{group}: MAPE {time_mape(members):.1f}%")
        for r in members if label else ():
            ax.annotate(label(r), (r["real_time_s"], r["time_s"]), fontsize=6)
    identity_axes(ax, [r[k] for r in done for k in ("real_time_s", "time_s")], "published step time (s)",
                  "memx (s)", f"{title}: {len(done)} runs")
    ax.legend(fontsize=8, loc="upper left")
