"""Predicting one given layout (``memx estimate``): the split and recompute levels the user fixed.

The split is never re-balanced: a layout without one gets an even split (the remainder on the
first stages), as Megatron-LM's ``--num-layers`` divided by the pipeline degree would give.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from memx_launch.planning import context_parallel, costmodel as cm, experts, hybrid_sharding, mamba
from memx_launch.errors import ConfigError
from memx_launch.planning.plan import (RECOMPUTE_LEVELS, Objective, Plan, check_stage_dp_split, layer_recompute_levels,
                                       parse_recompute, short_stages)
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec
from memx_launch.planning.layouts import Layout, layout_from_stage_devices, stage_device_types
from memx_launch.planning.layout_training import cost_model_of_training, layout_sharded_stages
from memx_launch.planning.mixed_sharding import MixedShardingEvaluator
from memx_launch.planning.objective import WEIGHT_PROFILES, objective_for
from memx_launch.planning.cost_table import CostTable
from memx_launch.planning.extra_blocks import first_stage_min_layers
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.scoring import Evaluator
from memx_launch.planning.scored_plan import to_plan
from memx_launch.planning.search import default_references
from memx_launch.specs.tp_split import splits_over_tp, tp_units

# Micro-batch sizes a scorer's first cost table prices beside those asked: a cases file's rows
# ask a few of them, and one cost-model call prices many as fast as one.
USUAL_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def recompute_rows(recompute, layers: np.ndarray, field: str = "--recompute") -> tuple[np.ndarray, ...]:
    """Per stage of ``layers`` (1, P): the level index, how many of its layers recompute at it
    (the rest: none) and every how many layers they do (0: the first ones), from one recompute
    text for all stages or one per stage."""
    pp = layers.shape[1]
    if recompute is None:
        recompute = ["none"]
    if isinstance(recompute, str):
        recompute = recompute.split(",")
    if len(recompute) == 1:
        recompute = list(recompute) * pp
    if len(recompute) != pp:
        raise ConfigError(field, f"{len(recompute)} levels for pp={pp}", "give one level, or one per stage")
    parsed = [parse_recompute(text, int(n), field) for text, n in zip(recompute, layers[0])]
    return (np.array([[cm.RECOMPUTE_LEVELS.index(level) for level, _, _ in parsed]]),
            np.array([[k for _, k, _ in parsed]], dtype=np.int64), np.array([[n for *_, n in parsed]], dtype=np.int64))


class LayoutScorer:
    """Scores given layouts of one model, cluster and training on one cost model, keeping what
    layouts share: one cost table per CP degree (every TP degree the model's heads allow on the
    cluster, every micro-batch size asked and :data:`USUAL_MICRO_BATCH_SIZES`) and each parsed
    layout (``memx estimate --cases`` asks thousands of layouts of a few setups). ``layouts``: a
    cache of parsed layouts to share with the scorers of other setups on the same cluster."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 cost_model: cm.LayerCostModel | None = None, memory_headroom: float = 0.0,
                 layouts: dict | None = None):
        self.model, self.cluster, self.training = model, cluster, training
        self.cost_model = cost_model or cm.AnalyticalCostModel(model, cluster, training)
        self.memory_headroom = memory_headroom
        self._evaluators: dict[tuple, Evaluator] = {}  # by CP degree, and whether layout_training shards (or "mixed")
        self._cost_models = {False: self.cost_model}  # by whether layout_training shards
        self._layouts: dict[tuple, Layout] = {} if layouts is None else layouts
        self._degrees = [t for t in range(1, min(model.num_heads, cluster.world_size) + 1) if splits_over_tp(model, t)]

    def _evaluator(self, cp: int, sharded: bool, local_mbss: set[int]) -> Evaluator:
        """The evaluator of the training (fully sharded or as given) at CP degree ``cp``, its table
        holding the local micro-batch sizes ``local_mbss``."""
        model, cluster, training = self.model, self.cluster, self.training
        evaluator = self._evaluators.get((cp, sharded))
        if evaluator is None or not local_mbss <= set(evaluator.table.mbss):
            runs = dataclasses.replace(training, fully_sharded=True) if sharded else training
            if sharded not in self._cost_models:
                self._cost_models[sharded] = cost_model_of_training(self.cost_model, model, cluster, runs)
            # Per-layer costs are element-wise, so a wider table holds the same numbers: one table
            # (one cost-model call) for every micro-batch size asked so far and the usual ones.
            wanted = local_mbss | set(evaluator.table.mbss if evaluator else USUAL_MICRO_BATCH_SIZES)
            costs = self._cost_models[sharded]
            table = CostTable(costs, len(costs.device_names), self._degrees, sorted(wanted), [training.seq_len // cp])
            evaluator = Evaluator(model, cluster, runs, costs, table, self.memory_headroom)
            self._evaluators[cp, sharded] = evaluator
        return evaluator

    def _mixed(self, cp: int, whole: Evaluator, sharded: Evaluator) -> MixedShardingEvaluator:
        """The evaluator of layouts of both kinds of stage over ``whole`` and ``sharded``, kept
        while they are the CP degree's evaluators (rows of ``--cases`` share it)."""
        mixed = self._evaluators.get((cp, "mixed"))
        if mixed is None or mixed.whole is not whole or mixed.sharded is not sharded:
            mixed = self._evaluators[cp, "mixed"] = MixedShardingEvaluator(whole, sharded)
        return mixed

    def score(self, *, tp: int | None, pp: int, dp: int | None, micro_batch_size: int, layers_per_stage=None,
              recompute=None, stage_devices=None, schedule: str = "1f1b", virtual_stages: int = 1,
              stage_tp=None, cp: int = 1, stage_dp=None, send_parts=None) -> tuple[GroupResult, Evaluator]:
        """The layout scored as one row, and the evaluator that scored it (see
        :func:`evaluate_layout` for the arguments)."""
        model, cluster, training = self.model, self.cluster, self.training
        if schedule not in ("1f1b", "interleaved"):
            raise ConfigError("--schedule", f"unknown schedule {schedule!r}", "use 1f1b or interleaved")
        stage_tps = _stage_degrees("tp", tp, stage_tp, pp, lambda d: d[0] if len(set(d)) == 1 else None)
        context_parallel.check_degree(cp, training.seq_len, training.flash_attention)
        stage_dps = _stage_degrees("dp", dp, stage_dp, pp, max)
        _check_layout_numbers(model, stage_tps, pp, stage_dps, micro_batch_size, schedule, virtual_stages,
                              layers_per_stage)
        experts.check(model, training, [t * cp * d for t, d in zip(stage_tps, stage_dps)])
        mamba.check(model, training, (cp,))
        dp = max(stage_dps)
        v = virtual_stages if schedule == "interleaved" else 1
        if training.global_batch_size % (dp * micro_batch_size):
            raise ConfigError("--global-batch-size", f"{training.global_batch_size} is not divisible by "
                              f"dp*micro_batch_size={dp * micro_batch_size}", "choose a multiple of dp*micro_batch_size")
        g = training.global_batch_size // (dp * micro_batch_size)
        if v > 1 and g % pp:  # as in the search: the interleaved time model needs whole rounds of pp micro-batches
            raise ConfigError("--global-batch-size", f"{g} micro-batches for the interleaved schedule on pp={pp}",
                              "interleaving needs a multiple of pp micro-batches (Megatron-LM's rule); or use 1f1b")
        degrees = tuple(sorted(set(stage_tps)))
        for t in degrees:
            if not splits_over_tp(model, t):
                raise ConfigError("--tp" if stage_tp is None else "--stage-tp", f"{t} does not divide the model's "
                                  f"{tp_units(model)}", "use a divisor of each")
        tp_arg = stage_tps[0] if len(degrees) == 1 else tuple(stage_tps)
        names = tuple(self.cost_model.device_names)
        dp_arg = dp if len(set(stage_dps)) == 1 else tuple(stage_dps)
        key = (names, tp_arg, pp, cp, dp_arg, None if stage_devices is None else tuple(stage_devices))
        if key not in self._layouts:
            self._layouts[key] = layout_from_stage_devices(model, cluster, names, tp_arg, pp, dp_arg, stage_devices, cp)
        layout = self._layouts[key]
        hybrid_sharding.check_layout(cluster, layout, training)
        # Priced as it runs: memx-run's stages with TP > 1 and DP > 1 fully sharded (layout_training.py).
        stages = layout_sharded_stages(training, layout)
        local_mbss = {int(m) for m in np.atleast_1d(layout.local_micro_batch(micro_batch_size))}
        evaluator = self._evaluator(cp, bool(stages.any()), local_mbss)
        if stages.any() and not stages.all():
            evaluator = self._mixed(cp, self._evaluator(cp, False, local_mbss), evaluator)
        if layers_per_stage is None:
            if model.num_layers < pp * v:
                raise ConfigError("--pp", f"{model.num_layers} layers cannot give pp={pp} stages {v} layer(s) each",
                                  "use fewer stages")
            layers_per_stage = even_split(model.num_layers, pp)
        layers = np.array([list(layers_per_stage)], dtype=np.int64)
        if layers.shape[1] != pp or layers.sum() != model.num_layers or short_stages(layers[0], v):
            raise ConfigError("--layers-per-stage", f"{list(layers_per_stage)} must give pp={pp} stages of at "
                              f"least {v} layer(s) adding up to {model.num_layers} (the first or last of several "
                              "may hold one less)", "fix the split")
        first_fewest = first_stage_min_layers(model, v)
        if layers[0, 0] < first_fewest:
            raise ConfigError("--layers-per-stage", f"{list(layers_per_stage)} puts {layers[0, 0]} layers on the "
                              f"first stage; the model's {model.dense_layers} dense first blocks go in its first chunk",
                              f"give the first stage at least {first_fewest} layers")
        offloaded = training.activation_offload_layers
        if offloaded and layers.min() <= offloaded:
            raise ConfigError("--activation-offload-layers", f"{offloaded}, but a stage of the split "
                              f"{list(layers_per_stage)} holds {layers.min()} layers (its last keeps its activations)",
                              f"offload at most {max(layers.min() - 1, 0)} layers per stage")
        levels, recompute_layers, every = recompute_rows(recompute, layers)
        partial = recompute_layers < layers
        evaluator.send_in(send_parts)  # evaluators are kept across rows: set (or reset) on each
        result = evaluator.score(layout, micro_batch_size, training.seq_len, schedule, v, levels, layers,
                                 recompute_layers if partial.any() else None, every if every.any() else None)
        return result, evaluator


def layout_objective(result: GroupResult, references, weights=None) -> Objective:
    """Phi of a scored layout (row 0) against ``references``, with ``weights`` or the default profile's."""
    profile = "custom" if weights is not None else "default"
    chosen = tuple(weights) if weights is not None else WEIGHT_PROFILES["default"]
    return objective_for(result.T[0], result.M[0], result.V[0], references, profile, chosen)


def evaluate_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, tp: int | None, pp: int,
                    dp: int | None, micro_batch_size: int, layers_per_stage=None, recompute=None,
                    stage_devices=None, schedule: str = "1f1b", virtual_stages: int = 1,
                    cost_model: cm.LayerCostModel | None = None, weights=None,
                    references: tuple[float, float, float] | None = None,
                    memory_headroom: float = 0.0, stage_tp=None, cp: int = 1, stage_dp=None, send_parts=None) -> Plan:
    """Predict one given layout (``memx estimate``). The plan may not fit: its stages then
    show predicted memory above capacity (less ``memory_headroom``, see :func:`stage_short_gib`).
    ``stage_tp``: one TP degree per stage instead of ``tp`` for all (the DP degree is every
    stage's). ``stage_dp``: one DP degree per stage instead of ``dp`` (a pipeline micro-batch is
    the largest degree x ``micro_batch_size`` sequences, split over each stage's replicas).
    ``cp``: the context-parallel degree (each DP replica is ``cp`` TP groups).
    ``stage_devices``: a device type per stage, or several joined by ``+`` for a
    stage whose replicas sit on several (:func:`~memx_launch.planning.layouts.parse_stage_devices`).
    No ``layers_per_stage``: an :func:`even_split`. Fewer micro-batches than stages is allowed
    (Megatron-LM runs it; 1F1B then fills the pipeline only partly). Phi uses ``references``
    (T, M, V medians) when given, else those of a default search of the same model, cluster and
    training spec. Each stage carries its memory by part (``memory_parts_gib``). ``send_parts``: the
    parts each stage's pipeline sends are priced in (a plan file's), instead of chosen."""
    scorer = LayoutScorer(model, cluster, training, cost_model, memory_headroom)
    result, evaluator = scorer.score(tp=tp, stage_tp=stage_tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size,
                                     layers_per_stage=layers_per_stage, recompute=recompute,
                                     stage_devices=stage_devices, schedule=schedule, virtual_stages=virtual_stages,
                                     cp=cp, stage_dp=stage_dp, send_parts=send_parts)
    if references is None:
        references = default_references(model, cluster, training, scorer.cost_model)
    plan = to_plan(result, 0, model, cluster, training, layout_objective(result, references, weights))
    for stage, parts in zip(plan.stages, evaluator.memory_parts(result)):
        stage.memory_parts_gib = {name: nbytes / cm.GIB for name, nbytes in parts.items()}
    return plan


def plan_training(plan: Plan) -> TrainingSpec:
    """The training spec a plan file was made for."""
    return TrainingSpec(global_batch_size=plan.global_batch_size, seq_len=plan.seq_len, **plan.training)


def evaluate_plan(handed: Plan, cluster: ClusterSpec, training: TrainingSpec, *, weights=None,
                  cost_model: cm.LayerCostModel | None = None, memory_headroom: float = 0.0) -> Plan:
    """A plan file predicted again (``memx estimate --plan``): its layout, split, levels and pipeline
    sends' parts (as memx-run sends them), its Phi references, and its weights unless ``weights``
    are given."""
    o = handed.objective
    references = tuple(o.terms[k] for k in ("T_ref", "M_ref", "V_ref")) if "T_ref" in o.terms else None
    plan = evaluate_layout(handed.model_spec, cluster, training, tp=handed.tp, stage_tp=handed.stage_tp,
                           pp=handed.pp, dp=handed.dp, cp=handed.cp, stage_dp=handed.stage_dp,
                           micro_batch_size=handed.micro_batch_size,
                           layers_per_stage=[s.num_layers for s in handed.stages],
                           recompute=[s.recompute for s in handed.stages],
                           stage_devices=[s.device_type for s in handed.stages], schedule=handed.schedule,
                           virtual_stages=handed.virtual_stages, weights=weights or o.weights,
                           references=references, cost_model=cost_model, memory_headroom=memory_headroom,
                           send_parts=[s.send_parts for s in handed.stages])
    plan.objective.profile = o.profile if weights is None else "custom"
    return plan


def even_split(num_layers: int, pp: int) -> list[int]:
    """``num_layers`` over ``pp`` stages as evenly as possible, the remainder on the first stages."""
    base, extra = divmod(num_layers, pp)
    return [base + (i < extra) for i in range(pp)]


@dataclass
class HostBound:
    """A stage whose layers the host issues slower than its device runs them (one layer's
    forward and backward; the first such layer's times)."""

    stage: int
    device_type: str
    layers: int
    host_s: float
    device_s: float


def host_bound_stages(plan: Plan, cluster: ClusterSpec) -> list[HostBound]:
    """The stages (and device types of each) whose layers the analytical model prices at the
    host's time to issue them (:mod:`host_time`) above the device's time to run them. Left out: a hybrid model's mean layer and context
    parallelism, whose ring adds device time per layer beside the layer priced here."""
    model, training = plan.model_spec, plan_training(plan)
    if model.layer_kinds or plan.cp > 1:
        return []
    priced = cm.AnalyticalCostModel(model, cluster, training)
    bound = []
    for i, (stage, tp, dp) in enumerate(zip(plan.stages, plan.stage_tps, plan.stage_dps)):
        levels = np.array([RECOMPUTE_LEVELS.index(level) for level in layer_recompute_levels(stage.recompute,
                                                                                             stage.num_layers)])
        mbs = plan.micro_batch_size * plan.dp // dp
        for name in stage_device_types(stage.device_type):
            query = (np.full(len(levels), priced.device_names.index(name)), np.full(len(levels), tp),
                     np.full(len(levels), mbs), np.full(len(levels), plan.seq_len), levels)
            host, device = priced.layer_host_seconds(query[0], levels), priced.layer_costs(*query, host=False).time_s
            over = np.flatnonzero(host > device)
            if over.size:
                bound.append(HostBound(i, name, int(over.size), float(host[over[0]]), float(device[over[0]])))
    return bound


def stage_short_gib(plan: Plan, memory_headroom: float = 0.0) -> list[float]:
    """Per stage, GiB over what the stage may use (capacity less the headroom); 0 where it fits."""
    return short_gib([s.predicted_peak_memory_gib for s in plan.stages],
                     [s.memory_capacity_gib for s in plan.stages], memory_headroom)


def short_gib(peaks_gib, capacities_gib, memory_headroom: float = 0.0) -> list[float]:
    """:func:`stage_short_gib` of per-stage peaks and capacities (GiB)."""
    return [max(0.0, peak - cap * (1.0 - memory_headroom)) for peak, cap in zip(peaks_gib, capacities_gib)]


def _stage_degrees(name: str, degree, per_stage, pp, stated) -> list:
    """One ``name`` (tp, dp) degree per stage, from ``degree`` or ``per_stage`` (checked as
    integers later); ``stated(per_stage)``: the one degree they amount to (a TP degree for all:
    each of them; DP: the largest)."""
    if per_stage is None:
        if degree is None:
            raise ConfigError(f"--{name}", "missing", f"give --{name}, or --stage-{name} with one degree per stage")
        return [degree] * pp if isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 else [degree]
    per_stage = list(per_stage)
    if len(per_stage) != pp:
        raise ConfigError(f"--stage-{name}", f"{len(per_stage)} degrees for pp={pp}",
                          f"give one {name.upper()} degree per stage")
    if degree is not None and degree != stated(per_stage):
        raise ConfigError(f"--{name}", f"{degree} does not agree with the per-stage degrees {per_stage}",
                          "give one of them")
    return per_stage


def _check_layout_numbers(model, stage_tps, pp, stage_dps, mbs, schedule, virtual_stages, layers_per_stage) -> None:
    """Integers in range before any array is built from them (the world size: by the layout,
    ``layouts.layout_from_stage_devices``)."""
    per_stage_dp = len(set(stage_dps)) > 1
    for flag, value in (*(("--stage-tp" if len(set(stage_tps)) > 1 else "--tp", t) for t in stage_tps),
                        *(("--stage-dp" if per_stage_dp else "--dp", d) for d in stage_dps),
                        ("--pp", pp), ("--micro-batch-size", mbs), ("--virtual-stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(flag, f"must be a positive integer, got {value!r}")
    if per_stage_dp:
        check_stage_dp_split(stage_dps, max(stage_dps), mbs, "--stage-dp")
    if pp > model.num_layers:
        raise ConfigError("--pp", f"{pp} stages for {model.num_layers} layers", "use at most one stage per layer")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ConfigError("--virtual-stages", f"{virtual_stages} needs --schedule interleaved",
                          "pass --schedule interleaved, or drop --virtual-stages")
    ends = 2 if pp > 1 else 0  # a chunk of the embedding alone, one of the head alone
    if pp * virtual_stages > model.num_layers + ends:
        raise ConfigError("--virtual-stages", f"pp*virtual_stages={pp * virtual_stages} chunks for "
                          f"{model.num_layers} layers", "every chunk but an embedding's or a head's needs a layer")
    for n in layers_per_stage or ():
        if not isinstance(n, int) or not 0 <= n <= model.num_layers:
            raise ConfigError("--layers-per-stage", f"{n} is not a layer count between 0 and {model.num_layers}",
                              "fix the split")
