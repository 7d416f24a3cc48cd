"""What calibration measures besides the blocks: the embedding and head times, and the memory
a process holds above its tensors, per device type.

The embedding and the head (final norm, output layer, loss) are one each per model, so a tree
per part would learn from a handful of rows: the learned model times each as a fixed cost per
call plus a scale of its analytical time, per device type and model (the physics carries the
trend in micro-batch, sequence and TP, as for the blocks' offsets).

The efficiency per device type (the share of peak the blocks sustained) is what the analytical
model of a calibrated type takes in place of the default.

The compute descriptors a type was profiled with (vendor, peak, efficiency, HBM bandwidth,
compute capability, host time per layer) are the analytical base its learned ratios were fitted
against; the learned model predicts on that base whatever a cluster file says of the type's
compute. A profile whose records of one type carry different descriptors (a re-detected peak, an
older memx) is fitted on one set, that of most of them. The host time per layer is the median of
what the type's records measured (GPUs), so a small block's floor is the framework's own and the
trees learn the device's work above it.

The fixed memory overhead (DeviceType.memory_overhead_gib) is the caching allocator's reserve
over allocated at the peak (peak_reserved - peak_allocated) plus the memory the process holds
outside the allocator (CUDA context, NCCL buffers): the median over a type's records that
measured both. No torch import here.
"""

from __future__ import annotations

import collections
import json
import warnings
from dataclasses import replace

import numpy as np

from memx_launch.planning.costmodel import AnalyticalCostModel
from memx_launch.planning.plan import RECOMPUTE_LEVELS
from memx_launch.profiling.features import profiled_cluster, setup_key
from memx_launch.profiling.profiledb import Measurement
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import DEFAULT_EFFICIENCY
from memx_launch.specs.training import TrainingSpec

PARTS = ("embedding", "head")
# The fields of a device type the analytical block and part times depend on (the vendor: the
# default efficiency, launches and link latency). Capacity and memory overhead do not enter
# them, and fused attention is what the cluster file says the run may use.
COMPUTE_DESCRIPTORS = ("vendor", "peak_tflops", "peak_tflops_fp32", "efficiency", "memory_bandwidth_gbps",
                       "compute_capability", "host_ms_per_layer")


def _analytical(first: Measurement, efficiency: float | None = None) -> AnalyticalCostModel:
    device = DeviceType(name=first.device_type, **first.device)
    if efficiency is not None:
        device = replace(device, efficiency=efficiency)
    return AnalyticalCostModel(first.shape_spec(), profiled_cluster(first, device),
                               TrainingSpec(dtype=first.dtype, **first.run_options))


def _same_setup_groups(records) -> dict[tuple, list[Measurement]]:
    """Records by what their analytical estimate depends on besides the configuration."""
    groups: dict[tuple, list[Measurement]] = {}
    for r in records:
        groups.setdefault(setup_key(r), []).append(r)
    return groups


def part_levels(records: list[Measurement]) -> dict:
    """{"embedding" | "head": {"device type|model signature": [scale, fixed seconds]}}: the
    measured time of each part as a fixed cost per call (launches, host work: what keeps a
    small embedding at about a millisecond) plus a scale of its analytical time, fitted by
    non-negative least squares over the feasible records that timed that part."""
    from scipy.optimize import nnls

    groups = _same_setup_groups(r for r in records if r.feasible and (r.embedding_time_s or r.head_time_s))
    points: dict[str, dict[str, list[tuple[float, float]]]] = {part: {} for part in PARTS}
    for rows in groups.values():
        cost = _analytical(rows[0])
        for part in PARTS:
            timed = [r for r in rows if (getattr(r, f"{part}_time_s") or 0) > 0]
            if not timed:
                continue
            base = getattr(cost, f"{part}_time")(np.zeros(len(timed), dtype=np.int64), [r.tp for r in timed],
                                                 [r.micro_batch_size for r in timed], [r.seq_len for r in timed])
            key = f"{rows[0].device_type}|{rows[0].model_signature}"
            points[part].setdefault(key, []).extend(zip(base.tolist(), [getattr(r, f"{part}_time_s") for r in timed]))
    out: dict[str, dict[str, list[float]]] = {part: {} for part in PARTS}
    for part, by_key in points.items():
        for key, pairs in by_key.items():
            base, measured = np.array(pairs).T
            # Relative errors: each point weighted by 1 / its measured time.
            (scale, fixed), _ = nnls(np.column_stack([base, np.ones_like(base)]) / measured[:, None],
                                     np.ones_like(measured))
            out[part][key] = [float(scale), float(fixed)]
    return out


def measured_overhead_gib(records: list[Measurement]) -> dict:
    """{device type: GiB held above allocated tensors}, from the records that measured both the
    allocator's reserve and the memory outside it."""
    by_type: dict[str, list[float]] = {}
    for r in records:
        if r.feasible and r.peak_memory_bytes is not None and r.peak_reserved_bytes is not None \
                and r.context_bytes is not None:
            slack = max(0.0, r.peak_reserved_bytes - r.peak_memory_bytes)
            by_type.setdefault(r.device_type, []).append((slack + r.context_bytes) / 2**30)
    return {name: float(np.median(v)) for name, v in sorted(by_type.items())}


