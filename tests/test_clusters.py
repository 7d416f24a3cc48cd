"""Cluster files with node counts (12,288 GPUs in a few lines) and the check of each rank's GPU
against the file."""

import json
import os
import tracemalloc

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.runtime.devices import capability_hint, check_declared
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import DEFAULT_EFFICIENCY, FP32_MATMUL_SHARE
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
H100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 989}


def _cluster(nodes, **extra):
    return ClusterSpec.from_dict({"version": 1, "device_types": {"h100": H100, "mi300x": {
        "vendor": "amd", "memory_gib": 192, "peak_tflops": 1307}}, "nodes": nodes, "inter_node_gbps": 50, **extra})


def test_identical_nodes_as_one_entry_with_a_count():
    cluster = _cluster([{"name": "h", "devices": {"h100": 8}, "count": 3, "intra_node_gbps": 450},
                        {"name": "m", "devices": {"mi300x": 4}, "intra_node_gbps": 300}])
    assert [n.name for n in cluster.nodes] == ["h-0", "h-1", "h-2", "m"]
    assert cluster.world_size == 28
    assert cluster.rank_device_types()[23:25] == ["h100", "mi300x"]
    assert cluster.link_gbps(0, 7) == 450 and cluster.link_gbps(7, 8) == 50


def test_twelve_thousand_gpus_in_a_few_lines_and_little_memory():
    tracemalloc.start()
    cluster = _cluster([{"name": "h", "devices": {"h100": 8}, "count": 1024, "intra_node_gbps": 450},
                        {"name": "m", "devices": {"mi300x": 8}, "count": 512, "intra_node_gbps": 300}])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert cluster.world_size == 12288 and len(cluster.nodes) == 1536
    assert peak < 20 * 2**20, peak  # per-rank tables of 12,288 entries, not per-pair ones


@pytest.mark.parametrize("entry, field", [
    ({"count": 0}, "cluster.nodes[0].count"),
    ({"count": 2, "host": "a"}, "cluster.nodes[0].host"),
    ({"count": 200_000}, "cluster.nodes[0].count")])
def test_bad_counts_are_one_line(entry, field):
    with pytest.raises(ConfigError) as info:
        _cluster([{"devices": {"h100": 8}, "intra_node_gbps": 450, **entry}])
    assert info.value.field == field


def test_master_address_is_the_file_s_or_the_first_node_s_host():
    nodes = [{"devices": {"h100": 8}, "intra_node_gbps": 450, "host": "n0.example.org"},
             {"devices": {"h100": 8}, "intra_node_gbps": 450}]
    assert _cluster(nodes).master_address() == "n0.example.org"
    assert _cluster(nodes, master_addr="10.1.1.1").master_address() == "10.1.1.1"
    with pytest.raises(ConfigError, match="cluster.master_addr"):
        _cluster(nodes, master_addr=5)


def test_a_rank_whose_gpu_disagrees_with_the_file_is_named_with_both():
    cluster = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "paper-20gpu.yaml"))
    a100 = cluster.device_type("a100-80gb")
    check_declared(a100, 0, "NVIDIA A100-SXM4-80GB", "nvidia", 79.15 * 2**30)  # what the driver reports
    with pytest.raises(ConfigError) as info:
        check_declared(a100, 3, "NVIDIA A100-SXM4-40GB", "nvidia", 39.4 * 2**30)
    message = str(info.value)
    assert message.startswith("--cluster: rank 3 has NVIDIA A100-SXM4-40GB (nvidia, 39.4 GiB)")
    assert "a100-80gb (nvidia, 80 GiB)" in message and "\n" not in message
    with pytest.raises(ConfigError, match="rank 1 has AMD Instinct MI250X"):
        check_declared(a100, 1, "AMD Instinct MI250X", "amd", 80 * 2**30)


