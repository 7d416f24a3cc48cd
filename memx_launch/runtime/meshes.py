"""The DeviceMeshes a rank's stage trains on: TP inside a replica, and for FSDP2 the stage's DP
replicas, whole (FSDP) or, with the plan's ``shard_degree`` N, as a (replicate, shard) mesh of
DP / N groups of N consecutive replicas each (HSDP: the states sharded within a shard group,
each reduced shard all-reduced over the replicate dimension, as the planner prices it in
``planning/hybrid_sharding.py``). A DP group that spans communication domains gets no mesh:
memx averages its gradients itself (runtime/training.py).
"""

from __future__ import annotations


def hybrid_groups(comm, grid: list[list[list[int]]], shard_degree: int, me: int) -> tuple:
    """This rank's (replicate, shard) native groups of HSDP, made on every rank for every stage
    and TP lane in one order (torch numbers groups by creation); (None, None) on ranks of no such
    group. Within a lane's DP ranks, shard groups are consecutive, replicate groups strided."""
    mine = (None, None)
    for replicas in grid:
        for lane in range(len(replicas[0])):
            dp_ranks = [replica[lane] for replica in replicas]
            shards = [dp_ranks[k:k + shard_degree] for k in range(0, len(dp_ranks), shard_degree)]
            copies = [dp_ranks[k::shard_degree] for k in range(shard_degree)]
            made = [(comm.native(ranks), ranks) for ranks in copies + shards]
            if me in dp_ranks:
                mine = tuple(next(group for group, ranks in made[i:j] if me in ranks)
                             for i, j in ((0, len(copies)), (len(copies), len(made))))
    return mine


def stage_meshes(comm, grid, stage_grid, dp_ranks, tp_ranks, tp_group, device_type: str, dp_crosses_domains: bool,
                 shard_degree: int | None) -> tuple:
    """(TP mesh, DP mesh) of this rank's stage (``stage_grid``: its [dp][tp] ranks; ``dp_ranks``
    and ``tp_ranks``: this rank's DP group and replica): None where there is no such dimension (TP
    1; DP 1 or across domains). FSDP2 over TP needs both from one mesh of the stage ([dp][tp], or
    [replicate][shard][tp] with HSDP)."""
    from torch.distributed.device_mesh import DeviceMesh

    dp = len(stage_grid)
    tp = len(stage_grid[0])
    hybrid = shard_degree is not None and 1 < dp and shard_degree < dp and not dp_crosses_domains
    if hybrid:
        replicate, shard = hybrid_groups(comm, grid, shard_degree, comm.rank)
        blocks = [stage_grid[k:k + shard_degree] for k in range(0, dp, shard_degree)]
        if tp > 1:
            mesh = DeviceMesh.from_group([replicate, shard, tp_group], device_type, mesh=blocks,
                                         mesh_dim_names=("replicate", "shard", "tp"))
            return mesh["tp"], mesh["replicate", "shard"]
        lane = [[replica[0] for replica in block] for block in blocks]
        return None, DeviceMesh.from_group([replicate, shard], device_type, mesh=lane,
                                           mesh_dim_names=("replicate", "shard"))
    if tp > 1 and dp > 1 and not dp_crosses_domains:
        mesh = DeviceMesh.from_group([comm.native(dp_ranks), tp_group], device_type, mesh=stage_grid,
                                     mesh_dim_names=("dp", "tp"))
        return mesh["tp"], mesh["dp"]
    if tp > 1:
        return DeviceMesh.from_group(tp_group, device_type, mesh=list(tp_ranks), mesh_dim_names=("tp",)), None
    if dp > 1 and not dp_crosses_domains:
        return None, DeviceMesh.from_group(comm.native(dp_ranks), device_type, mesh=list(dp_ranks),
                                           mesh_dim_names=("dp",))
    return None, None
