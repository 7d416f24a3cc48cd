"""Predictor accuracy on real measurements; writes benchmarks/results/predictor_accuracy.json and .png.

(a) Public GPU profiles (shared/peer-data/sailor): per-block forward + backward time by
    micro-batch and TP on 7 GPU types and 4 models.
    a1: every (model, GPU) profile keeps only its minimal set, chosen by the profiler's own
        sampling (ablation, three-point design over micro-batch and TP, refinement of
        non-linear lines; "measuring" reads the profile); one predictor fitted on all minimal
        sets predicts every point not measured.
    a2: leave one GPU type out: fit on the other types' minimal sets plus at most 5 samples of
        the held-out type (the profiler's new-type design: each model and TP degree of the type
        once, nearest the middle micro-batch, then micro-batch spread), predict the rest of it.
    a3: the same protocol on data no design choice was made on: the Aceso block timings of
        OPT-350 (same repository, another harness) of each GPU type as the new type, the
        other types' sailor minimal sets as the fleet.
(b) This machine's CPU: calibrate a LLaMA block (llama-small shape) on the minimal set chosen
    by ablation, then measure a held-back grid of configurations the profiler never saw and
    predict it (time, memory, ranking).
(c) Prediction cache throughput.

Nothing is tuned on the test points: hyper-parameters come from cross-validation on the
training rows only. Usage: python benchmarks/predictor_accuracy.py [--skip-cpu] [--cpu-grid N]
"""

from __future__ import annotations

import argparse
import csv
import glob
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, replace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from memx_launch.profiling.interpolation import augment_measurements
from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.planning.peaks import has_tf32
from memx_launch.planning.tp_links import tp_link
from memx_launch.profiling.metrics import error_summary, ranking_summary
from benchmarks.machine import machine_info  # noqa: E402
from memx_launch.files import write_json_atomic
from memx_launch.profiling.prediction_cache import CachedCostModel
from memx_launch.planning.report import save_png_atomic
from memx_launch.profiling.predictor import LearnedCostModel, fit_predictor
from memx_launch.profiling.profile_import import matmul_floor_seconds
from memx_launch.profiling.profiledb import Measurement
from memx_launch.profiling.space import ProfileSpace, Sample
from memx_launch.profiling.design import minimal_sample_set, new_type_design
from memx_launch.specs.catalog import MODEL_CATALOG
from memx_launch.specs.cluster import ClusterSpec, DeviceType, Node
from memx_launch.specs.training import TrainingSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAILOR = os.path.join(ROOT, "..", "shared", "peer-data", "sailor", "profiles")
ACESO = os.path.join(ROOT, "..", "shared", "peer-data", "sailor", "aceso_layer_time")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "predictor_accuracy.json")
PLOT = os.path.join(ROOT, "benchmarks", "results", "predictor_accuracy.png")
SAILOR_MODELS = {"OPT-350": "opt-350m", "GPT-Neo-2.7": "gpt-neo-2.7b", "OPT-30": "opt-30b", "LLAMA-3-8": "llama3-8b"}
SAILOR_SEQ = {"OPT-350": 2048, "GPT-Neo-2.7": 2048, "OPT-30": 2048, "LLAMA-3-8": 8192}
# Vendor datasheets (dense): the 16-bit tensor-core peak (GeForce: with fp32 accumulation), the
# fp32 CUDA-core peak the fp32 profiles run at, compute capability (TF32 from 8.0: half the
# 16-bit peak), SMs, HBM GB/s, and the per-direction bandwidth of the link a TP group of that type
# uses (NVLink or PCIe).
_DATASHEET = ("memory_gib", "peak_tflops", "peak_tflops_fp32", "compute_capability", "sm_count",
              "memory_bandwidth_gbps", "link")