def test_link_efficiency_discounts_stated_bandwidth_in_communication_time():
    nodes = [{"devices": {"h100": 8}, "intra_node_gbps": 450}]
    assert _cluster(nodes).link_efficiency == 0.8
    args = (np.zeros(1, int), np.full(1, 8), np.ones(1), np.full(1, 4096), np.zeros(1))
    times = {e: float(cm.AnalyticalCostModel(get_model("llama2-7b"), _cluster(nodes, link_efficiency=e),
                                             TrainingSpec()).layer_costs(*args).time_s[0]) for e in (0.5, 1.0)}
    assert times[0.5] > times[1.0]
    for bad in (0, 1.5, "fast"):
        with pytest.raises(ConfigError) as info:
            _cluster(nodes, link_efficiency=bad)
        assert info.value.field == "cluster.link_efficiency"


def test_a_collective_leaves_each_node_over_its_members_share_of_the_nics():
    two = [{"name": "h", "devices": {"h100": 8}, "count": 2, "intra_node_gbps": 450}]
    cluster = _cluster(two)
    # All 16 ranks in one group (FSDP, TP 1): 8 rails per node, capped by the node's own links.
    assert cluster.group_gbps(list(range(16))) == 400
    # TP 8: each DP group has one member per node, one rail.
    assert cluster.group_gbps([0, 8]) == 50
    # TP 2: four members per node, four rails; a pair of ranks in one node stays on NVLink.
    assert cluster.group_gbps([0, 2, 4, 6, 8, 10, 12, 14]) == 200 and cluster.group_gbps([0, 1]) == 450
    # One NIC shared by the node's eight GPUs: every group gets its members' share of it.
    shared = _cluster([{**two[0], "nics": 1}])
    assert shared.group_gbps(list(range(16))) == 50 and shared.group_gbps([0, 8]) == 50 / 8
    assert shared.link_gbps(0, 8) == 50 and shared.transfers_gbps([(i, 8 + i) for i in range(8)]) == 50 / 8
    # Never more than the members' NICs, never more than the node's links.
    for ranks in ([0, 8], list(range(16)), [0, 1, 8, 9], [3, 4, 5, 11]):
        members = max(sum(1 for r in ranks if r // 8 == n) for n in (0, 1))
        assert cluster.group_gbps(ranks) <= min(50 * members, 450)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "eight"])
def test_bad_nic_counts_are_one_line(bad):
    with pytest.raises(ConfigError) as info:
        _cluster([{"devices": {"h100": 8}, "intra_node_gbps": 450, "nics": bad}])
    assert info.value.field == "cluster.nodes[0].nics"


@pytest.mark.parametrize("bad", ["hopper", 0, -9.0, True])
def test_bad_compute_capabilities_are_one_line(bad):
    with pytest.raises(ConfigError) as info:
        ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {**H100, "compute_capability": bad}},
                               "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]})
    assert info.value.field == "device_types.h100.compute_capability"


def test_point_to_point_transfers_share_a_node_s_nics_only_when_more_cross_than_it_has():
    v100, t4 = {"vendor": "nvidia", "memory_gib": 32, "peak_tflops": 125}, {"vendor": "nvidia", "memory_gib": 16,
                                                                              "peak_tflops": 65}
    cluster = ClusterSpec.from_dict({"version": 1, "device_types": {"v100": v100, "t4": t4}, "inter_node_gbps": 12.5,
                                     "nodes": [{"devices": {"v100": 4}, "intra_node_gbps": 150, "nics": 1},
                                               {"devices": {"t4": 2}, "intra_node_gbps": 12, "nics": 1}]})
    assert cluster.transfers_gbps([(3, 4)]) == 12.5  # one transfer: the whole NIC
    assert cluster.transfers_gbps([(2, 4), (3, 5)]) == 12.5 / 2  # two through one NIC each way
    assert cluster.transfers_gbps([(0, 1), (2, 3)]) == 150  # inside a node: its link
    # One NIC per GPU (the default): every crossing transfer has its own.
    dgx = _cluster([{"name": "h", "devices": {"h100": 8}, "count": 2, "intra_node_gbps": 450}])
    assert dgx.transfers_gbps([(i, 8 + i) for i in range(8)]) == 50