def part_terms(levels: dict, part: str, device_names, model_signature: str) -> tuple[np.ndarray, np.ndarray]:
    """Per device type of a cluster: (scale, fixed seconds) of ``part``; (1, 0), the analytical
    time, for a type whose profile did not time it."""
    by_key = levels.get(part, {})
    terms = np.array([by_key.get(f"{name}|{model_signature}", [1.0, 0.0]) for name in device_names], dtype=float)
    return terms[:, 0], terms[:, 1]


def measured_efficiency(records: list[Measurement]) -> dict:
    """{device type: share of its peak the blocks sustained}: the efficiency at which the
    analytical block time equals the measured one, median over the type's records.

    Only the compute term scales with the efficiency (memory-bound work, launches and TP
    communication do not): the analytical time at the record's efficiency e and at e/2 gives
    the compute part C (T(e/2) - T(e) = C) and the rest R, and the measured time M implies
    e x C / (M - R), clipped to (0, 1]. This is what the analytical model (memx plan without a
    profile) can take as the type's ``efficiency`` in place of the default.
    """
    by_type: dict[str, list[float]] = {}
    groups = _same_setup_groups(r for r in records if r.feasible and r.time_s and r.time_s > 0)
    for rows in groups.values():
        first = rows[0]
        e = first.device.get("efficiency") or DEFAULT_EFFICIENCY  # any e: e x C does not depend on it
        query = (np.zeros(len(rows), dtype=np.int64), [r.tp for r in rows], [r.micro_batch_size for r in rows],
                 [r.seq_len for r in rows], [RECOMPUTE_LEVELS.index(r.recompute) for r in rows])
        at_e = _analytical(first, e).layer_costs(*query).time_s
        compute = _analytical(first, e / 2).layer_costs(*query).time_s - at_e
        rest = at_e - compute
        measured = np.array([r.time_s for r in rows])
        implied = np.where(measured > rest, e * compute / np.maximum(measured - rest, 1e-30), 1.0)
        # Launch-bound blocks (no compute term left above the launch floor) say nothing of it.
        informative = compute > 1e-3 * at_e
        by_type.setdefault(first.device_type, []).extend(np.clip(implied[informative], 1e-3, 1.0).tolist())
    return {name: float(np.median(v)) for name, v in sorted(by_type.items()) if v}


def one_descriptor_set(records: list[Measurement]) -> tuple[list[Measurement], dict]:
    """``records`` with every record of a device type carrying the same descriptors (those most
    of its records carry, the latest of equally common sets; a warning when they differ), and
    {device type: its compute descriptors (:data:`COMPUTE_DESCRIPTORS`)}: the base of its learned
    ratios."""
    sets: dict[str, collections.Counter] = {}
    host_s: dict[str, list[float]] = {}
    for r in records:
        # An unset field and one a newer memx writes as null describe the same device.
        described = {k: v for k, v in r.device.items() if v is not None}
        sets.setdefault(r.device_type, collections.Counter())[json.dumps(described, sort_keys=True)] += 1
        if r.host_time_s:
            host_s.setdefault(r.device_type, []).append(r.host_time_s)
    chosen, descriptors = {}, {}
    for name, counter in sets.items():
        top = max(counter.values())
        chosen[name] = json.loads([key for key in counter if counter[key] == top][-1])
        if name in host_s:  # measured beats what the cluster file said when the profile was taken
            chosen[name]["host_ms_per_layer"] = round(1e3 * float(np.median(host_s[name])), 4)
        if len(counter) > 1:
            warnings.warn(f"the profile's records of device type {name} carry {len(counter)} different device "
                          f"descriptions; fitted on the one {top} of {sum(counter.values())} carry: {chosen[name]}",
                          stacklevel=2)
        device = DeviceType(name=name, **chosen[name])
        descriptors[name] = {k: getattr(device, k) for k in COMPUTE_DESCRIPTORS}
    records = [r if r.device == chosen[r.device_type] else replace(r, device=chosen[r.device_type]) for r in records]
    return records, descriptors


def with_type_fields(cluster: ClusterSpec, fields_by_type: dict) -> ClusterSpec:
    """``cluster`` whose device types named in ``fields_by_type`` take those field values: the
    profiled compute descriptors (:func:`one_descriptor_set`), so a learned ratio scales the base
    it was fitted against, or the measured efficiency (:func:`measured_efficiency`); capacities,
    overheads, fused attention and links stay the cluster's."""
    types = tuple(replace(d, **fields_by_type[d.name]) if d.name in fields_by_type else d
                  for d in cluster.device_types)
    return replace(cluster, device_types=types)
