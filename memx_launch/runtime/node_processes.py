"""How many processes memx-run starts on a node: the flag, the cluster file's entry for the node,
or one per GPU; and how many nodes the job may have (torchrun's --nnodes).
"""

from __future__ import annotations

import os

from memx_launch.errors import ConfigError
from memx_launch.specs import ClusterSpec
from memx_launch.specs.node import MAX_DEVICES, MAX_DEVICES_PER_NODE


def max_nodes(args) -> int:
    """The most nodes the job may have (torchrun's --nnodes, N or MIN:MAX)."""
    nnodes = str(args.nnodes).split(":")[-1]
    if not (nnodes.isascii() and nnodes.isdigit()):
        raise ConfigError("--nnodes", f"cannot read {args.nnodes!r}", "e.g. --nnodes 1 or 1:2")
    if not 0 < int(nnodes) <= MAX_DEVICES:
        raise ConfigError("--nnodes", f"{nnodes} nodes is not a job memx plans for", f"at most {MAX_DEVICES:,}")
    return int(nnodes)


def _process_count(value: str) -> int:
    """torchrun's --nproc-per-node: a number, or gpu/auto/cpu (this machine's GPUs; auto: CPUs without)."""
    if value.isascii() and value.isdigit() and 0 < int(value) <= MAX_DEVICES_PER_NODE:
        return int(value)
    if value in ("gpu", "auto"):
        import torch
        if torch.cuda.is_available():
            return torch.cuda.device_count()
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    raise ConfigError("--nproc-per-node", f"cannot use {value!r} here",
                      f"give a number of processes, 1 to {MAX_DEVICES_PER_NODE}, e.g. 4")


def node_processes(args, cluster: ClusterSpec | None) -> tuple[int, str]:
    """How many processes this node starts and where that came from: the flag, this node's
    entry in the cluster file (--node-rank), or one per GPU (one process on a CPU machine).
    Nodes may differ: each node's agent reports its own count to the rendezvous."""
    given = args.nproc_per_node
    if cluster is not None:
        if args.node_rank >= len(cluster.nodes):
            raise ConfigError("--node-rank", f"{args.node_rank} but {args.cluster} lists {len(cluster.nodes)} node(s)",
                              f"pass --node-rank 0..{len(cluster.nodes) - 1}, this node's place in the file")
        node = cluster.nodes[args.node_rank]
        if given is None:
            return node.num_devices, f"file: node {args.node_rank}, {node.name}"
        count = _process_count(given)
        if count != node.num_devices:
            raise ConfigError("--nproc-per-node", f"{count} process(es), but {args.cluster} gives node {args.node_rank} "
                              f"({node.name}) {node.num_devices} device(s)",
                              f"drop --nproc-per-node (the file's count is used) or pass {node.num_devices}")
        return count, "flag"
    if given is not None:
        return _process_count(given), "flag"
    if has_gpu():
        import torch
        return torch.cuda.device_count(), "default: one per GPU"
    return 1, "default: no GPU"


def has_gpu() -> bool:
    import torch
    return torch.cuda.is_available()