SAILOR_DEVICES = {name: dict(zip(_DATASHEET, row)) for name, row in {
    "A100-40": (40, 312, 19.5, 8.0, 108, 1555, 300),
    "A100-80": (80, 312, 19.5, 8.0, 108, 2039, 300),
    "GH-96": (96, 989, 67.0, 9.0, 132, 4000, 150),
    "V100-16": (16, 125, 15.7, 7.0, 80, 900, 150),
    "RTX-2080": (8, 40.3, 10.1, 7.5, 46, 448, 16),
    "RTX-3090": (24, 71, 35.6, 8.6, 82, 936, 25),
    "Titan-RTX": (24, 130, 16.3, 7.5, 72, 672, 16),
}.items()}


def sailor_device(gpu: str, **fields) -> DeviceType:
    """A Sailor GPU type as its datasheet describes it (``fields``: more DeviceType fields)."""
    return DeviceType(name=gpu, vendor="nvidia", **{k: v for k, v in SAILOR_DEVICES[gpu].items() if k != "link"},
                      **fields)
MAX_NEW_TYPE_SAMPLES = 5


# --------------------------------------------------------------------------- (a) sailor


def bench_cluster(device: DeviceType) -> ClusterSpec:
    """A node of 8 GPUs of one sailor type joined by its datasheet link (NVLink, or PCIe
    through the host): the cluster the profile was measured on and its points are predicted on."""
    link = float(SAILOR_DEVICES[device.name]["link"])
    return ClusterSpec("bench", (device,), (Node("n", ((device.name, 8),), link),), float("inf"))


def block_record(gpu: str, model_dir: str, tp: int, mbs: int, time_s: float, source: str,
                 embedding_time_s: float | None = None, head_time_s: float | None = None) -> Measurement:
    """One public block timing (fp32, forward + backward) as a ProfileDB record (time only),
    with the embedding's and the head's where the profile timed them; :func:`as_run` marks the
    tables whose matmuls ran as TF32."""
    spec = MODEL_CATALOG[SAILOR_MODELS[model_dir]]
    spec = type(spec)(**{**spec.to_dict(), "seq_len": SAILOR_SEQ[model_dir]})
    device = sailor_device(gpu, flash_attention=False)
    # The link as memx's profiler records it: what the TP group reaches on the cluster it ran
    # on (tp_links.tp_link: through the host on a PCIe node), the link the learned ratio's
    # analytical base is taken at (features.profiled_cluster).
    link = tp_link(bench_cluster(device), gpu, tp)
    return Measurement(
        device_type=gpu, device={k: v for k, v in asdict(device).items() if k != "name"},
        model=spec.name, model_signature=spec.signature(), block_shape=spec.to_dict(),
        tp=tp, micro_batch_size=mbs, seq_len=spec.seq_len, recompute="none", dtype="fp32",
        num_blocks=1, feasible=True, time_s=time_s, tp_link_gbps=float(link.gbps),
        tp_over_pcie=link.over_pcie,
        embedding_time_s=embedding_time_s, head_time_s=head_time_s,
        software={"framework": f"Megatron-DeepSpeed (sailor cf2c8e3, {source})"}, source=source)


def sailor_records(profiles: str = SAILOR) -> list[Measurement]:
    """Every block measurement of the public profiles (``profiles``: the sailor/profiles folder)."""
    out = []
    for path in sorted(glob.glob(os.path.join(profiles, "*", "*", "profile.json"))):
        model_dir, gpu = path.split(os.sep)[-3:-1]
        with open(path) as f:
            profile = json.load(f)
        table = []
        for mbs, by_tp in profile.items():
            for tp, units in by_tp.items():
                fwd, bwd = units["1"][:2]  # unit 1 is a transformer block
                # Unit 0 is the embedding, the last one final norm + LM head + loss.
                embedding, head = (sum(units[u][:2]) for u in ("0", str(max(int(k) for k in units))))
                table.append(block_record(gpu, model_dir, int(tp), int(mbs), fwd + bwd, "sailor", embedding, head))
        out += as_run(table)
    return out


