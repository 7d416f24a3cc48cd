"""The plan: what memx decided, as a versioned JSON file every other part reads.

Rank layout inside a stage: ``stage.ranks[j]`` has data-parallel index ``j // tp`` and
tensor-parallel index ``j % tp`` (TP groups are consecutive ranks), ``tp`` the stage's degree.
A plan whose stages differ in TP degree has ``tp`` null and ``stage_tp`` one degree per stage
(memx estimate states such layouts; memx-run and the Megatron export refuse them). A stage
whose DP replicas sit on several device types names them ``a+b`` (``a*3+b*1`` when uneven).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number
from memx_launch.specs.inputs import load_json
from memx_launch.specs.model import MAX_DIMENSION, ModelSpec
from memx_launch.specs.training import PLAN_TRAINING_KEYS
from memx_launch.files import write_json_atomic
from memx_launch.planning.plan_file_checks import check_plan_types


PLAN_VERSION = 1
PLAN_KEYS = ("version", "model", "cluster", "world_size", "tp", "stage_tp", "pp", "cp", "dp", "stage_dp", "micro_batch_size",
             "global_batch_size", "seq_len", "schedule", "virtual_stages", "stages", "predicted_iteration_time_s",
             "predicted_peak_memory_fraction", "predicted_memory_variance", "objective", "emulated", "training",
             "crossings", "model_spec")
"""A plan file's keys, in the order memx writes them; any other key is refused."""


SCHEDULES = ("1f1b", "interleaved")


RECOMPUTE_LEVELS = ("none", "selective", "full")
NONE, SELECTIVE, FULL = range(3)  # the levels' codes in the cost model's arrays


