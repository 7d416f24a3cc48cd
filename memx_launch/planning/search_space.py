"""What a search may vary (:class:`SearchSpace`) and the command-line flags that restrict it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.objective import DEFAULT_MAX_SLOWDOWN
from memx_launch.specs.checks import list_of
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.tp_split import splits_over_tp, tp_units


# Command-line restrictions of the space (memx plan and memx-run): flag, SearchSpace field,
# element type, what the values are.
RESTRICTIONS = (("tp", "tp_degrees", int, "TP degrees"), ("pp", "pipeline_degrees", int, "pipeline degrees"),
                ("micro_batch_sizes", "micro_batch_sizes", int, "micro-batch sizes (default 1,2,4,8)"),
                ("schedules", "schedules", str, "schedules: 1f1b,interleaved"),
                ("recompute_levels", "recompute_levels", str, "recompute levels: none,selective,full"))


def add_restriction_args(parser) -> None:
    """``--tp``, ``--pp``, ``--micro-batch-sizes``, ``--schedules``, ``--recompute-levels``."""
    for flag, _, kind, what in RESTRICTIONS:
        parser.add_argument("--" + flag.replace("_", "-"), type=list_of(kind), metavar="A,B",
                            help=f"search only these {what}")


def restrictions_from_args(args) -> dict:
    """The SearchSpace fields the restriction flags gave (tuples)."""
    return {field: tuple(getattr(args, flag)) for flag, field, _, _ in RESTRICTIONS
            if getattr(args, flag, None) is not None}


@dataclass
class SearchSpace:
    """What may vary. ``None`` means derived from the model, cluster and training spec."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    seq_lens: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    pipeline_degrees: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    virtual_stages: tuple[int, ...] = (2, 4)
    recompute_levels: tuple[str, ...] = cm.RECOMPUTE_LEVELS
    time_prune_factor: float = 2.0
    """Skip a group whose iteration-time lower bound exceeds this multiple of the best time."""
    memory_headroom: float = 0.0
    """Share of every device's memory a plan must leave free (memx-run: the monitor's threshold)."""
    fewer_microbatches_than_stages: bool = True
    """Allow G < P micro-batches per iteration: Megatron-LM runs it (the pipeline never fills);
    torch's Schedule1F1B refuses it, so memx-run's own searches turn it off."""
    recompute_some_layers: bool = True
    """Where a stage needs full recompute, recompute only as many of its first layers as it
    needs to fit (``full:K``, Megatron's block method, 1F1B only)."""
    per_type_tp: bool = False
    """On clusters of several device types, let each type take its own TP degree (one DP degree
    for all stages; ``memx plan --per-type-tp``). Off by default: it multiplies the layouts by
    up to (TP degrees)^(types - 1), and memx-run's runtime runs one degree for all stages."""
    per_type_dp: bool = False
    """On clusters of several device types, let each type take its own DP degree, each dividing
    the largest (``memx plan --per-type-dp``): a type of fewer replicas runs larger local
    micro-batches. Off by default: it multiplies the layouts, and memx-run's runtime runs one DP
    degree for all stages."""
    mixed_stages: bool = False
    """Also layouts whose stage at a boundary between device types takes its DP replicas from
    both (Sailor's plans; ``memx plan --mixed-stages``): where tp x dp divides the world but not
    every type's count. The slowest type sets such a stage's pace and it must fit on each.
    memx-run's runtime runs one device type per stage."""
    cp_degrees: tuple[int, ...] | None = (1,)
    """Context-parallel degrees to try; None: those the sequence length suits
    (:func:`context_parallel.search_degrees`; ``memx plan``'s default, ``--cp`` restricts).
    memx-run's runtime runs no context parallelism, so its searches keep (1,)."""
    expert_degrees: tuple[int, ...] | None = None
    """Expert-parallel degrees a mixture of experts is searched at, each with the layouts it
    divides (``memx plan`` without ``--expert-parallel``: the powers of two dividing its experts,
    :func:`~memx_launch.planning.experts.search_degrees`). None: the training's ``expert_parallel``."""
    expert_tensor_degrees: tuple[int, ...] | None = None
    """Expert-tensor-parallel degrees tried with each expert-parallel one (``memx plan`` without
    ``--expert-tensor-parallel``: :func:`~memx_launch.planning.experts.search_tensor_degrees`).
    None: the training's ``expert_tensor_parallel``."""
    shard_degrees: tuple[int, ...] | None = None
    """Hybrid sharding's shard degrees tried besides the training's ``shard_degree`` (``memx plan
    --shard-degrees``), each with the layouts it divides. None: the training's only."""
    max_slowdown: float | None = None
    """The winner may be predicted at most this share slower than the fastest feasible plan
    (``--max-slowdown``). None: 5% (DEFAULT_MAX_SLOWDOWN) for the profile memx chooses; no bound
    for one given with ``objective`` or ``weights``, which keep the paper's Phi as it ranks."""

    def bound(self, objective, weights) -> float | None:
        """The slowdown the winner may have against the fastest plan (None: any)."""
        if self.max_slowdown is not None:
            return self.max_slowdown
        return DEFAULT_MAX_SLOWDOWN if objective is None and weights is None else None

    def searched_for(self, training) -> "SearchSpace":
        """The space a search of ``training`` walks: without the selective level where its policy
        recomputes the whole block (``block``: priced as full, which the search walks already)."""
        levels = tuple(level for level in self.recompute_levels if level != "selective")
        return replace(self, recompute_levels=levels) if training.selective_recompute == "block" and levels else self

    def check(self, model: ModelSpec) -> None:
        """Restrictions given on the command line (memx plan --tp/--pp/...) name their flag."""
        for flag, values, known in (("--schedules", self.schedules, ("1f1b", "interleaved")),
                                    ("--recompute-levels", self.recompute_levels, cm.RECOMPUTE_LEVELS)):
            if not values or set(values) - set(known):
                raise ConfigError(flag, f"expected some of {', '.join(known)}, got {','.join(values)!r}",
                                  f"e.g. {flag} {known[0]}")
        for flag, values in (("--tp", self.tp_degrees), ("--pp", self.pipeline_degrees),
                             ("--micro-batch-sizes", self.micro_batch_sizes), ("--shard-degrees", self.shard_degrees)):
            if values is not None and (not values or min(values) < 1):
                raise ConfigError(flag, f"expected positive integers, got {list(values)}", f"e.g. {flag} 1,2")
        if self.max_slowdown is not None and not 0 <= self.max_slowdown < math.inf:
            raise ConfigError("--max-slowdown", f"must be a share of 0 or more, got {self.max_slowdown}",
                              "e.g. --max-slowdown 5%")
        bad = [t for t in self.tp_degrees or () if not splits_over_tp(model, t)]
        if bad:
            raise ConfigError("--tp", f"{bad[0]} does not divide the model's {tp_units(model)}", "use a divisor of each")