def aceso_records() -> list[Measurement]:
    """The Aceso OPT-350 block timings (``algo`` 0, the default kernels) of each GPU type."""
    out = []
    for path in sorted(glob.glob(os.path.join(ACESO, "*.csv"))):
        gpu = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            rows = list(csv.DictReader(f))
        out += as_run([block_record(gpu, "OPT-350", int(r["tp"]), int(r["mbs"]), float(r["fwd+bwd"]), "aceso")
                       for r in rows if r["algo"] == "0"])
    return out


def as_run(table: list[Measurement]) -> list[Measurement]:
    """One table's records, marked TF32 where a block beats the fp32 peak (its matmuls cannot
    have run in fp32; ``memx profile import`` asks for ``--tf32`` there: peer_profile_bounds.py)."""
    device = DeviceType(name=table[0].device_type, **table[0].device)
    fp32 = TrainingSpec(dtype="fp32")
    if any(r.time_s < matmul_floor_seconds(r, device, fp32) for r in table) and has_tf32(device):
        return [replace(r, run_options={"tf32": True}) for r in table]
    return table


def new_type_samples(own: list[Measurement], budget: int = MAX_NEW_TYPE_SAMPLES) -> list[Measurement]:
    """The profiler's new-type design over the configurations a GPU type's profile holds (any
    other did not fit): each model and TP degree once, nearest the middle micro-batch of its
    row, then micro-batch spread within a model."""
    rows: dict[tuple, list[int]] = {}
    for r in own:
        rows.setdefault((r.model, r.tp), []).append(r.micro_batch_size)
    middle = {k: np.log2(sorted(v)[len(v) // 2]) for k, v in rows.items()}
    return new_type_design(sorted(own, key=lambda r: (r.model, r.tp, r.micro_batch_size)), budget,
                           levels=lambda r: (("model", r.model), ("tp", r.tp)),
                           centre=lambda r: abs(np.log2(r.micro_batch_size) - middle[(r.model, r.tp)]),
                           position=lambda r: np.log2(r.micro_batch_size), group=lambda r: r.model)


def new_type_benchmark(fleet: list[Measurement], new: list[Measurement], trials: int,
                       tag: str) -> tuple[dict, list[Measurement], np.ndarray]:
    """Per GPU type of ``new``: fit on the other types of ``fleet`` plus at most 5 samples of
    the type, predict the rest of the type's points in ``new``. Returns the error summary, the
    predicted records and the predictions."""
    out, all_test, all_pred = {}, [], []
    for gpu in sorted({r.device_type for r in new}):
        few = new_type_samples([r for r in new if r.device_type == gpu])
        few_keys = {r.key for r in few}
        others = [r for r in fleet if r.device_type != gpu]
        held = [r for r in new if r.device_type == gpu and r.key not in few_keys]
        fitted = fit_predictor(others + few, augmented=augment_measurements(others).points, trials=trials)
        pred = predict_records(fitted, held)
        out[gpu] = {"samples_of_new_type": [{"model": r.model, "tp": r.tp, "micro_batch_size": r.micro_batch_size}
                                            for r in few],
                    **error_summary(pred, [r.time_s for r in held])}
        all_test += held
        all_pred.append(pred)
        print(f"[{tag}] new type {gpu:<10} with {len(few)} samples: MAPE {out[gpu]['mape_pct']:6.2f}% "
              f"over {len(held)} points")
    predicted = np.concatenate(all_pred)
    out["overall"] = per_gpu(all_test, predicted)["overall"]
    print(f"[{tag}] overall MAPE {out['overall']['mape_pct']:.2f}%")
    return out, all_test, predicted


def accuracy_plot(panels: dict, path: str) -> None:
    """Predicted against measured block time, one panel per protocol, one colour per GPU type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({r.device_type for records, _ in panels.values() for r in records})
    colours = dict(zip(gpus, plt.cm.tab10.colors))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.8))
    for ax, (title, (records, predicted)) in zip(axes, panels.items()):
        measured = np.array([r.time_s for r in records]) * 1e3
        for gpu in gpus:
            idx = [i for i, r in enumerate(records) if r.device_type == gpu]
            if idx:
                ax.scatter(measured[idx], predicted[idx] * 1e3, s=14, color=colours[gpu], label=gpu)
        lo, hi = measured.min() / 1.5, measured.max() * 1.5
        ax.plot([lo, hi], [lo, hi], color="0.3", lw=1)
        ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="0.85", zorder=0,
                        label="within 20%")
        mape = float(np.mean(np.abs(predicted / (measured / 1e3) - 1))) * 100
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured block time (ms)",
               ylabel="predicted (ms)", title=f"{title}\nn={len(records)}, MAPE {mape:.1f}%")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_png_atomic(fig, path, dpi=110)


def sailor_minimal_set(records: list[Measurement], refine_budget: int | None = None) -> tuple[set, dict]:
    """Keys measured by the profiler's own sampling (ablation, three-point design, refinement)
    over (micro-batch, TP) of each (model, GPU) profile, and per-profile counts.

    The profile space is the powers of two between the smallest and largest micro-batch and
    TP the profile covers, the defaults their middle values; "measuring" a configuration reads
    the profile's value, and one the profile lacks did not fit (out of memory).
    """
    chosen, report = set(), {}
    groups: dict[tuple, list[Measurement]] = {}
    for r in records:
        groups.setdefault((r.model, r.device_type), []).append(r)
    for (model, gpu), rows in groups.items():
        by_config = {(r.micro_batch_size, r.tp): r for r in rows}
        mbs_space = tuple(2**i for i in range(int(np.log2(min(r.micro_batch_size for r in rows))),
                                              int(np.log2(max(r.micro_batch_size for r in rows))) + 1))
        tp_space = tuple(2**i for i in range(int(np.log2(min(r.tp for r in rows))),
                                             int(np.log2(max(r.tp for r in rows))) + 1))
        first = rows[0]

        def measure(samples, by_config=by_config, first=first):
            return [by_config.get((s.micro_batch_size, s.tp))
                    or replace(first, tp=s.tp, micro_batch_size=s.micro_batch_size, feasible=False, time_s=None)
                    for s in samples]

        space = ProfileSpace({"tp": tp_space, "micro_batch_size": mbs_space, "seq_len": (first.seq_len,),
                              "recompute": ("none",), "num_kv_heads": (first.block_shape["num_kv_heads"],)},
                             Sample(tp=tp_space[len(tp_space) // 2], micro_batch_size=mbs_space[len(mbs_space) // 2],
                                    seq_len=first.seq_len, recompute="none",
                                    num_kv_heads=first.block_shape["num_kv_heads"]))
        result = minimal_sample_set(space, measure, refine_budget=refine_budget)
        chosen |= {m.key for m in result.measurements if m.feasible}
        refined = []
        for r in result.refinements:
            config = {"tp": space.default.tp, "micro_batch_size": space.default.micro_batch_size, **r.line,
                      r.parameter: r.value}
            refined.append({"tp": config["tp"], "micro_batch_size": config["micro_batch_size"],
                            "in_profile": (config["micro_batch_size"], config["tp"]) in by_config,
                            "line_parameter": r.parameter, "metric": r.metric, "trend": r.trend, "r2": r.r2,
                            "worst_interior_error": r.error, "round": r.round})
        report[f"{model}|{gpu}"] = {"measured": result.measured_count, "design": result.design_count,
                                    "refinement_budget": result.refinement_budget, "refinements": refined}
    return chosen, report


def predict_records(predictor, records: list[Measurement]) -> np.ndarray:
    """Per-block seconds the learned model predicts for each record's configuration."""
    out = np.zeros(len(records))
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r.device_type, r.model), []).append(i)
    for (gpu, _), idx in groups.items():
        r0 = records[idx[0]]
        cluster = bench_cluster(DeviceType(name=gpu, **r0.device))
        cost = LearnedCostModel(r0.shape_spec(), cluster, TrainingSpec(dtype=r0.dtype, seq_len=r0.seq_len,
                                                                        **r0.run_options), predictor)
        rows = [records[i] for i in idx]
        pred = cost.layer_costs(np.zeros(len(rows), dtype=int), [r.tp for r in rows],
                                [r.micro_batch_size for r in rows], [r.seq_len for r in rows],
                                np.zeros(len(rows), dtype=int))
        out[idx] = pred.time_s
    return out


def analytical_records(records: list[Measurement]) -> np.ndarray:
    out = np.zeros(len(records))
    for i, r in enumerate(records):
        cost = AnalyticalCostModel(r.shape_spec(), bench_cluster(DeviceType(name=r.device_type, **r.device)),
                                   TrainingSpec(dtype=r.dtype, seq_len=r.seq_len, **r.run_options))
        out[i] = cost.layer_costs([0], [r.tp], [r.micro_batch_size], [r.seq_len], [0]).time_s[0]
    return out


def per_gpu(records, predicted) -> dict:
    measured = np.array([r.time_s for r in records])
    out = {}
    for gpu in sorted({r.device_type for r in records}):
        idx = [i for i, r in enumerate(records) if r.device_type == gpu]
        out[gpu] = error_summary(predicted[idx], measured[idx])
    out["overall"] = error_summary(predicted, measured)
    out["overall"]["mean_of_gpu_mapes_pct"] = float(np.mean([v["mape_pct"] for k, v in out.items() if k != "overall"]))
    return out


def sailor_benchmark(trials: int) -> dict:
    records = sailor_records()
    minimal, sampling = sailor_minimal_set(records)
    design_only, _ = sailor_minimal_set(records, refine_budget=0)
    train = [r for r in records if r.key in minimal]
    test = [r for r in records if r.key not in minimal]
    refined = sum(len(v["refinements"]) for v in sampling.values())
    augmentation = augment_measurements(train)
    print(f"[sailor] {len(records)} measured points; minimal set {len(train)} ({len(design_only)} ablation + design, "
          f"{refined} refinement measurements, {len(train) - len(design_only)} of them in the profiles); "
          f"held back {len(test)}")
    for name, v in sampling.items():
        for r in v["refinements"]:
            print(f"    {name:<22} refined tp={r['tp']} micro-batch={r['micro_batch_size']} "
                  f"(along {r['line_parameter']}, {r['metric']} ratio {r['trend']}, R^2 {r['r2']:.2f}, "
                  f"worst interior error {r['worst_interior_error']:.0%}, round {r['round']})")
    print(augmentation.summary())
    t0 = time.perf_counter()
    predictor = fit_predictor(train, augmented=augmentation.points, trials=trials)
    fit_s = time.perf_counter() - t0
    a1_pred = predict_records(predictor, test)
    a1 = per_gpu(test, a1_pred)
    a1_analytical = per_gpu(test, analytical_records(test))
    print(f"[sailor a1] fit {fit_s:.1f}s; time MAPE overall {a1['overall']['mape_pct']:.2f}% "
          f"(analytical alone {a1_analytical['overall']['mape_pct']:.1f}%)")
    for gpu, e in a1.items():
        print(f"    {gpu:<10} n={e['n']:>3} MAPE {e['mape_pct']:6.2f}%  max {e['max_error_pct']:6.1f}%")

    a1_no_aug = per_gpu(test, predict_records(fit_predictor(train, trials=trials), test))
    # Refinement's effect on the same test points: fitted on the design alone (no refinement).
    design_train = [r for r in records if r.key in design_only]
    design_predictor = fit_predictor(design_train, augmented=augment_measurements(design_train).points,
                                     trials=trials)
    a1_design_only = per_gpu(test, predict_records(design_predictor, test))
    print(f"[sailor a1] same held-back points, fitted without refinement: time MAPE overall "
          f"{a1_design_only['overall']['mape_pct']:.2f}%, RTX-3090 {a1_design_only['RTX-3090']['mape_pct']:.2f}%")
    # The design-only protocol as before refinement: every point outside the design is tested.
    design_test = [r for r in records if r.key not in design_only]
    a1_design_only_own = per_gpu(design_test, predict_records(design_predictor, design_test))
    print(f"[sailor a1] without refinement, its own {len(design_test)} held-back points: time MAPE overall "
          f"{a1_design_only_own['overall']['mape_pct']:.2f}%, "
          f"RTX-3090 {a1_design_only_own['RTX-3090']['mape_pct']:.2f}%")

    a2, a2_records, a2_pred = new_type_benchmark(train, records, trials, "sailor a2")
    aceso = aceso_records()
    a3, a3_records, a3_pred = new_type_benchmark(train, aceso, trials, "aceso a3")
    a3_analytical = per_gpu(aceso, analytical_records(aceso))
    accuracy_plot({"a1: minimal set per profile": (test, a1_pred),
                   "a2: new GPU type, 5 samples": (a2_records, a2_pred),
                   "a3: new GPU type, 5 samples (Aceso data)": (a3_records, a3_pred)}, PLOT)
    print(f"wrote {PLOT}")
    return {
        "data": "shared/peer-data/sailor/profiles (fp32, Megatron-DeepSpeed, CUDA events)",
        "points": len(records), "minimal_set": len(train), "design_only_set": len(design_only),
        "refinement_measurements": refined, "held_back": len(test),
        "augmented_points": len(augmentation.points), "sampling_per_profile": sampling,
        "a1_minimal_set_per_gpu": {"time": a1, "analytical_only_time": a1_analytical,
                                   "without_augmentation_time": a1_no_aug,
                                   "without_refinement_same_test_time": a1_design_only,
                                   "without_refinement_own_test_time": a1_design_only_own, "fit_seconds": fit_s,
                                   "feature_importance": predictor.meta["feature_importance"],
                                   "hyperparameters": predictor.meta["hyperparameters"]},
        "a2_new_gpu_type_max_5_samples": {"time": a2},
        "a3_new_gpu_type_independent_data": {
            "data": "shared/peer-data/sailor/aceso_layer_time (OPT-350 block, algo 0), "
                    "fleet: the other types' sailor minimal sets",
            "points": len(aceso), "time": a3, "analytical_only_time": a3_analytical},
        "goal": "time MAPE under 8%",
    }


# --------------------------------------------------------------------------- (b) this CPU

CPU_SPACE = {"tp": (1,), "micro_batch_size": (1, 2, 3, 4, 6, 8), "seq_len": (32, 64, 96, 128, 192, 256),
             "recompute": ("none", "selective", "full"), "num_kv_heads": (1, 2, 4, 8)}


def cpu_benchmark(grid_size: int, trials: int) -> dict:
    import torch

    from memx_launch.profiling.space import PARAMETERS, ProfileSpace, Sample
    from memx_launch.profiling.design import ablation_samples, classify_impact, three_point_design
    from memx_launch.profiling.kernel import calibrate, detect_device_type

    # One thread: the machine's two cores are shared, and one thread per measurement is the
    # least sensitive to what the neighbours run.
    torch.set_num_threads(1)
    machine = machine_info()  # this part's own load, kept with it when a later run skips it
    spec = MODEL_CATALOG["llama-small"]
    device = detect_device_type("cpu")
    space = ProfileSpace(CPU_SPACE, Sample(tp=1, micro_batch_size=2, seq_len=128, recompute="none",
                                           num_kv_heads=spec.num_kv_heads))
    settings = dict(num_blocks=2, warmup=1, repeats=5)
    t_start = time.perf_counter()

    ablation = ablation_samples(space)
    measured = dict(zip(ablation, calibrate(spec, device, ablation, **settings)))
    impact = classify_impact(space, measured)
    design, design_params, _ = three_point_design(space, impact)
    new_design = [s for s in design if s not in measured]
    grid = [Sample(*combo) for combo in itertools.product(*(CPU_SPACE[p] for p in PARAMETERS))]
    rng = random.Random(0)
    held_back = rng.sample([g for g in grid if g not in measured and g not in design], grid_size)
    # Design and held-back points measured interleaved, so that load from other users of the
    # machine falls on both alike.
    order = new_design + held_back
    rng.shuffle(order)
    results = dict(zip(order, calibrate(spec, device, order, **settings)))
    measured.update({s: results[s] for s in new_design})
    profile = list(measured.values())
    test = [results[s] for s in held_back if results[s].feasible]
    measure_s = time.perf_counter() - t_start
    print(f"[cpu] {device}")
    for p in impact:
        print(f"    {p.name:<17} time {p.time_change:+.1%} memory {p.memory_change:+.1%} "
              f"-> {'high' if p.high else 'low'}")
    print(f"[cpu] measured {len(profile)} (ablation {len(ablation)}, design {len(design)}) of a full grid "
          f"of {space.full_grid_size}; held back {len(test)}; {measure_s:.0f}s")

    augmentation = augment_measurements(profile, space_values=CPU_SPACE)
    print(augmentation.summary())
    predictor = fit_predictor(profile, augmented=augmentation.points, trials=trials)
    cluster = ClusterSpec("this-cpu", (device,), (Node("n", (("cpu", 1),), 1.0),), float("inf"))
    training = TrainingSpec(dtype="fp32")

    measured_time = np.array([r.time_s for r in test])
    measured_mem = np.array([r.peak_memory_bytes for r in test])
    report = {}
    variants = {"learned": predictor, "learned_without_augmentation": fit_predictor(profile, trials=trials)}
    for name, fitted in variants.items():
        # The held-back rows differ in KV heads too: one cost model per block shape.
        time_pred, mem_pred = np.zeros(len(test)), np.zeros(len(test))
        for kv in sorted({r.block_shape["num_kv_heads"] for r in test}):
            idx = [i for i, r in enumerate(test) if r.block_shape["num_kv_heads"] == kv]
            shape = type(spec)(**{**spec.to_dict(), "num_kv_heads": kv})
            model = LearnedCostModel(shape, cluster, training, fitted)
            sub = [test[i] for i in idx]
            cost = model.layer_costs(np.zeros(len(sub), dtype=int), [r.tp for r in sub],
                                     [r.micro_batch_size for r in sub], [r.seq_len for r in sub],
                                     [("none", "selective", "full").index(r.recompute) for r in sub])
            time_pred[idx] = cost.time_s
            # A record's peak covers num_blocks blocks' stored activations plus one backward's working set.
            mem_pred[idx] = settings["num_blocks"] * cost.activation_bytes + cost.working_bytes
        report[name] = {"time": {**error_summary(time_pred, measured_time),
                                 "ranking": ranking_summary(time_pred, measured_time)},
                        "memory": error_summary(mem_pred, measured_mem)}
    analytical_time, analytical_mem = np.zeros(len(test)), np.zeros(len(test))
    for i, r in enumerate(test):
        cost = AnalyticalCostModel(r.shape_spec(), cluster, training).layer_costs(
            [0], [r.tp], [r.micro_batch_size], [r.seq_len], [("none", "selective", "full").index(r.recompute)])
        analytical_time[i] = cost.time_s[0]
        analytical_mem[i] = settings["num_blocks"] * cost.activation_bytes[0] + cost.working_bytes[0]
    report["analytical_only"] = {"time": {**error_summary(analytical_time, measured_time),
                                          "ranking": ranking_summary(analytical_time, measured_time)},
                                 "memory": error_summary(analytical_mem, measured_mem)}
    noise = np.array([r.time_spread_s / r.time_s for r in test])
    learned = report["learned"]
    print(f"[cpu] held-back {len(test)}: time MAPE {learned['time']['mape_pct']:.2f}%, memory MAPE "
          f"{learned['memory']['mape_pct']:.2f}%, Spearman {learned['time']['ranking']['spearman']:.3f} "
          f"(analytical alone: time {report['analytical_only']['time']['mape_pct']:.1f}%, memory "
          f"{report['analytical_only']['memory']['mape_pct']:.1f}%); median repeat IQR {np.median(noise):.1%}")
    return {
        "machine": machine,
        "device": {"name": device.name, "peak_tflops_measured": device.peak_tflops,
                   "memory_bandwidth_gbps_measured": device.memory_bandwidth_gbps, "torch_threads": 1},
        "model": "llama-small blocks (h=512, 8 heads, SwiGLU 1376), fp32, 2 blocks per run, 5 repeats (median)",
        "space": {k: list(v) for k, v in CPU_SPACE.items()}, "full_grid": space.full_grid_size,
        "impact": [vars(p) for p in impact], "design_parameters": design_params,
        "measured_for_profile": len(profile), "held_back_measured": len(test),
        "augmented_points": len(augmentation.points), "measure_seconds": measure_s,
        "median_repeat_iqr_share": float(np.median(noise)),
        "results": report, "feature_importance": predictor.meta["feature_importance"],
        "hyperparameters": predictor.meta["hyperparameters"],
        "goals": "time MAPE < 10%, memory MAPE < 5%, Spearman > 0.95",
    }


# --------------------------------------------------------------------------- (c) cache


def cache_benchmark(trials: int) -> dict:
    """Predictions per second through CachedCostModel over a learned model, 1e6-row queries."""
    records = sailor_records()
    predictor = fit_predictor(records, trials=trials)
    names = ("A100-40", "V100-16", "RTX-3090")
    types = tuple(sailor_device(n) for n in names)
    cluster = ClusterSpec("bench", types, tuple(Node(f"n{i}", ((n, 8),), 300.0) for i, n in enumerate(names)), 25.0)
    inner = LearnedCostModel(MODEL_CATALOG["llama3-8b"], cluster, TrainingSpec(), predictor)
    cached = CachedCostModel(inner)
    rng = np.random.default_rng(0)
    rows = 1_000_000
    query = (rng.integers(0, 3, rows), 2 ** rng.integers(0, 4, rows), 2 ** rng.integers(0, 5, rows),
             rng.choice([2048, 4096, 8192], rows), rng.integers(0, 3, rows))
    t0 = time.perf_counter()
    cached.layer_costs(*query)
    cold_s = time.perf_counter() - t0
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        cached.layer_costs(*query)
        warm.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    inner.layer_costs(*(q[:100_000] for q in query))
    uncached_rate = 100_000 / (time.perf_counter() - t0)
    stats = cached.cache.stats()
    rate = rows / min(warm)
    print(f"[cache] {rows} rows, {stats['entries']} distinct: cold {rows / cold_s:,.0f}/s, warm {rate:,.0f}/s, "
          f"uncached predictor {uncached_rate:,.0f}/s")
    return {"rows_per_query": rows, "distinct_configurations": stats["entries"],
            "cold_predictions_per_s": rows / cold_s, "warm_predictions_per_s": rate,
            "uncached_predictions_per_s": uncached_rate, "stats": stats, "goal": "over 1e6 predictions/s"}


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cpu", action="store_true", help="only the GPU-profile and cache parts")
    parser.add_argument("--trials", type=int, default=10, help="Bayesian-optimisation trials per fit")
    parser.add_argument("--cpu-grid", type=int, default=60, help="held-back CPU configurations to measure")
    args = parser.parse_args(argv)
    random.seed(0)
    result = {"machine": machine_info(),
              "sailor": sailor_benchmark(args.trials), "cache": cache_benchmark(args.trials)}
    if not args.skip_cpu:
        result["cpu"] = cpu_benchmark(args.cpu_grid, args.trials)
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            previous = json.load(f)
        for key in ("cpu", "cache"):
            if key in previous and key not in result:
                result[key] = previous[key]
    write_json_atomic(RESULTS, result, overwrite=True)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
