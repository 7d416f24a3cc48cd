"""Pipeline layouts: which ranks form each stage for a TP degree, a DP degree and an order of
device types along the pipeline. TP and DP groups stay inside one stage and one device type.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec


@dataclass
class Layout:
    """One (TP, DP, device-type order): which ranks form each pipeline stage."""

    tp: int
    dp: int
    order: tuple[str, ...]
    stage_device: np.ndarray          # (P,) index into the cost model's device names
    stage_ranks: list[list[int]]
    capacity: np.ndarray              # (P,) bytes
    next_stage_gbps: np.ndarray       # (P,) link to the next stage, inf for the last
    dp_gbps: np.ndarray               # (P,) slowest link of the stage's DP groups

    @property
    def pp(self) -> int:
        return len(self.stage_ranks)


def tp_degrees(model: ModelSpec, cluster: ClusterSpec) -> list[int]:
    """Powers of two that divide the heads and fit inside one node for every device type."""
    per_node = min(n for node in cluster.nodes for _, n in node.devices)
    out, tp = [], 1
    while tp <= min(8, per_node):
        if model.num_heads % tp == 0 and model.num_kv_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def enumerate_layouts(model: ModelSpec, cluster: ClusterSpec, device_names: tuple[str, ...],
                      tps: list[int] | None = None, max_orders: int = 24) -> list[Layout]:
    rank_types = cluster.rank_device_types()
    counts = cluster.type_counts()
    ranks_of = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in counts}
    gcd = math.gcd(*counts.values())
    layouts = []
    for tp in tps or tp_degrees(model, cluster):
        for group in (g for g in range(tp, gcd + 1, tp) if gcd % g == 0):
            dp = group // tp
            pp = cluster.world_size // group
            if pp > model.num_layers:
                continue
            for order in itertools.islice(itertools.permutations(counts), max_orders):
                stage_ranks = [ranks_of[t][i:i + group] for t in order
                               for i in range(0, counts[t], group)]
                layouts.append(make_layout(cluster, device_names, tp, dp, order, stage_ranks))
    return layouts


def make_layout(cluster, device_names, tp, dp, order, stage_ranks) -> Layout:
    rank_types = cluster.rank_device_types()
    types = [rank_types[ranks[0]] for ranks in stage_ranks]
    next_gbps = [min(cluster.link_gbps(a, b) for a, b in zip(cur, nxt))
                 for cur, nxt in zip(stage_ranks, stage_ranks[1:])] + [math.inf]
    # A DP group is every tp-th rank of the stage; its ring's slowest hop decides.
    dp_gbps = [min([cluster.group_gbps(ranks[j::tp]) for j in range(tp)]) for ranks in stage_ranks]
    return Layout(tp, dp, tuple(order), np.array([device_names.index(t) for t in types]),
                  [list(r) for r in stage_ranks],
                  np.array([cluster.device_type(t).memory_bytes for t in types]),
                  np.array(next_gbps, dtype=float), np.array(dp_gbps, dtype=float))


def layout_from_stage_devices(model, cluster, device_names, tp, pp, dp, stage_devices) -> Layout:
    """A user-given layout: stage i on the next free ranks of ``stage_devices[i]``."""
    if tp * pp * dp != cluster.world_size:
        raise ConfigError("--tp/--pp/--dp", f"tp*pp*dp = {tp * pp * dp} but the cluster has "
                          f"{cluster.world_size} devices", "choose degrees whose product is the world size")
    rank_types = cluster.rank_device_types()
    free = {t: [r for r, rt in enumerate(rank_types) if rt == t] for t in cluster.type_counts()}
    if stage_devices is None:
        stage_devices = [rank_types[i * tp * dp] for i in range(pp)]
    if len(stage_devices) != pp:
        raise ConfigError("--stage-devices", f"{len(stage_devices)} entries for pp={pp}", "give one device type per stage")
    stage_ranks = []
    for i, t in enumerate(stage_devices):
        if t not in free:
            raise ConfigError(f"--stage-devices[{i}]", f"unknown device type {t!r}",
                              f"use one of {', '.join(free)}")
        if len(free[t]) < tp * dp:
            raise ConfigError(f"--stage-devices[{i}]", f"not enough {t} devices left for a stage of "
                              f"tp*dp={tp * dp}", "assign stages to device types by their counts")
        stage_ranks.append(free[t][:tp * dp])
        free[t] = free[t][tp * dp:]
    return make_layout(cluster, device_names, tp, dp, tuple(dict.fromkeys(stage_devices)), stage_ranks)