def test_a_gpu_whose_compute_capability_the_file_leaves_out_is_named_in_the_settings_line():
    h100 = _cluster([{"devices": {"h100": 8}, "intra_node_gbps": 450}]).device_type("h100")
    assert "add compute_capability: 9" in capability_hint(h100, 9.0)
    # Without fused attention it still sets the default efficiency; where it changes nothing
    # (Ampere, or no fused attention and an efficiency given) the line stays quiet.
    assert capability_hint(h100, 8.0) == ""

    def h100_with(**fields):
        return ClusterSpec.from_dict({"version": 1, "device_types": {"h100": {**H100, **fields}},
                                      "nodes": [{"devices": {"h100": 8}, "intra_node_gbps": 450}]}).device_type("h100")
    assert "add compute_capability" in capability_hint(h100_with(flash_attention=False), 9.0)
    assert capability_hint(h100_with(flash_attention=False, efficiency=0.6), 9.0) == ""
    assert capability_hint(h100_with(compute_capability=9.0), 9.0) == "" and capability_hint(h100, None) == ""


def test_default_efficiency_is_a_training_share_of_each_device_s_best_matmul_rate():
    """A100's best bf16 matmul reaches 85.9% of its datasheet peak, H100's 80.1%, MI300X's 60.1%
    (MAMF). With no efficiency in the file, A100's training sustains 0.75 of its peak; Hopper's
    sustains 0.58 of H100's (MPT's A100/H100 pairs), a lower share of its best rate, and MI300X
    the same share of its own best rate as Hopper."""
    a100 = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312, "compute_capability": 8.0}
    types = {"a100": a100, "h100": {**H100, "compute_capability": 9.0}, "h100-stated": {**H100, "efficiency": 0.6},
             "h100-unknown": H100, "mi300x": {"vendor": "amd", "memory_gib": 192, "peak_tflops": 1307}}
    cluster = ClusterSpec.from_dict({"version": 1, "device_types": types,
                                     "nodes": [{"devices": {t: 1 for t in types}, "intra_node_gbps": 300}]})
    share = {t: cluster.device_type(t).effective_tflops / cluster.device_type(t).peak_tflops for t in types}
    assert share["a100"] == share["h100-unknown"] == DEFAULT_EFFICIENCY
    # 0.58 and 0.58 x 0.601 / 0.801.
    assert share["h100"] == pytest.approx(0.58) and share["mi300x"] == pytest.approx(0.435, abs=1e-3)
    # A detected device's large matmul measures its best rate: its training share follows its generation.
    from memx_launch.specs.efficiency import training_share_of_best_matmul
    assert training_share_of_best_matmul("nvidia", 8.0) == pytest.approx(DEFAULT_EFFICIENCY / 0.859)
    assert training_share_of_best_matmul("nvidia", 9.0) == training_share_of_best_matmul("amd", None) \
        == pytest.approx(0.58 / 0.801)
    # An MI300X (1,307 TFLOPS on paper) is no longer taken for 1.4 H100s: they compare as their
    # measured best matmuls do (781.9 and 792.1 TFLOPS).
    ratio = cluster.device_type("mi300x").effective_tflops / cluster.device_type("h100").effective_tflops
    assert ratio == pytest.approx(781.9 / 792.1, rel=0.01)
    assert share["h100-stated"] == 0.6
    # The Hopper share is of bf16 matmuls on tensor cores: fp32 on its own peak takes the CUDA-core
    # GEMMs' share, at least the 0.95 that public fp32 blocks reach of it over the whole block.
    gh200 = DeviceType("gh200", "nvidia", 96, 989, peak_tflops_fp32=67, compute_capability=9.0)
    assert gh200.effective_tflops_for("fp32") == pytest.approx(67 * FP32_MATMUL_SHARE)
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "peer_profile_bounds.json")) as f:
        fp32_tables = [t for t in json.load(f)["tables"] if t["fp32_import"] == "ok"]
    assert max(t["max_share_of_fp32_peak"] for t in fp32_tables) == pytest.approx(FP32_MATMUL_SHARE, abs=0.005)
