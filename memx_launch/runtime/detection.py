"""Cluster detection: the job describes itself when no cluster file is given.

Every rank reports its host, vendor, device name, memory and the local devices it reaches over
NVLink (NVML) or peer-to-peer (torch.cuda); the ranks of one torchrun agent form a node
(torchrun numbers them consecutively). The nodes may run different vendors' torch builds: the job
joins over the bridge (gloo, in every build), and each probe runs where its library exists. On each
node with two or more ranks, an all-reduce over its ranks and a point-to-point transfer between its
first two, on the node's native library; across the nodes of one communication domain, the same
between their first ranks; across domains, the same over the bridge between the first ranks of the
first two domains, host tensors. Rank 0 builds the cluster description (intra- and inter-node
bandwidth from the all-reduce's bus bandwidth, the figure the cost model uses for collectives; the
bridge's from its transfer) and every node's first local rank writes it as a cluster YAML.

On a machine without GPUs each rank is a CPU "device" (gloo), so all of this runs in the tests.
``memx cluster detect`` runs :func:`main` under torchrun.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import yaml

from memx_launch.runtime.communication import NATIVE_BACKEND_BY_DEVICE, local_device, new_group
from memx_launch.runtime.messages import all_gather_json
from memx_launch.files import write_text_atomic
from memx_launch.runtime.devices import RankDevice
from memx_launch.specs.cluster import DeviceType

PROBE_BYTES = {"cuda": 64 * 2**20, "cpu": 8 * 2**20}
PROBE_REPEATS = 3


def _nvlink_peers(local_rank: int, local_count: int) -> list[int]:
    """Local ranks this GPU reaches over NVLink (NVML, each GPU found by its CUDA index's UUID)."""
    try:
        from memx_launch.profiling.kernel import nvml_device

        pynvml, me = nvml_device(local_rank)
        return [j for j in range(min(local_count, torch.cuda.device_count())) if j != local_rank
                and pynvml.nvmlDeviceGetP2PStatus(me, nvml_device(j)[1], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                == pynvml.NVML_P2P_STATUS_OK]
    except Exception:  # no NVML (ROCm, CPU, containers without the driver library)
        return []


def rank_report(rank_device: RankDevice, local_rank: int, local_count: int) -> dict:
    """What this rank is: host, device type (name, vendor, memory, measured peak) and its links."""
    from dataclasses import asdict

    # A node is one torchrun agent (GROUP_RANK; Lightning's launchers set NODE_RANK): its ranks are
    # consecutive, whatever the host is called.
    report = {"node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))), "host": socket.gethostname(), "local_rank": local_rank,
              "type": asdict(rank_device.device_type),
              "description": rank_device.description, "nvlink_peers": [], "p2p_peers": []}
    if torch.cuda.is_available():
        report["nvlink_peers"] = _nvlink_peers(local_rank, local_count)
        report["p2p_peers"] = [j for j in range(min(local_count, torch.cuda.device_count()))
                               if j != local_rank and torch.cuda.can_device_access_peer(local_rank, j)]
    return report


def _timed(fn, device) -> float:
    """Median seconds of ``fn`` after one warm-up."""
    fn()
    times = []
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _probe(ranks: list[int], group, device) -> dict:
    """All-reduce bus bandwidth over ``ranks`` and point-to-point bandwidth between the first two
    (GB/s), as seen by ranks[0]; every rank of ``ranks`` must call it, the others must not."""
    me = dist.get_rank()
    buffer = torch.ones(PROBE_BYTES[device.type] // 4, device=device)
    nbytes = buffer.numel() * 4
    n = len(ranks)
    seconds = _timed(lambda: dist.all_reduce(buffer, group=group), device)
    allreduce = 2 * (n - 1) / n * nbytes / seconds / 1e9
    if me == ranks[0]:
        p2p = nbytes / _timed(lambda: dist.send(buffer, ranks[1], group=group), device) / 1e9
    elif me == ranks[1]:
        _timed(lambda: dist.recv(buffer, ranks[0], group=group), device)
        p2p = None
    else:
        p2p = None
    return {"allreduce_gbps": allreduce, "p2p_gbps": p2p}


def nodes_of(reports: list[dict]) -> list[list[int]]:
    """Ranks grouped by node (torchrun agent), in rank order."""
    nodes: list[list[int]] = []
    for rank, report in enumerate(reports):
        if nodes and reports[nodes[-1][0]]["node"] == report["node"]:
            nodes[-1].append(rank)
        else:
            nodes.append([rank])
    return nodes


def domains_of(reports: list[dict]) -> list[str]:
    """Each rank's communication domain, from the device type it reported."""
    return [DeviceType(**r["type"]).communication_domain for r in reports]


def detect_cluster(rank_device: RankDevice, local_rank: int, local_count: int) -> tuple[dict, str]:
    """Every rank: report, probe the links; returns the cluster description (a dict for
    ClusterSpec.from_dict) and comment lines with what was measured, on every rank. A single
    process without a process group describes itself alone."""
    reports = all_gather_json(rank_report(rank_device, local_rank, local_count))
    nodes = nodes_of(reports)
    if not dist.is_initialized():  # a single process (Lightning on one device): no link to probe
        return describe(reports, nodes, [{}]), probe_note(reports, nodes, [{}])
    device = local_device()
    native = NATIVE_BACKEND_BY_DEVICE[device.type]
    domains = domains_of(reports)
    # Every rank creates every group, in the same order; only the members build the backend
    # (runtime/communication.py), so a native group exists only where its library does. A node's
    # ranks share one torch build: one domain.
    node_groups = [new_group(ranks, native) if len(ranks) > 1 else None for ranks in nodes]
    leaders_by_domain: dict[str, list[int]] = {}
    for ranks in nodes:
        leaders_by_domain.setdefault(domains[ranks[0]], []).append(ranks[0])
    leader_groups = {d: new_group(leaders, native) for d, leaders in leaders_by_domain.items() if len(leaders) > 1}
    firsts = [leaders[0] for leaders in leaders_by_domain.values()][:2]
    bridge_group = new_group(firsts, dist.get_backend()) if len(firsts) > 1 else None
    me = dist.get_rank()
    measured: dict = {}
    for ranks, group in zip(nodes, node_groups):
        if group is not None and me in ranks:
            measured["intra"] = _probe(ranks, group, device)
    dist.barrier()  # the inter-node probes run alone on the links
    for d, group in leader_groups.items():
        if me in leaders_by_domain[d]:
            measured["inter"] = _probe(leaders_by_domain[d], group, device)
    dist.barrier()
    if bridge_group is not None and me in firsts:
        measured["bridge"] = _probe(firsts, bridge_group, torch.device("cpu"))
    results = all_gather_json(measured)
    return describe(reports, nodes, results), probe_note(reports, nodes, results)


def describe(reports: list[dict], nodes: list[list[int]], results: list[dict]) -> dict:
    """The cluster description from the reports and the probes' results (what rank 0 writes)."""
    device_types, node_entries = {}, []
    for index, ranks in enumerate(nodes):
        counts: dict[str, int] = {}
        for r in ranks:
            kind = dict(reports[r]["type"])
            name = kind.pop("name")
            device_types.setdefault(name, kind)  # the type's first rank's measured figures
            counts[name] = counts.get(name, 0) + 1
        intra = results[ranks[0]].get("intra")
        entry = {"name": f"node{index}", "host": reports[ranks[0]]["host"], "devices": counts,
                 # one device: no link inside the node is used; PCIe-class figure as a placeholder
                 "intra_node_gbps": round(intra["allreduce_gbps"], 3) if intra else 16.0}
        node_entries.append(entry)
    # The probes measured bus bandwidth: what collectives reach, nothing to discount.
    data = {"version": 1, "name": "detected", "device_types": device_types, "nodes": node_entries,
            "link_efficiency": 1.0}
    inter = next((r["inter"] for r in results if r.get("inter", {}).get("p2p_gbps")), None)
    bridge = next((r["bridge"] for r in results if r.get("bridge", {}).get("p2p_gbps")), None)
    if inter or bridge:  # no two nodes of one domain: the nodes' network as the bridge reached it
        data["inter_node_gbps"] = round((inter or bridge)["allreduce_gbps"], 3)
    if bridge:
        data["bridge"] = {"backend": "gloo", "gbps": round(bridge["p2p_gbps"], 3)}
    return data


def cluster_yaml(data: dict, reports_note: str = "") -> str:
    """The description as a commented cluster file."""
    header = ("# Detected by memx: device types from each rank's device (memory_bandwidth_gbps: a copy's rate "
              "written as the datasheet figure it stands for, docs/clusters.md), bandwidths from short "
              "all-reduce probes (bus bandwidth, GB/s).\n" + reports_note)
    return header + yaml.safe_dump(data, sort_keys=False)


def probe_note(reports: list[dict], nodes: list[list[int]], results: list[dict]) -> str:
    lines = []
    for index, ranks in enumerate(nodes):
        intra = results[ranks[0]].get("intra")
        links = f"all-reduce {intra['allreduce_gbps']:.2f} GB/s, p2p {intra['p2p_gbps']:.2f} GB/s" if intra else "one device"
        nvlink = {r - ranks[0]: reports[r]["nvlink_peers"] for r in ranks if reports[r]["nvlink_peers"]}
        lines.append(f"# node{index} ({reports[ranks[0]]['host']}): {links}"
                     + (f"; NVLink peers by local rank {nvlink}" if nvlink else ""))
    domains = domains_of(reports)
    for rank, result in enumerate(results):
        if (result.get("inter") or {}).get("p2p_gbps"):  # the probe's first rank: both figures
            lines.append(f"# across the {domains[rank]} nodes: all-reduce {result['inter']['allreduce_gbps']:.2f} GB/s, "
                         f"p2p {result['inter']['p2p_gbps']:.2f} GB/s")
        if (result.get("bridge") or {}).get("p2p_gbps"):
            lines.append(f"# bridge (gloo, host memory) between domains: all-reduce "
                         f"{result['bridge']['allreduce_gbps']:.2f} GB/s, p2p {result['bridge']['p2p_gbps']:.2f} GB/s")
    if any("inter" in r or "bridge" in r for r in results):
        lines.append("# inter_node_gbps is one rail (one rank per node probed); NICs were not counted, so each "
                     "node is taken to have one per device: add nics: N to a node with fewer")
    return "\n".join(lines) + "\n"


def write_detected(rank_device: RankDevice, path: str, *, overwrite: bool) -> dict:
    """Every rank: detect; each node's first local rank writes the file (nodes need not share a disk)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    data, note = detect_cluster(rank_device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if local_rank == 0:
        write_text_atomic(path, cluster_yaml(data, note), overwrite=overwrite)
    return data


def run_detect(args) -> int:
    """``memx cluster detect``: a torchrun job of :func:`detection_worker` on this node."""
    from torch.distributed.run import get_args_parser

    from memx_launch.errors import ConfigError
    from memx_launch.runtime.agent import run_agent

    if os.path.exists(args.out) and not args.force:
        raise ConfigError("--out", f"{args.out} already exists", "pass --force to overwrite or choose another path")
    nnodes = str(args.nnodes).split(":")[-1]
    if nnodes != "1" and not args.master_addr:
        raise ConfigError("--master-addr", f"needed with --nnodes {args.nnodes}", "give node rank 0's address")
    nproc = args.nproc_per_node or str(torch.cuda.device_count() if torch.cuda.is_available() else 1)
    torchrun = ["--nnodes", str(args.nnodes), "--nproc-per-node", nproc, "--max-restarts", "0",
                "--start-method", "forkserver"]
    if nnodes == "1" and not args.master_addr:
        torchrun.append("--standalone")
    else:
        torchrun += ["--node-rank", str(args.node_rank), "--rdzv-backend", "static", "--master-addr",
                     args.master_addr, "--master-port", str(args.master_port)]
    # torchrun's parser wants a script: the agent runs detection_worker in its place
    return run_agent(get_args_parser().parse_args([*torchrun, "memx-cluster-detect"]), detection_worker,
                     ["--out", os.path.abspath(args.out)])


def detection_worker(generation: str, *argv: str) -> None:
    """Each rank of ``memx cluster detect`` (its agent starts it): detect and write --out; an
    error exits the process with its code."""
    from memx_launch.errors import MemxError
    from memx_launch.runtime.devices import detect_rank_device
    from memx_launch.runtime.communication import init_distributed

    parser = argparse.ArgumentParser(prog="memx cluster detect (worker)")
    parser.add_argument("--out", required=True, help="written by each node's first local rank")
    args = parser.parse_args(list(argv))
    code = 0
    try:
        init_distributed(across_domains=True)  # the nodes may run different vendors' libraries
        rank_device = detect_rank_device(None, dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")))
        data = write_detected(rank_device, args.out, overwrite=True)  # memx cluster detect checked --out
        if dist.get_rank() == 0:
            print(f"cluster written to {args.out}: {len(data['nodes'])} node(s), "
                  f"{sum(sum(n['devices'].values()) for n in data['nodes'])} device(s)", flush=True)
    except MemxError as exc:
        print(f"memx: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)
