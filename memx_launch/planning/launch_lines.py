"""A plan's launch: ``torchrun`` lines, one per node, for memx's runtime or in Megatron-LM's rank
order, and the ``MEMX_*`` variables that tell a script which doesn't import memx the layout.
Pure functions of a :class:`~memx_launch.planning.plan.Plan`; no torch.
"""

from __future__ import annotations

import shlex

from memx_launch.errors import ConfigError
from memx_launch.planning.exporters import Export
from memx_launch.planning.layouts import MIXED_SEPARATOR, stage_device_types
from memx_launch.planning.plan import Plan
from memx_launch.specs.cluster import ClusterSpec

DEFAULT_MASTER_PORT = 29500


def megatron_node_order(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """Node indices in the order Megatron needs them.

    Megatron gives pipeline rank ``r // (tp * cp * dp)`` to global rank ``r``, so stage 0's
    devices must come first. Nodes are reordered (their ranks keep their order inside the
    node) so that the stages' ranks, listed stage by stage, become 0..world_size-1.
    """
    wanted = {r: i for i, r in enumerate(r for s in plan.stages for r in s.ranks)}
    firsts, start = [], 0
    for index, node in enumerate(cluster.nodes):
        ranks = range(start, start + node.num_devices)
        start += node.num_devices
        positions = [wanted[r] for r in ranks]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            mixed = any(MIXED_SEPARATOR in s.device_type for s in plan.stages)
            raise ConfigError("plan.stages", f"the stages split {node.name} in a way Megatron's rank order "
                              "cannot follow", "give a stage on several device types whole nodes of each"
                              if mixed else "use memx-run, which places stages on any ranks")
        firsts.append((positions[0], index))
    return [index for _, index in sorted(firsts)]


def torchrun_commands(plan: Plan, cluster: ClusterSpec, script: str, script_args: list[str] = (),
                      *, master_addr: str | None = None, master_port: int = DEFAULT_MASTER_PORT,
                      for_megatron: bool = False) -> list[Export]:
    """One ``torchrun`` command per node of the cluster.

    The static rendezvous with ``--node-rank`` fixes the global rank order (ranks are handed
    out by cumulative ``--nproc-per-node`` in node-rank order), and nodes may have different
    device counts. For memx's runtime the nodes keep the cluster file's order, which is the
    order the plan's ranks refer to; ``for_megatron`` reorders them so that pipeline stages
    take consecutive global ranks (:func:`megatron_node_order`), and refuses a plan that crosses
    communication domains (:meth:`~memx_launch.planning.plan.Plan.within_one_domain`). The master
    address is ``master_addr``, else the cluster file's (``master_addr``, or its first node's
    ``host``), else localhost, which only a one-node job can use (a note says so).
    """
    if for_megatron:
        plan.within_one_domain("Megatron-LM")
    if cluster.world_size != plan.world_size:
        raise ConfigError("--cluster", f"{cluster.name} has {cluster.world_size} devices but the "
                          f"plan needs tp*pp*cp*dp={plan.world_size}", "pass the cluster the plan was made for")
    ranks = cluster.rank_device_types()
    for i, stage in enumerate(plan.stages):
        # A stage on several types names them a+b or a*3+b*1 (planning.layouts); a whole
        # type name may itself hold those marks.
        types = {stage.device_type, *stage_device_types(stage.device_type)}
        wrong = [r for r in stage.ranks if ranks[r] not in types]
        if wrong:
            raise ConfigError(f"plan.stages[{i}].ranks", f"rank {wrong[0]} is a {ranks[wrong[0]]} "
                              f"in {cluster.name}, not a {stage.device_type}",
                              "pass the cluster the plan was made for")
    order = megatron_node_order(plan, cluster) if for_megatron else list(range(len(cluster.nodes)))
    nnodes = len(cluster.nodes)
    master_addr = master_addr or cluster.master_address()
    missing = []
    if master_addr is None:
        master_addr = "localhost"
        if nnodes > 1:
            missing = ["--master-addr localhost only reaches node 0 from itself: set master_addr (or the "
                       "first node's host) in the cluster file, or pass --master-addr"]
    exports = []
    for node_rank, index in enumerate(order):
        node = cluster.nodes[index]
        args = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(node.num_devices),
                "--node-rank", str(node_rank), "--rdzv-backend", "static",
                "--master-addr", master_addr, "--master-port", str(master_port),
                script, *script_args]
        exports.append(Export(args, ([f"run on {node.name}"] if nnodes > 1 else []) + missing))
    return exports


# --------------------------------------------------------------------------- environment


def plan_env(plan: Plan, plan_path: str | None = None) -> dict[str, str]:
    """``MEMX_*`` variables for scripts that do not import memx (comma lists, one per stage)."""
    env = {
        "MEMX_MODEL": plan.model,
        "MEMX_TP": str(plan.uniform_tp("MEMX_TP (one degree)")),
        "MEMX_PP": str(plan.pp),
        "MEMX_CP": str(plan.cp),
        "MEMX_DP": str(plan.uniform_dp("MEMX_DP (one degree)")),
        "MEMX_MICRO_BATCH_SIZE": str(plan.micro_batch_size),
        "MEMX_GLOBAL_BATCH_SIZE": str(plan.global_batch_size),
        "MEMX_NUM_MICROBATCHES": str(plan.num_microbatches),
        "MEMX_SEQ_LEN": str(plan.seq_len),
        "MEMX_SCHEDULE": plan.schedule,
        "MEMX_VIRTUAL_STAGES": str(plan.virtual_stages),
        "MEMX_LAYERS_PER_STAGE": ",".join(str(s.num_layers) for s in plan.stages),
        "MEMX_RECOMPUTE_PER_STAGE": ",".join(s.recompute for s in plan.stages),
        "MEMX_STAGE_DEVICE_TYPES": ",".join(s.device_type for s in plan.stages),
    }
    if plan_path:
        env["MEMX_PLAN"] = plan_path
    return env


def env_lines(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
