"""What the predictor learns from: physics features of one block on one device, the targets
log(measured / analytical), and the per-device-type offsets that serve as the trees' base margin.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from memx_launch.planning.costmodel import AnalyticalCostModel, LayerCost
from memx_launch.planning.model_states import weight_copy_bytes
from memx_launch.errors import ConfigError
from memx_launch.planning.plan import RECOMPUTE_LEVELS
from memx_launch.profiling.profiledb import Measurement
from memx_launch.specs.cluster import ClusterSpec, DeviceType, Emulation, Node
from memx_launch.specs.node import PCIE_STAGED_SHARE
from memx_launch.specs.training import TrainingSpec


FEATURE_NAMES = (
    "tp", "log2_micro_batch", "log2_seq_len", "recompute",
    "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "gated_mlp", "dtype_bytes",
    "log2_tokens_x_hidden_per_rank", "log2_analytical_time", "comm_share", "log2_analytical_memory",
)


TP_COLUMN = FEATURE_NAMES.index("tp")


def physics_features(cost: AnalyticalCostModel, device, tp, mbs, seq, recompute) -> tuple[np.ndarray, LayerCost]:
    """Feature matrix of queries (broadcast together, flattened) against one analytical model,
    and that model's costs."""
    device, tp, mbs, seq, recompute = (a.reshape(-1) for a in np.broadcast_arrays(
        np.asarray(device, dtype=np.int64), np.asarray(tp, dtype=np.float64), np.asarray(mbs, dtype=np.float64),
        np.asarray(seq, dtype=np.float64), np.asarray(recompute, dtype=np.float64)))
    base = cost.layer_costs(device, tp, mbs, seq, recompute)
    model = cost.model
    hidden_bytes = mbs * seq * model.hidden_size * cost.training.dtype_bytes
    comm = cost.tp_allreduces(recompute) * cost.tp_allreduce_time(hidden_bytes, device, tp)
    memory = base.activation_bytes + base.working_bytes
    n = device.shape[0]
    shape = np.broadcast_to([model.hidden_size, model.num_heads, model.num_kv_heads, model.ffn_hidden_size,
                             float(model.gated_mlp), cost.training.dtype_bytes], (n, 6))
    X = np.column_stack([
        tp, np.log2(mbs), np.log2(seq), recompute, shape,
        np.log2(mbs * seq * model.hidden_size / tp), np.log2(base.time_s),
        comm / base.time_s, np.log2(memory),
    ])
    return X, base


def setup_key(r: Measurement) -> tuple:
    """What a record's analytical estimate depends on besides its configuration."""
    return (json.dumps(r.device, sort_keys=True), r.device_type, json.dumps(r.block_shape, sort_keys=True),
            r.dtype, r.tp_link_gbps, r.tp_over_pcie, r.emulation_slowdown, r.emulated, json.dumps(r.run_options, sort_keys=True))


def profiled_cluster(first: Measurement, device: DeviceType) -> ClusterSpec:
    """The one-device cluster ``first`` was measured on. Its TP group reaches the link the record
    carries, over PCIe through the host where the record says so (the node's link is then the one
    that staging through the host brings down to it). An emulated record's cluster is emulated
    too: its device computed as the CPU it is, whatever vendor it stood in for, and the plan's
    emulated cluster is estimated so (a ratio learned against another estimate would not carry)."""
    reached = float(first.tp_link_gbps or 1.0)
    node = Node("profiled", ((device.name, 1),), reached / PCIE_STAGED_SHARE, gpu_link="pcie") \
        if first.tp_over_pcie else Node("profiled", ((device.name, 1),), reached, gpu_link="direct")
    emulation = Emulation(((device.name, first.emulation_slowdown),)) if first.emulated else None
    return ClusterSpec("profiled", (device,), (node,), math.inf, emulation)


@dataclass
class TrainingSet:
    X: np.ndarray
    Y: np.ndarray
    """log(measured / analytical): [time, memory]."""
    has_memory: np.ndarray
    """Rows whose memory was measured (the others carry a filled-in target)."""
    device_types: np.ndarray
    models: np.ndarray
    """Model signature of each row."""

    def subset(self, idx) -> "TrainingSet":
        return TrainingSet(self.X[idx], self.Y[idx], self.has_memory[idx], self.device_types[idx], self.models[idx])


