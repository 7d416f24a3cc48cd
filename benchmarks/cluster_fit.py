"""``memx cluster fit`` on real runs held out from the fit: does each device type's efficiency
(and memory overhead) fitted to some measured runs predict the others better than the defaults?

The fit is memx's own (``memx_launch/planning/run_fit.py``: :func:`fit_efficiencies`,
:func:`fitted_overhead_gib`); the runs are the development sets of ``benchmarks/real_runs.py``
and ``benchmarks/nemo_throughput.py``, predicted through the same path (the same options per
run). Each set is split in two by something a user's first runs would differ in from their
later ones; the fit sees one part, the other is predicted, then the reverse:

- Hagemann et al.: LLaMA-13B on A100-80GB, the 165 runs that ran: the 2,048-token groups
  against the 8,192-token ones (sequence length, world size and layouts all change).
- Sailor: OPT-350 on GH200 in fp32, 15 whole plans: the plans of 1-4 nodes against those of
  8-32 (scale); memory too (their measured peaks). Again with their fp32 matmuls as TF32
  (``--tf32``), as the NGC container Sailor's Dockerfile builds on may have run them.
- NVIDIA's dense H100 rows: NeMo 24.07's table against Megatron-Bridge's (25.11, 26.02): other
  models, other software.

And each set's every other run against the rest: a fit whose rows span the layouts it predicts.
Per split: the fitted efficiency, the fitted part's MAPE before and after (in-sample), the
held-out part's MAPE and Spearman before and after.

Writes benchmarks/results/cluster_fit.json and the plot cluster_fit.png (each set's held-out runs
of its first split, predicted with the default and the fitted cluster).
Run: .venv/bin/python benchmarks/cluster_fit.py   (about a minute on 2 shared CPU cores)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import identity_axes, mape, no_nan, spearman  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.nemo_throughput import nemo_rows  # noqa: E402
from benchmarks.real_runs import hagemann, sailor, shared_dir  # noqa: E402
from memx_launch.errors import ConfigError  # noqa: E402
from memx_launch.files import write_json_atomic  # noqa: E402
from memx_launch.planning import costmodel as cm  # noqa: E402
from memx_launch.planning.estimate import LayoutScorer  # noqa: E402
from memx_launch.planning.run_fit import fit_efficiencies, fitted_overhead_gib, share_of_peak  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "cluster_fit.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "cluster_fit.png")
TITLES = {"hagemann_llama13b_a100": "LLaMA-13B on A100 (Hagemann)", "sailor_opt350_gh200": "OPT-350 on GH200 (Sailor)",
          "nvidia_dense_h100": "NVIDIA's dense H100 rows"}


class Case:
    """One run as a benchmark builds it: its row, model, cluster, training and layout."""

    def __init__(self, row, model, cluster, training, parts=False, **layout):
        self.row, self.model, self.cluster, self.training = row, model, cluster, training
        self.cost_model = layout.pop("cost_model", None)
        self.layout = layout


def predictions(cases: list[Case], efficiency: float | None = None, overhead_gib: float | None = None) -> np.ndarray:
    """(iteration time s, peak GiB) of each case, its one device type at ``efficiency`` and
    ``overhead_gib`` where given (None: the cluster file's)."""
    scorers, out = {}, []
    for case in cases:
        (device,) = case.cluster.device_types
        changes = {k: v for k, v in (("efficiency", efficiency), ("memory_overhead_gib", overhead_gib)) if v is not None}
        cluster = dataclasses.replace(case.cluster, device_types=(dataclasses.replace(device, **changes),))
        key = (id(case.model), id(case.cluster), case.training)
        if key not in scorers:
            scorers[key] = LayoutScorer(case.model, cluster, case.training, case.cost_model)
        result, _ = scorers[key].score(**case.layout)
        out.append((float(result.T[0]), float(result.memory[0].max()) / cm.GIB))
    return np.array(out)


def scoreable(cases: list[Case]) -> list[Case]:
    """The cases that ran and that memx can score."""
    kept = []
    for case in cases:
        if case.row.get("real") != "ok" or not case.row.get("real_time_s"):
            continue
        try:
            predictions([case])
        except ConfigError:
            continue
        kept.append(case)
    return kept


def split_result(fit_part: list[Case], held_out: list[Case], memory: bool) -> dict:
    """Fit on ``fit_part``, predict ``held_out``: the efficiency, and both parts' errors before and after."""
    (device,) = fit_part[0].cluster.device_types
    start = share_of_peak(device, fit_part[0].training)
    defaults = {id(part): predictions(part) for part in (fit_part, held_out)}
    measured = np.array([c.row["real_time_s"] for c in fit_part])
    fitted = fit_efficiencies(lambda e: predictions(fit_part, next(iter(e.values())))[:, 0], measured,
                              {"device": start})["device"]
    overhead = None
    out = {"runs_fitted": len(fit_part), "runs_held_out": len(held_out),
           "efficiency_default": round(start, 4), "efficiency_fitted": round(fitted, 4)}
    if memory:
        residuals = [c.row["real_peak_gib"] - p for c, p in zip(fit_part, defaults[id(fit_part)][:, 1])]
        overhead = fitted_overhead_gib(device, residuals)
        out.update(overhead_default_gib=round(device.overhead_bytes / cm.GIB, 3), overhead_fitted_gib=round(overhead, 3))
    for name, part in (("fitted", fit_part), ("held_out", held_out)):
        real = np.array([c.row["real_time_s"] for c in part])
        default, after = defaults[id(part)], predictions(part, fitted, overhead)
        entry = {"time_mape_pct_default": round(mape(default[:, 0], real), 1),
                 "time_mape_pct_fitted": round(mape(after[:, 0], real), 1),
                 "predicted_over_measured_median_default": round(float(np.median(default[:, 0] / real)), 3),
                 "predicted_over_measured_median_fitted": round(float(np.median(after[:, 0] / real)), 3)}
        if len(part) >= 3:
            entry.update(spearman_default=round(spearman(list(default[:, 0]), list(real)), 3),
                         spearman_fitted=round(spearman(list(after[:, 0]), list(real)), 3))
        if memory:
            peaks = np.array([c.row["real_peak_gib"] for c in part])
            entry.update(memory_mape_pct_default=round(mape(default[:, 1], peaks), 1),
                         memory_mape_pct_fitted=round(mape(after[:, 1], peaks), 1))
        if name == "held_out":
            entry["runs"] = [{"layout": c.row["layout"], "measured_s": round(float(m), 5),
                              "default_s": round(float(d), 5), "fitted_s": round(float(f), 5)}
                             for c, m, d, f in zip(part, real, default[:, 0], after[:, 0])]
        out[name] = entry
    return out


def nodes(case: Case) -> int:
    """The GH200 nodes a Sailor plan ran on (its group: ``N<nodes> gbs<batch>``)."""
    return int(case.row["group"].split()[0][1:])


def both_ways(name_a: str, part_a: list[Case], name_b: str, part_b: list[Case], cases: list[Case],
              memory: bool = False) -> dict:
    """Fit on a, predict b; the reverse; and fit on every other case (the fit's rows spanning
    the same layouts), predict the rest."""
    return {f"fit {name_a}, predict {name_b}": split_result(part_a, part_b, memory),
            f"fit {name_b}, predict {name_a}": split_result(part_b, part_a, memory),
            "fit every other run, predict the rest": split_result(cases[::2], cases[1::2], memory)}


def plot(result: dict, path: str) -> None:
    """One panel per set: its held-out runs of the first split, measured against predicted with
    the default cluster and with the fitted one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memx_launch.planning.report import save_png_atomic

    fig, axes = plt.subplots(1, len(TITLES), figsize=(16, 5.5))
    for ax, (dataset, title) in zip(axes, TITLES.items()):
        split, entry = next(iter(result[dataset].items()))
        held = entry["held_out"]
        runs = held["runs"]
        for key, marker, colour, name in (("default_s", "o", "0.55", f"default efficiency {entry['efficiency_default']}"),
                                          ("fitted_s", "^", "tab:blue", f"fitted {entry['efficiency_fitted']}")):
            held_mape = held[f"time_mape_pct_{key.removesuffix('_s')}"]
            ax.scatter([r["measured_s"] for r in runs], [r[key] for r in runs], marker=marker, s=16, color=colour,
                       label=f"{name}: MAPE {held_mape}%")
        identity_axes(ax, [r[k] for r in runs for k in ("measured_s", "default_s", "fitted_s")],
                      "measured iteration time (s)", "memx (s)",
                      f"{title}\n" + split.replace(", predict", ",\npredict") + f" ({len(runs)} runs)")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=100)


def main() -> None:
    shared = shared_dir()
    started = time.perf_counter()
    runs = scoreable(hagemann(shared, predict=Case))
    result = {"machine": machine_info(),
              "what": "each set split in two; the fit sees one part (memx_launch/planning/run_fit.py), the other "
                      "is predicted; MAPE and Spearman of the held-out part with the default and the fitted cluster",
              "hagemann_llama13b_a100": both_ways(
                  "2,048-token runs", [c for c in runs if c.row["seq_len"] == 2048],
                  "8,192-token runs", [c for c in runs if c.row["seq_len"] == 8192], runs)}
    plans = scoreable(sailor(shared, predict=Case))
    result["sailor_opt350_gh200"] = both_ways("plans on 1-4 nodes", [c for c in plans if nodes(c) <= 4],
                                              "plans on 8-32 nodes", [c for c in plans if nodes(c) > 4], plans,
                                              memory=True)
    # The same plans read as their NGC container may have run them: fp32 matmuls as TF32.
    as_tf32 = scoreable(sailor(shared, predict=Case, tf32=True))
    result["sailor_opt350_gh200_tf32"] = both_ways("plans on 1-4 nodes", [c for c in as_tf32 if nodes(c) <= 4],
                                                   "plans on 8-32 nodes", [c for c in as_tf32 if nodes(c) > 4],
                                                   as_tf32, memory=True)
    dense = [c for c in scoreable(nemo_rows(predict=Case))
             if c.row["system"] == "dgx-h100" and c.row["kind"] == "dense"]
    result["nvidia_dense_h100"] = both_ways("NeMo 24.07", [c for c in dense if c.row["group"] == "nemo-24.07"],
                                            "Megatron-Bridge 25.11 and 26.02",
                                            [c for c in dense if c.row["group"] != "nemo-24.07"], dense)
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json_atomic(OUT, no_nan(result), overwrite=True)
    plot(result, PLOT)
    for dataset in ("hagemann_llama13b_a100", "sailor_opt350_gh200", "sailor_opt350_gh200_tf32", "nvidia_dense_h100"):
        for split, entry in result[dataset].items():
            held = entry["held_out"]
            print(f"{dataset}: {split}: efficiency {entry['efficiency_default']} -> {entry['efficiency_fitted']}, "
                  f"held-out MAPE {held['time_mape_pct_default']}% -> {held['time_mape_pct_fitted']}%")


if __name__ == "__main__":
    main()
