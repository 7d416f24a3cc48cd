"""Cluster detection: reports grouped into nodes, the description written as a cluster file that
ClusterSpec reads, `memx cluster detect` on one and on two "nodes" (CPU devices, gloo), and
re-planning finds the detected file."""

import os
import subprocess
import sys

import pytest
import yaml

from memx_launch.runtime.detection import describe, nodes_of
from memx_launch.runtime.worker_env import cluster_path
from memx_launch.specs.cluster import ClusterSpec
from ranks import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = {"name": "NVIDIA-H200", "vendor": "nvidia", "memory_gib": 139.8, "peak_tflops": 700.0, "efficiency": 1.0,
       "memory_bandwidth_gbps": 4000.0, "flash_attention": True}


def _report(node, host="h"):
    return {"node": node, "host": f"{host}{node}", "local_rank": 0, "type": dict(GPU), "nvlink_peers": [],
            "p2p_peers": []}


def test_nodes_of_different_sizes_become_a_cluster_file():
    reports = [_report(0)] + [_report(1) for _ in range(3)]
    nodes = nodes_of(reports)
    assert nodes == [[0], [1, 2, 3]]
    probe = {"allreduce_gbps": 350.0, "p2p_gbps": 400.0}
    results = [{"inter": {"allreduce_gbps": 24.0, "p2p_gbps": 25.0}}, {"intra": probe, "inter": probe}, {}, {}]
    cluster = ClusterSpec.from_dict(describe(reports, nodes, results))
    assert [n.num_devices for n in cluster.nodes] == [1, 3]
    assert cluster.nodes[1].intra_node_gbps == 350.0 and cluster.inter_node_gbps == 24.0
    assert cluster.link_efficiency == 1.0  # measured bus bandwidth: nothing to discount
    assert cluster.nodes[0].host == "h0" and cluster.master_address() == "h0"
    assert cluster.device_type("NVIDIA-H200").memory_gib == 139.8


def _detect(cwd, *flags):
    return subprocess.Popen([sys.executable, "-m", "memx_launch.cli", "cluster", "detect", *flags], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_memx_cluster_detect_on_one_node(tmp_path, capsys):
    proc = _detect(tmp_path, "--nproc-per-node", "2", "--out", "c.yaml")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    cluster = ClusterSpec.from_yaml(str(tmp_path / "c.yaml"))
    assert cluster.world_size == 2 and len(cluster.nodes) == 1 and cluster.nodes[0].intra_node_gbps > 0
    assert cluster.device_type("cpu").efficiency == 1.0  # a CPU's measured matmul rate is taken as it is
    assert "all-reduce" in (tmp_path / "c.yaml").read_text()  # what was measured, as comments
    from memx_launch.cli import main  # never overwritten without --force (checked before anything starts)

    capsys.readouterr()
    assert main(["cluster", "detect", "--out", str(tmp_path / "c.yaml")]) == 2
    assert "memx: error: --out:" in capsys.readouterr().err


@pytest.mark.slow
def test_memx_cluster_detect_on_two_nodes(tmp_path):
    port = str(free_port())
    procs = []
    for node, nproc in ((0, "1"), (1, "2")):
        (tmp_path / f"n{node}").mkdir()
        procs.append(_detect(tmp_path / f"n{node}", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                             nproc, "--master-addr", "127.0.0.1", "--master-port", port, "--out", "c.yaml"))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for node in (0, 1):  # each node writes its own copy
        data = yaml.safe_load((tmp_path / f"n{node}" / "c.yaml").read_text())
        cluster = ClusterSpec.from_dict(data)
        assert [n.num_devices for n in cluster.nodes] == [1, 2]
        assert cluster.inter_node_gbps > 0 and cluster.nodes[1].intra_node_gbps > 0


def test_replanning_finds_the_detected_cluster(tmp_path):
    env = {"MEMX_RUN_DIR": str(tmp_path)}
    assert cluster_path(env) is None
    (tmp_path / "cluster.yaml").write_text("version: 1\n")
    assert cluster_path(env) == str(tmp_path / "cluster.yaml")
    assert cluster_path({**env, "MEMX_CLUSTER": "given.yaml"}) == "given.yaml"


def test_a_single_process_without_a_process_group_describes_itself_alone():
    import torch.distributed as dist

    from memx_launch.runtime.detection import detect_cluster
    from memx_launch.runtime.devices import detect_rank_device

    assert not dist.is_initialized()
    data, note = detect_cluster(detect_rank_device(None, 0, 0), 0, 1)
    cluster = ClusterSpec.from_dict(data)
    assert cluster.world_size == 1 and cluster.rank_device_types() == ["cpu"] and "one device" in note


def _two_vendor_worker(rank, port, queue):
    from memx_launch.runtime.communication import init_distributed
    from memx_launch.runtime.detection import detect_cluster
    from memx_launch.runtime.devices import RankDevice
    from memx_launch.specs.cluster import DeviceType

    # Node 0: two "NVIDIA" ranks; node 1: one "AMD" rank (CPU processes reporting those vendors).
    node, vendor = (0, "nvidia") if rank < 2 else (1, "amd")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3",
                      GROUP_RANK=str(node))
    init_distributed(across_domains=True)
    device = RankDevice(DeviceType(name=f"{vendor}-gpu", vendor=vendor, memory_gib=1.0, peak_tflops=1.0), None, vendor)
    data, note = detect_cluster(device, rank % 2 if node == 0 else 0, 2 if node == 0 else 1)
    queue.put((rank, (data, note)))


@pytest.mark.slow
def test_detection_across_vendors_probes_each_domain_natively_and_the_bridge_between():
    from ranks import spawn_ranks

    results = spawn_ranks(_two_vendor_worker, 3, timeout=120)
    data, note = results[0]
    assert all(results[r][0] == data for r in (1, 2))
    cluster = ClusterSpec.from_dict(data)
    assert cluster.crosses_domains and cluster.rank_domains() == ["nccl", "nccl", "rccl"]
    assert cluster.nodes[0].intra_node_gbps > 0 and cluster.bridge.gbps > 0
    # no two nodes share a domain: the nodes' network is what the bridge reached
    assert cluster.inter_node_gbps > 0 and "bridge (gloo, host memory) between domains" in note