def parse_recompute(text: str, num_layers: int, field: str = "--recompute") -> tuple[str, int, int]:
    """A stage's recompute: a level for all its layers; ``full:K``, full recompute of its first
    K layers and none for the rest (Megatron-LM's ``--recompute-method block
    --recompute-num-layers K``); or ``full:everyN``, full recompute of every N-th layer, the N-th,
    2N-th, ... (torchtitan's layer checkpointing, ``selective_ac_option = "N"``). Returns (level,
    layers recomputing at that level, N or 0 where they are the first ones)."""
    level, _, count = str(text).partition(":")
    if level not in RECOMPUTE_LEVELS:
        raise ConfigError(field, f"unknown level {text!r}",
                          f"use one of {', '.join(RECOMPUTE_LEVELS)}, full:K or full:everyN")
    if not count:
        return level, num_layers, 0
    period = count.removeprefix("every")
    number = int(period) if period.isascii() and period.isdigit() else -1
    if level != "full" or number < 0 or (number > num_layers if period == count else number < 1):
        raise ConfigError(field, f"{text!r} is neither full:K with 0 <= K <= the stage's {num_layers} layers nor "
                          "full:everyN with N >= 1", "give full:K, the number of the stage's first layers that "
                          "recompute fully, or full:everyN to recompute every N-th layer")
    recomputed, every = (num_layers // number, number) if period != count else (number, 0)
    if recomputed == num_layers:
        return "full", num_layers, 0
    return ("full", recomputed, every) if recomputed else ("none", num_layers, 0)


def recompute_text(level: str, count: int, num_layers: int, every: int = 0) -> str:
    """What :func:`parse_recompute` reads back as (level, count, every): the level when every
    layer recomputes at it, ``none`` for none, else ``full:K`` for the first K or ``full:everyN``."""
    if count >= num_layers:
        return level
    if not count:
        return "none"
    return f"full:every{every}" if every else f"full:{count}"


def short_stages(layers, virtual_stages: int) -> list[int]:
    """The stages holding fewer layers than their ``virtual_stages`` chunks need. The first or the
    last of several stages may hold one layer less: a chunk of the embedding alone, or of the
    head alone (Megatron's layouts ``E|...`` and ``...|L``; not interleaved: a stage of its own)."""
    ends = (0, len(layers) - 1) if len(layers) > 1 else ()
    return [i for i, n in enumerate(layers) if n < virtual_stages and not (n == virtual_stages - 1 and i in ends)]


def check_stage_dp_split(stage_dp, dp: int, micro_batch_size: int, field: str) -> None:
    """Every stage's replicas must split a pipeline micro-batch of ``dp x micro_batch_size``
    sequences evenly (a DP degree per stage)."""
    short = [d for d in stage_dp if dp * micro_batch_size % d]
    if short:
        raise ConfigError(field, f"{short[0]} replicas cannot split a pipeline micro-batch of "
                          f"dp*micro_batch_size={dp * micro_batch_size} sequences", "give DP degrees that divide it")


def layer_recompute_levels(text: str, num_layers: int) -> list[str]:
    """The level of each of a stage's layers: ``full:K`` is full for the first K, none after;
    ``full:everyN`` full for the N-th, 2N-th, ... (counted from 1)."""
    level, count, every = parse_recompute(text, num_layers)
    if every:
        return ["full" if (i + 1) % every == 0 else "none" for i in range(num_layers)]
    return [level] * count + ["none"] * (num_layers - count)


@dataclass
class StagePlan:
    device_type: str
    ranks: list[int]
    num_layers: int
    recompute: str
    predicted_peak_memory_gib: float
    predicted_stage_time_s: float
    """One micro-batch, forward plus backward, recompute included."""
    memory_capacity_gib: float = 0.0
    memory_parts_gib: dict[str, float] | None = None
    """``memx estimate``: the peak by part (parameters, gradients, optimizer_states, activations,
    logits_loss, pipeline_buffers, communicator_buffers, fixed_overhead), adding up to it;
    None (and absent from the file) where not computed."""
    send_parts: int = 1
    """The parts each of its sends to the next stage (the last stage's: interleaving's wrap-around)
    is split into, one per TP rank, which the next stage all-gathers (planning/pipeline_sends.py,
    as memx-run sends them); 1 (absent from the file): whole."""


@dataclass
class Crossing:
    """Traffic of one training step that crosses communication domains, over the bridge."""

    kind: str
    """``pipeline`` (a stage's transfers to the next, both directions), ``data_parallel``
    (a stage's gradient sync) or ``tied_embeddings`` (the first and last stage's sum of the
    gradients of the weight they share)."""
    stages: list[int]
    """The edge's two stages, the DP group's stage, or the first and the last stage."""
    domains: list[str]
    bytes_per_step: float
    """Bytes one rank sends over the bridge per step (a pipeline edge's: one direction's, the
    forward's sender its activations, the other its gradients; a bridge all-reduce of M bytes
    among D ranks: 2(D-1)/D x M)."""
    seconds_per_step: float
    """Pipeline: the edge's transfers of one step, staging and latency included; data
    parallel: the stage's whole hierarchical sync."""
    shard_ranks: int | None = None
    """A DP group a fully sharded plan shards within its domains: the ranks of each shard group
    (planning/hybrid_sharding.py; 1: its states whole). None: its gradients averaged whole."""
    senders: int | None = None
    """The ranks that each send ``bytes_per_step`` (None in plans written before memx counted them)."""

    @property
    def what(self) -> str:
        """What crosses, in words: a pipeline edge, a stage's DP sync or the tied embeddings' sum."""
        if self.kind == "data_parallel":
            return f"DP sync of stage {self.stages[0]}"
        if self.kind == "pipeline":
            return f"pipeline stage {self.stages[0]} -> {self.stages[1]}"
        return f"tied embeddings of stages {self.stages[0]} and {self.stages[1]}"


@dataclass
class Objective:
    phi: float
    profile: str
    weights: tuple[float, float, float]
    terms: dict[str, float] = field(default_factory=dict)
    """Normalised T, M and V of this plan (each divided by its reference)."""


@dataclass
class Plan:
    model: str
    model_spec: ModelSpec
    cluster: str
    tp: int | None
    """The TP degree of every stage; None when they differ (``stage_tp``)."""
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    seq_len: int
    schedule: str
    virtual_stages: int
    stages: list[StagePlan]
    predicted_iteration_time_s: float
    objective: Objective
    predicted_peak_memory_fraction: float = 0.0
    predicted_memory_variance: float = 0.0
    emulated: bool = False
    training: dict = field(default_factory=dict)
    """dtype, optimizer and data-parallel sharding the predictions assumed."""
    version: int = PLAN_VERSION
    stage_tp: list[int] | None = None
    """One TP degree per stage when they differ (``tp`` is then None); None: every stage at ``tp``."""
    crossings: list[Crossing] = field(default_factory=list)
    """Pipeline edges and DP groups that cross communication domains (empty on one domain)."""
    cp: int = 1
    """Context-parallel degree: a DP replica of a stage is ``cp`` TP groups, each holding 1/cp of
    every sequence (``planning/context_parallel.py``)."""
    stage_dp: list[int] | None = None
    """One DP degree per stage where they differ (``dp`` is then the largest: a pipeline
    micro-batch is ``dp x micro_batch_size`` sequences on every stage, a stage of fewer replicas
    runs larger local micro-batches); None: every stage at ``dp``."""

    # ---- derived
    @property
    def stage_tps(self) -> list[int]:
        """The TP degree of each stage."""
        return list(self.stage_tp) if self.stage_tp is not None else [self.tp] * self.pp

    @property
    def stage_dps(self) -> list[int]:
        """The DP degree of each stage."""
        return list(self.stage_dp) if self.stage_dp is not None else [self.dp] * self.pp

    def uniform_tp(self, consumer: str) -> int:
        """The one TP degree of every stage; a one-line refusal naming ``consumer`` otherwise."""
        return _uniform("tp", self.tp, self.stage_tp, consumer)

    def uniform_dp(self, consumer: str) -> int:
        """The one DP degree of every stage; a one-line refusal naming ``consumer`` otherwise."""
        return _uniform("dp", self.dp, self.stage_dp, consumer)

    def within_one_domain(self, consumer: str) -> None:
        """A one-line refusal naming ``consumer`` where the plan crosses communication domains:
        another framework's groups run on one collective library (NCCL or RCCL, not both), and
        only memx's runtime carries what crosses between them (its bridge)."""
        if not self.crossings:
            return
        what = [c.what for c in self.crossings]
        what = ", ".join(what[:-1]) + " and " + what[-1] + " span" if len(what) > 1 else what[0] + " spans"
        domains = ", ".join(sorted({d for c in self.crossings for d in c.domains}))
        raise ConfigError("plan.crossings", f"{what} communication domains ({domains}), and {consumer} runs "
                          "each group on one collective library", "run this plan with memx-run --plan, whose "
                          "bridge carries what crosses, or plan on one domain's devices (a cluster file of one "
                          "vendor's nodes)")

    @property
    def bridge_bytes_per_step(self) -> float | None:
        """The bytes all ranks send over the bridge per step, as planned (None: nothing crosses,
        or a crossing does not count its senders)."""
        if not self.crossings or any(c.senders is None for c in self.crossings):
            return None
        return sum(c.bytes_per_step * c.senders for c in self.crossings)

    @property
    def world_size(self) -> int:
        return sum(t * d for t, d in zip(self.stage_tps, self.stage_dps)) * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def stage_of_rank(self, rank: int) -> tuple[int, int, int]:
        """(stage index, data-parallel index, tensor-parallel index) of a global rank (a plan
        without context parallelism: memx's runtime runs none)."""
        for i, stage in enumerate(self.stages):
            if rank in stage.ranks:
                j = stage.ranks.index(rank)
                tp = self.stage_tps[i]
                return i, j // tp, j % tp
        raise ConfigError("plan.stages", f"rank {rank} is in no stage",
                          f"the plan covers ranks 0..{self.world_size - 1}")

    # ---- (de)serialisation
    def to_dict(self) -> dict:
        data = asdict(self)
        data["model_spec"] = self.model_spec.to_dict()
        data["objective"]["weights"] = list(self.objective.weights)
        data["world_size"] = self.world_size
        for stage in data["stages"]:
            if stage["memory_parts_gib"] is None:
                del stage["memory_parts_gib"]
            if stage["send_parts"] == 1:
                del stage["send_parts"]
        return {k: data[k] for k in PLAN_KEYS}

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise ConfigError(source, "not a plan object", "pass a file written by memx plan --json")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise ConfigError(f"{source}.version", f"expected {PLAN_VERSION}, got {version!r}",
                              "re-create the plan with this memx version")
        unknown = [k for k in data if k not in PLAN_KEYS]
        if unknown:
            raise ConfigError(f"{source}.{unknown[0]}", "unknown key", "pass a plan written by memx plan --json")
        check_plan_types(data, source)
        try:
            stages = [StagePlan(**s) for s in data["stages"]]
            objective = dict(data["objective"])
            objective["weights"] = tuple(objective["weights"])
            plan = cls(
                model=data["model"], model_spec=ModelSpec.from_dict(data["model_spec"]),
                cluster=data["cluster"], tp=data["tp"], pp=data["pp"], dp=data["dp"],
                micro_batch_size=data["micro_batch_size"], global_batch_size=data["global_batch_size"],
                seq_len=data["seq_len"], schedule=data["schedule"],
                virtual_stages=data["virtual_stages"], stages=stages,
                predicted_iteration_time_s=data["predicted_iteration_time_s"],
                objective=Objective(**objective),
                predicted_peak_memory_fraction=data.get("predicted_peak_memory_fraction", 0.0),
                predicted_memory_variance=data.get("predicted_memory_variance", 0.0),
                emulated=data.get("emulated", False), training=dict(data.get("training", {})),
                version=version, stage_tp=data.get("stage_tp"),
                crossings=[Crossing(**c) for c in data.get("crossings", [])], cp=data.get("cp", 1),
                stage_dp=data.get("stage_dp"))
        except KeyError as exc:
            raise ConfigError(f"{source}.{exc.args[0]}", "missing",
                              "pass a complete plan written by memx plan --json") from None
        except TypeError as exc:
            raise ConfigError(source, f"malformed ({exc})", "pass a plan written by memx plan --json") from None
        unknown = set(plan.training) - set(PLAN_TRAINING_KEYS)
        if unknown:
            raise ConfigError(f"{source}.training.{sorted(unknown)[0]}", "unknown key",
                              f"use {', '.join(PLAN_TRAINING_KEYS)}")
        plan.validate(source)
        if "world_size" in data and data["world_size"] != plan.world_size:
            raise ConfigError(f"{source}.world_size", f"{data['world_size']!r}, but its layout (tp x pp x cp x dp) has "
                              f"{plan.world_size} ranks", "correct world_size, or the layout")
        return plan

    def validate(self, source: str = "plan") -> None:
        for key in ("pp", "cp", "dp", "micro_batch_size", "global_batch_size", "seq_len", "virtual_stages"):
            require_number(getattr(self, key), f"{source}.{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        if self.stage_tp is None:
            require_number(self.tp, f"{source}.tp", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        else:
            if self.tp is not None:
                raise ConfigError(f"{source}.tp", "given with stage_tp", "tp is null when the stages' degrees differ")
            if not isinstance(self.stage_tp, list) or len(self.stage_tp) != self.pp:
                raise ConfigError(f"{source}.stage_tp", f"must list one TP degree for each of pp={self.pp} stages")
            for t in self.stage_tp:
                require_number(t, f"{source}.stage_tp", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
            if len(set(self.stage_tp)) == 1:
                raise ConfigError(f"{source}.stage_tp", "every stage has the same degree",
                                  f"give tp: {self.stage_tp[0]} and no stage_tp")
        if self.stage_dp is not None:
            if not isinstance(self.stage_dp, list) or len(self.stage_dp) != self.pp:
                raise ConfigError(f"{source}.stage_dp", f"must list one DP degree for each of pp={self.pp} stages")
            for d in self.stage_dp:
                require_number(d, f"{source}.stage_dp", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
            if len(set(self.stage_dp)) == 1 or max(self.stage_dp) != self.dp:
                raise ConfigError(f"{source}.stage_dp", f"{self.stage_dp} with dp={self.dp}",
                                  "give degrees that differ, the largest as dp; or dp alone")
            check_stage_dp_split(self.stage_dp, self.dp, self.micro_batch_size, f"{source}.stage_dp")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"{source}.schedule", f"unknown schedule {self.schedule!r}",
                              f"use one of {', '.join(SCHEDULES)}")
        if len(self.stages) != self.pp:
            raise ConfigError(f"{source}.stages", f"{len(self.stages)} stages but pp={self.pp}")
        if sum(s.num_layers for s in self.stages) != self.model_spec.num_layers:
            raise ConfigError(f"{source}.stages", "layer counts do not add up to the model's "
                              f"{self.model_spec.num_layers} layers")
        seen = sorted(r for s in self.stages for r in s.ranks)
        if seen != list(range(self.world_size)):
            raise ConfigError(f"{source}.stages", "ranks must cover 0..world_size-1 exactly once")
        for i, s in enumerate(self.stages):
            parse_recompute(s.recompute, s.num_layers, f"{source}.stages[{i}].recompute")
            tp, dp = self.stage_tps[i], self.stage_dps[i]
            if len(s.ranks) != tp * self.cp * dp:
                raise ConfigError(f"{source}.stages[{i}].ranks", f"needs tp*cp*dp={tp * self.cp * dp} ranks")
            if len(set(s.ranks)) != len(s.ranks):
                raise ConfigError(f"{source}.stages[{i}].ranks", "lists a rank twice")
            if s.send_parts != 1 and (s.send_parts != tp or self.stage_tps[(i + 1) % self.pp] != tp):
                raise ConfigError(f"{source}.stages[{i}].send_parts", f"{s.send_parts} parts at TP {tp}, the next "
                                  f"stage at TP {self.stage_tps[(i + 1) % self.pp]}", "give 1 (whole), or the "
                                  "stage's TP degree where the next stage has the same")
        short = short_stages([s.num_layers for s in self.stages], self.virtual_stages)
        if short:
            i, n = short[0], self.stages[short[0]].num_layers
            raise ConfigError(f"{source}.stages[{i}].num_layers",
                              f"{n} layers cannot form {self.virtual_stages} virtual stages"
                              + (" (only the first or last of several stages may hold one layer less)"
                                 if n == self.virtual_stages - 1 else ""))
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ConfigError(f"{source}.global_batch_size", f"{self.global_batch_size} is not divisible by "
                              f"dp*micro_batch_size={self.dp * self.micro_batch_size}")

    def save(self, path: str, overwrite: bool = False, flag: str = "plan") -> None:
        write_json_atomic(path, self.to_dict(), overwrite=overwrite, flag=flag)

    @classmethod
    def load(cls, path: str) -> "Plan":
        data = load_json(path, "--plan", fix="pass a plan written by memx plan --json")
        return cls.from_dict(data, source=f"plan {path}")


def _uniform(name: str, degree, per_stage, consumer: str):
    """``degree`` where no per-stage degrees are given; else a one-line refusal naming ``consumer``."""
    if per_stage is not None:
        raise ConfigError(f"plan.stage_{name}", f"stages have different {name.upper()} degrees {per_stage}, which "
                          f"{consumer} cannot run", f"plan or estimate one {name.upper()} degree for every stage "
                          f"(--{name})")
    return degree
