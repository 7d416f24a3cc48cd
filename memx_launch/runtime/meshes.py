"""The DeviceMeshes a rank's stage trains on: TP inside a replica, and for FSDP2 the stage's DP
replicas, whole (FSDP) or in shard groups (HSDP: the states sharded within a shard group of N
consecutive replicas, each reduced shard all-reduced over the DP / N groups), as the planner
prices them (``planning/hybrid_sharding.py``). N is the plan's ``shard_degree``; a fully sharded
DP group that spans communication domains (no library spans it) is sharded within each domain,
N the most consecutive replicas in one, and memx averages each shard with its replicas over
the bridge (runtime/training.py). Without FSDP2 such a group gets no mesh: memx averages it whole.
"""

from __future__ import annotations

from memx_launch.errors import ConfigError
from memx_launch.planning.hybrid_sharding import domain_shard_degree


def shard_degree(comm, dp_ranks, plan) -> int | None:
    """The shard degree of the DP group ``dp_ranks`` (process ranks): the plan's ``shard_degree``,
    or where the group spans domains in a fully sharded plan, the most consecutive replicas in one
    domain; None: the whole group, or none across domains (memx averages it whole)."""
    given, crosses = plan.training.get("shard_degree"), comm.spans_domains(dp_ranks)
    if given is None and not (crosses and plan.training.get("fully_sharded")):
        return None
    degree = domain_shard_degree([comm.domains[r] for r in dp_ranks], len(dp_ranks), 1, given)
    if not degree:
        raise ConfigError("--plan", f"shard_degree={given}: a shard group of DP group {list(dp_ranks)} would span "
                          "communication domains", "re-plan it with memx plan")
    return None if degree == 1 and crosses and not given else degree


def hybrid_groups(comm, grid: list[list[list[int]]], plan, me: int) -> tuple:
    """This rank's (shard group, native replicate group or None, replica ranks) of hybrid sharding,
    the groups made on every rank for every stage and TP lane in one order (torch numbers groups by
    creation). Within a lane's DP ranks shard groups are consecutive, replica groups strided; a
    replica group across domains gets the groups memx's bridge all-reduce uses instead of one."""
    mine = (None, None, ())
    for replicas in grid:
        for lane in range(len(replicas[0])):
            dp_ranks = [replica[lane] for replica in replicas]
            degree = shard_degree(comm, dp_ranks, plan)
            if degree is None or degree == len(dp_ranks):
                continue
            shards = [(comm.native(ranks), ranks) for ranks in (dp_ranks[k:k + degree]
                                                                for k in range(0, len(dp_ranks), degree))]
            copies = [dp_ranks[k::degree] for k in range(degree)]
            for ranks in copies:
                if comm.spans_domains(ranks):
                    comm.prepare_all_reduce(ranks)
            copies = [(None if comm.spans_domains(ranks) else comm.native(ranks), ranks) for ranks in copies]
            if me in dp_ranks:
                mine = (next(g for g, ranks in shards if me in ranks), *next((g, tuple(ranks)) for g, ranks in copies
                                                                          if me in ranks))
    return mine


def stage_meshes(comm, grid, stage_grid, dp_ranks, tp_ranks, tp_group, device_type: str, dp_crosses_domains: bool,
                 plan) -> tuple:
    """(TP mesh, DP mesh, the ranks memx averages gradients over where the DP group spans domains)
    of this rank's stage (``stage_grid``: its [dp][tp] ranks; ``dp_ranks`` and ``tp_ranks``: this
    rank's DP group and replica): a mesh is None where there is no such dimension (TP 1; DP 1 or
    across domains without FSDP2). FSDP2 over TP needs both from one mesh of the stage ([dp][tp];
    [replicate][shard][tp] with HSDP; [shard][tp] across domains)."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, tp = len(stage_grid), len(stage_grid[0])
    shard, replicate, replica_ranks = hybrid_groups(comm, grid, plan, comm.rank)
    degree = shard_degree(comm, dp_ranks, plan) if dp > 1 else None
    if degree is not None and degree < dp:
        blocks = [stage_grid[k:k + degree] for k in range(0, dp, degree)]
        if dp_crosses_domains:  # the shard group's mesh; its replicas are averaged over the bridge
            block = next(b for b in blocks if any(comm.rank in replica for replica in b))
            if tp > 1:
                mesh = DeviceMesh.from_group([shard, tp_group], device_type, mesh=block, mesh_dim_names=("shard", "tp"))
                return mesh["tp"], mesh["shard"], replica_ranks
            return None, DeviceMesh.from_group(shard, device_type, mesh=[r[0] for r in block],
                                               mesh_dim_names=("shard",)), replica_ranks
        if tp > 1:
            mesh = DeviceMesh.from_group([replicate, shard, tp_group], device_type, mesh=blocks,
                                         mesh_dim_names=("replicate", "shard", "tp"))
            return mesh["tp"], mesh["replicate", "shard"], dp_ranks
        lane = [[replica[0] for replica in block] for block in blocks]
        return None, DeviceMesh.from_group([replicate, shard], device_type, mesh=lane,
                                           mesh_dim_names=("replicate", "shard")), dp_ranks
    if tp > 1 and dp > 1 and not dp_crosses_domains:
        mesh = DeviceMesh.from_group([comm.native(dp_ranks), tp_group], device_type, mesh=stage_grid,
                                     mesh_dim_names=("dp", "tp"))
        return mesh["tp"], mesh["dp"], dp_ranks
    tp_mesh = DeviceMesh.from_group(tp_group, device_type, mesh=list(tp_ranks), mesh_dim_names=("tp",)) \
        if tp > 1 else None
    if dp > 1 and not dp_crosses_domains:
        return tp_mesh, DeviceMesh.from_group(comm.native(dp_ranks), device_type, mesh=list(dp_ranks),
                                              mesh_dim_names=("dp",)), dp_ranks
    return tp_mesh, None, dp_ranks