def training_rows(records: list[Measurement]) -> TrainingSet:
    """Features and log-ratio targets of the feasible records.

    Infeasible (out-of-memory) records carry no time and are left out of the regression.
    """
    groups: dict[tuple, list[Measurement]] = {}
    for r in records:
        if r.feasible and r.time_s and r.time_s > 0:
            groups.setdefault(setup_key(r), []).append(r)
    if not groups:
        raise ConfigError("profile", "no feasible measurement to learn from",
                          "profile configurations that fit in memory (memx profile)")
    xs, ys, masks, devices, models = [], [], [], [], []
    for rows in groups.values():
        first = rows[0]
        device = DeviceType(name=first.device_type, **first.device)
        training = TrainingSpec(dtype=first.dtype, **first.run_options)
        cost = AnalyticalCostModel(first.shape_spec(), profiled_cluster(first, device), training)
        tp = np.array([r.tp for r in rows], dtype=np.float64)
        X, base = physics_features(cost, np.zeros(len(rows), dtype=np.int64), tp,
                                   [r.micro_batch_size for r in rows], [r.seq_len for r in rows],
                                   [RECOMPUTE_LEVELS.index(r.recompute) for r in rows])
        k = np.array([r.num_blocks for r in rows], dtype=np.float64)
        analytical_memory = k * base.activation_bytes + base.working_bytes
        # The blocks' weight copies (autocast's 16-bit ones) are model states, not what the ratio scales.
        copies = k * weight_copy_bytes(cost.model, training, tp)[0]
        measured_memory = np.array([r.peak_memory_bytes or np.nan for r in rows], dtype=np.float64) - copies
        measured_memory[measured_memory <= 0] = np.nan
        time = np.array([r.time_s for r in rows])
        xs.append(X)
        ys.append(np.column_stack([np.log(time / base.time_s), np.log(measured_memory / analytical_memory)]))
        masks.append(np.isfinite(ys[-1][:, 1]))
        devices += [r.device_type for r in rows]
        models += [r.model_signature for r in rows]
    X, Y, has_memory = np.vstack(xs), np.vstack(ys), np.concatenate(masks)
    devices = np.array(devices)
    # Rows without a memory measurement (e.g. time-only public profiles) get their type's
    # typical measured ratio, or the analytical value when the type measured none (never
    # another type's: adding types must not move a type's fit); the mask keeps them out of
    # the memory error.
    for name in np.unique(devices):
        mine = devices == name
        measured = mine & has_memory
        Y[mine & ~has_memory, 1] = np.median(Y[measured, 1]) if measured.any() else 0.0
    return TrainingSet(X, Y, has_memory, devices, np.array(models))


@dataclass
class Offsets:
    """Per-device calibration: the median log-ratio of the measurements of each (device type,
    model) at each measured TP degree, linear in log2 TP between measured degrees and flat
    beyond them; the device type's median for a model it has no measurement of, then the
    global median.

    It is the trees' base margin: a device's level comes from its own samples (one per TP
    degree suffices; TP is the level that changes the hardware path, NVLink pair or PCIe or
    across sockets), the trees learn how the ratio moves with the configuration.
    """

    levels: dict
    """"device|model" -> {TP degree: [time, memory]}."""
    devices: dict
    overall: list

    @classmethod
    def fit(cls, ts: TrainingSet) -> "Offsets":
        def median(mask):
            time = float(np.median(ts.Y[mask, 0]))
            mem_mask = mask & ts.has_memory
            memory = float(np.median(ts.Y[mem_mask, 1])) if mem_mask.any() else float(np.median(ts.Y[mask, 1]))
            return [time, memory]

        tp = ts.X[:, TP_COLUMN].astype(np.int64)
        levels: dict = {}
        for d, m, t in sorted(set(zip(ts.device_types, ts.models, tp))):
            levels.setdefault(f"{d}|{m}", {})[str(t)] = median((ts.device_types == d) & (ts.models == m) & (tp == t))
        devices = {d: median(ts.device_types == d) for d in sorted(set(ts.device_types))}
        return cls(levels, devices, median(np.ones(len(ts.Y), dtype=bool)))

    def margin(self, X: np.ndarray, device_types, models) -> np.ndarray:
        """[n, 2] base margin of feature rows ``X`` (for their TP column)."""
        log_tp = np.log2(X[:, TP_COLUMN])
        out = np.empty((len(log_tp), 2))
        # Group rows by (device type, model) through integer codes: per-row keys cost more
        # than the trees' prediction on large queries.
        device_names, device_index = np.unique(np.asarray(device_types), return_inverse=True)
        model_names, model_index = np.unique(np.asarray(models), return_inverse=True)
        pair_index = device_index.reshape(-1) * len(model_names) + model_index.reshape(-1)
        for pair in np.unique(pair_index):
            rows = pair_index == pair
            device_type, model = device_names[pair // len(model_names)], model_names[pair % len(model_names)]
            by_tp = self.levels.get(f"{device_type}|{model}")
            if by_tp is None:
                out[rows] = self.devices.get(device_type) or self.overall
                continue
            degrees = sorted(by_tp, key=int)
            x = np.log2([int(t) for t in degrees])
            for k in range(2):
                out[rows, k] = np.interp(log_tp[rows], x, [by_tp[t][k] for t in degrees])
        return out
