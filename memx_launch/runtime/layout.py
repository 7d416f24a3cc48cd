"""Where a rank sits in a plan: its stage, its TP/DP/PP peers, and the layers of its model chunks.

Pure Python on the Plan, so it is testable without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from memx_launch.planning.plan import Plan
from memx_launch.planning.runtime_support import check_runnable


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual pipeline stage) held by a rank."""

    virtual_stage: int
    layer_offset: int
    num_layers: int
    first: bool
    last: bool


@dataclass(frozen=True)
class RankLayout:
    rank: int
    stage: int
    dp_index: int
    tp_index: int
    pp_ranks: tuple[int, ...]
    """This rank's lane of the pipeline: one rank per stage, same DP index, TP index modulo
    each stage's degree."""
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == len(self.pp_ranks) - 1


def mesh_ranks(plan: Plan) -> list[list[list[int]]]:
    """Plan (device) ranks as a [stage][dp][tp of that stage] grid (plan.py: stage.ranks[j] has
    dp j // tp, tp j % tp)."""
    return [[[stage.ranks[d * tp + t] for t in range(tp)] for d in range(plan.dp)]
            for stage, tp in zip(plan.stages, plan.stage_tps)]


def process_grid(plan: Plan) -> list[list[list[int]]]:
    """Process ranks as a [stage][dp][tp of that stage] grid: stage-major, as :func:`process_rank`."""
    grid, start = [], 0
    for tp in plan.stage_tps:
        grid.append([list(range(start + d * tp, start + (d + 1) * tp)) for d in range(plan.dp)])
        start += tp * plan.dp
    return grid


def process_rank(plan: Plan, rank: int) -> int:
    """The rank this device takes in the process group: stage-major (stage i, position j in its
    ranks -> the earlier stages' ranks + j). torch's pipeline schedules take a rank's place in
    the pipeline from its rank in the PP group, and groups number their ranks in ascending order,
    so the cluster file's device order (the plan's ranks) cannot be used directly when stages
    run on ranks out of order (e.g. stage 0 on ranks 2-3)."""
    stage, dp_index, tp_index = plan.stage_of_rank(rank)
    tps = plan.stage_tps
    return sum(tps[:stage]) * plan.dp + dp_index * tps[stage] + tp_index


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` groups, the first groups one larger when it does not divide."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def chunks_by_stage(plan: Plan) -> list[list[Chunk]]:
    """The chunks of every stage. With v virtual stages, stage i holds chunks c*P + i
    (c = 0..v-1, the loop order of ScheduleInterleaved1F1B), and the model's layers run
    through virtual stages in index order; stage i's layer count is split evenly over its v chunks."""
    p, v = plan.pp, plan.virtual_stages
    sizes = [split_evenly(stage.num_layers, v) for stage in plan.stages]
    out: list[list[Chunk]] = [[] for _ in range(p)]
    offset = 0
    for virtual in range(p * v):
        stage, c = virtual % p, virtual // p
        n = sizes[stage][c]
        out[stage].append(Chunk(virtual, offset, n, first=virtual == 0, last=virtual == p * v - 1))
        offset += n
    return out


def stage_runs_fully_sharded(plan: Plan, tp: int, dp_crosses_domains: bool, data_parallel: str = "auto") -> bool:
    """Whether a stage of TP degree ``tp`` runs FSDP2 over its replicas: with DP > 1 inside one
    domain, when asked (``data_parallel`` "fsdp"), when the plan is fully sharded, or with TP > 1,
    whose DTensor parameters DDP cannot hold. A DP group spanning domains (no library spans it)
    is sharded within each domain where the plan is fully sharded, memx averaging the shards over
    the bridge, else averaged by memx itself, whole. The planner prices each stage so
    (``planning/layout_training.py``, ``planning/hybrid_sharding.py``)."""
    if plan.dp < 2:
        return False
    if dp_crosses_domains:
        return data_parallel != "ddp" and bool(plan.training.get("fully_sharded"))
    return data_parallel == "fsdp" or (data_parallel == "auto" and (plan.training.get("fully_sharded", False) or tp > 1))


def rank_layout(plan: Plan, rank: int) -> RankLayout:
    check_runnable(plan)
    stage, dp_index, tp_index = plan.stage_of_rank(rank)
    grid = mesh_ranks(plan)
    return RankLayout(
        rank=rank, stage=stage, dp_index=dp_index, tp_index=tp_index,
        pp_ranks=tuple(grid[s][dp_index][tp_index % len(grid[s][dp_index])] for s in range(plan.pp)),
        tp_ranks=tuple(grid[stage][dp_index]),
        dp_ranks=tuple(grid[stage][d][tp_index] for d in range(plan.dp)),
        chunks=tuple(chunks_by_stage(plan)[stage]))


def process_domains(plan: Plan, cluster) -> list[str]:
    """Each process rank's communication domain (one domain without a cluster)."""
    if cluster is None:
        return ["native"] * plan.world_size
    by_device = cluster.rank_domains()
    domains = [""] * plan.world_size
    for device_rank, domain in enumerate(by_device):
        domains[process_rank(plan, device_rank)] = domain
    return domains
