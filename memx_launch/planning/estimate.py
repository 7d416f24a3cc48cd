"""Predicting one given layout (``memx estimate``): the split and recompute levels the user fixed.
"""

from __future__ import annotations


import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.errors import ConfigError
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.planning.layouts import layout_from_stage_devices
from memx_launch.planning.objective import WEIGHT_PROFILES, objective_for
from memx_launch.planning.scoring import CostTable, Evaluator, GroupResult, balance_layers
from memx_launch.planning.search import default_references, to_plan


def _parse_levels(recompute, pp: int) -> np.ndarray:
    if recompute is None:
        recompute = ["none"]
    if isinstance(recompute, str):
        recompute = recompute.split(",")
    if len(recompute) == 1:
        recompute = list(recompute) * pp
    if len(recompute) != pp:
        raise ConfigError("--recompute", f"{len(recompute)} levels for pp={pp}", "give one level, or one per stage")
    for level in recompute:
        if level not in cm.RECOMPUTE_LEVELS:
            raise ConfigError("--recompute", f"unknown level {level!r}", f"use one of {', '.join(cm.RECOMPUTE_LEVELS)}")
    return np.array([[cm.RECOMPUTE_LEVELS.index(level) for level in recompute]])


def evaluate_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, tp: int, pp: int,
                    dp: int, micro_batch_size: int, layers_per_stage=None, recompute=None,
                    stage_devices=None, schedule: str = "1f1b", virtual_stages: int = 1,
                    cost_model: cm.LayerCostModel | None = None, weights=None,
                    references: tuple[float, float, float] | None = None) -> Plan:
    """Predict one given layout (``memx estimate``). The plan may not fit: its stages then
    show predicted memory above capacity. Phi uses ``references`` (T, M, V medians) when
    given, else those of a default search of the same model, cluster and training spec."""
    if schedule not in ("1f1b", "interleaved"):
        raise ConfigError("--schedule", f"unknown schedule {schedule!r}", "use 1f1b or interleaved")
    _check_layout_numbers(model, cluster, tp, pp, dp, micro_batch_size, schedule, virtual_stages, layers_per_stage)
    v = virtual_stages if schedule == "interleaved" else 1
    if training.global_batch_size % (dp * micro_batch_size):
        raise ConfigError("--global-batch-size", f"{training.global_batch_size} is not divisible by "
                          f"dp*micro_batch_size={dp * micro_batch_size}", "choose a multiple of dp*micro_batch_size")
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ConfigError("--tp", f"{tp} does not divide the model's {model.num_heads} heads and "
                          f"{model.num_kv_heads} KV heads", "use a divisor of both")
    if training.global_batch_size // (dp * micro_batch_size) < pp:
        raise ConfigError("--global-batch-size", f"{training.global_batch_size // (dp * micro_batch_size)} "
                          f"micro-batches for pp={pp} stages", "give at least one micro-batch per stage")
    analytical = cm.AnalyticalCostModel(model, cluster, training)
    cost_model = cost_model or analytical
    layout = layout_from_stage_devices(model, cluster, tuple(cost_model.device_names), tp, pp, dp, stage_devices)
    table = CostTable(cost_model, len(cost_model.device_names), [tp], [micro_batch_size], [training.seq_len])
    evaluator = Evaluator(model, cluster, training, cost_model, analytical, table)
    levels = _parse_levels(recompute, pp)
    layers = None
    if layers_per_stage is not None:
        layers = np.array([list(layers_per_stage)], dtype=np.int64)
        if layers.shape[1] != pp or layers.sum() != model.num_layers or (layers < v).any():
            raise ConfigError("--layers-per-stage", f"{list(layers_per_stage)} must give pp={pp} stages of at "
                              f"least {v} layer(s) adding up to {model.num_layers}", "fix the split")
        result = evaluator.score(layout, micro_batch_size, training.seq_len, schedule, v, levels, layers)
    else:
        result = _score_fixed_levels(evaluator, layout, micro_batch_size, training.seq_len, schedule, v, levels)
    if references is None:
        references = default_references(model, cluster, training, cost_model)
    profile = "custom" if weights is not None else "default"
    chosen = tuple(weights) if weights is not None else WEIGHT_PROFILES["default"]
    objective = objective_for(result.T[0], result.M[0], result.V[0], references, profile, chosen)
    return to_plan(result, 0, model, cluster, training, objective)


def _check_layout_numbers(model, cluster, tp, pp, dp, mbs, schedule, virtual_stages, layers_per_stage) -> None:
    """Integers in range before any array is built from them."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--dp", dp), ("--micro-batch-size", mbs),
                        ("--virtual-stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(flag, f"must be a positive integer, got {value!r}")
    if tp * pp * dp > cluster.world_size:
        raise ConfigError("--tp", f"tp*pp*dp={tp * pp * dp} is more than the cluster's {cluster.world_size} devices",
                          "use a layout that fits the cluster")
    if pp > model.num_layers:
        raise ConfigError("--pp", f"{pp} stages for {model.num_layers} layers", "use at most one stage per layer")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ConfigError("--virtual-stages", f"{virtual_stages} needs --schedule interleaved",
                          "pass --schedule interleaved, or drop --virtual-stages")
    if pp * virtual_stages > model.num_layers:
        raise ConfigError("--virtual-stages", f"pp*virtual_stages={pp * virtual_stages} chunks for "
                          f"{model.num_layers} layers", "every chunk needs at least one layer")
    for n in layers_per_stage or ():
        if not isinstance(n, int) or not 1 <= n <= model.num_layers:
            raise ConfigError("--layers-per-stage", f"{n} is not a layer count between 1 and {model.num_layers}",
                              "fix the split")


def _score_fixed_levels(evaluator: Evaluator, layout, mbs, seq, schedule, v, levels) -> GroupResult:
    """Balanced split for levels the user fixed (no per-stage hard rule: their choice stands)."""
    per_layer, fixed, t_layer, edge_t, _ = evaluator.split_inputs(layout, mbs, seq, v, levels)
    min_layers = v if schedule == "interleaved" else 1
    max_layers = np.floor((evaluator.usable(layout) - fixed) / per_layer)
    layers, _ = balance_layers(t_layer, edge_t, max_layers, evaluator.model.num_layers, min_layers)
    return evaluator.score(layout, mbs, seq, schedule, v, levels, layers)
