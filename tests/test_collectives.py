"""Collectives as NCCL runs them (planning/collectives.py) and where the cost model uses them."""

import numpy as np
import pytest

from memx_launch.planning import collectives as co
from memx_launch.planning.data_parallel import data_parallel_sync_time
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.node import PCIE_STAGED_SHARE
from memx_launch.specs.training import TrainingSpec

SIZES = np.logspace(3, 10, 29)


@pytest.mark.parametrize("op,moved", [("all_reduce", 2.0), ("reduce_scatter", 1.0), ("all_gather", 1.0)])
@pytest.mark.parametrize("ranks,nodes", [(2, 1), (8, 1), (64, 8), (1536, 192)])
def test_never_faster_than_the_bus_bandwidth(op, moved, ranks, nodes):
    """Physical bound: a collective moves (n-1)/n of the buffer (twice for an all-reduce) through
    every rank's link; no algorithm or protocol beats that at the bus bandwidth."""
    busbw = 150.0
    t = co.collective_seconds(op, SIZES, ranks, busbw, nodes)
    floor = moved * (ranks - 1) / ranks * SIZES / (busbw * 1e9)
    assert (t >= floor * (1 - 1e-12)).all()
    assert (np.diff(t) > 0).all()  # more bytes never take less time


def test_ring_latency_is_per_step():
    """A tiny reduce-scatter is latency bound: 2(n-1)-step all-reduces and (n-1)-step rings grow
    with the group, a step across nodes costs more than one inside a node."""
    small = [float(co.collective_seconds("reduce_scatter", 1024, n, 150.0, 1)) for n in (2, 4, 8)]
    assert small[0] < small[1] < small[2]
    one_node = float(co.collective_seconds("reduce_scatter", 1024, 8, 150.0, 1))
    two_nodes = float(co.collective_seconds("reduce_scatter", 1024, 8, 150.0, 2))
    assert two_nodes > one_node
    # 1,536 ranks: thousands of ring steps, milliseconds for a 1 MB gather.
    assert float(co.collective_seconds("all_gather", 1e6, 1536, 150.0, 192)) > 1e-3


def test_large_messages_reach_the_bus_bandwidth_small_ones_do_not():
    busbw = 150.0
    t = co.collective_seconds("all_reduce", np.array([1e5, 1e9]), 8, busbw, 1)
    reached = 2 * 7 / 8 * np.array([1e5, 1e9]) / t / 1e9
    assert reached[1] > 0.9 * busbw and reached[0] < 0.2 * busbw


def test_tree_keeps_large_all_reduces_cheap_but_not_gathers():
    """The tree (all-reduce only) pays log2(nodes) network hops: a small all-reduce over 1,536
    ranks costs far less than a ring all-gather, which has no tree."""
    allreduce = float(co.collective_seconds("all_reduce", 1e6, 1536, 150.0, 192))
    gather = float(co.collective_seconds("all_gather", 1e6, 1536, 150.0, 192))
    assert allreduce < gather / 4


def test_pcie_hops_are_slower_than_nvlink():
    nvlink = float(co.collective_seconds("all_reduce", 64e3, 4, 50.0, 1, co.NVLINK))
    pcie = float(co.collective_seconds("all_reduce", 64e3, 4, 50.0, 1, co.PCI))
    assert pcie > nvlink


def test_one_rank_or_no_bytes_cost_nothing_and_bad_op_is_named():
    assert float(co.collective_seconds("all_reduce", 1e9, 1, 150.0)) == 0.0
    assert float(co.collective_seconds("all_gather", 0, 8, 150.0)) == 0.0
    with pytest.raises(ValueError, match="all_to_all"):
        co.collective_seconds("all_to_all", 1e6, 8, 150.0)


def test_buckets_each_pay_latency():
    total = 4e9
    one = float(co.bucketed_seconds("reduce_scatter", total, np.inf, 256, 150.0, 32))
    many = float(co.bucketed_seconds("reduce_scatter", total, 80e6, 256, 150.0, 32))
    assert many > one
    # 50 buckets: 49 more ring latencies than one collective, each at least a tiny message's.
    assert many - one >= 49 * float(co.collective_seconds("reduce_scatter", 1.0, 256, 150.0, 32))


def _dgx(world, intra=300.0, **node):
    return ClusterSpec.from_dict({"version": 1, "device_types": {"g": {"vendor": "nvidia", "memory_gib": 80,
                                                                     "peak_tflops": 312}},
                                  "nodes": [{"devices": {"g": min(world, 8)}, "intra_node_gbps": intra, **node}
                                            for _ in range(max(world // 8, 1))],
                                  "inter_node_gbps": 25})


def test_data_parallel_sync_grows_with_the_group_at_equal_bytes():
    """Megatron's buckets (overlap_grad_reduce) are ring reduce-scatters and all-gathers: their
    latency grows with the DP degree, so the same gradients take longer over more ranks."""
    training = TrainingSpec(setup="megatron")
    times = [float(data_parallel_sync_time(7e9, training, dp, 160.0, dp // 8)) for dp in (16, 128, 1024)]
    assert times[0] < times[1] < times[2]


def test_pcie_nodes_stage_through_the_host():
    """A node whose GPUs talk over PCIe (intra link of PCIe's class, or gpu_link: pcie) gives
    collectives PCIE_STAGED_SHARE of its link; NVLink nodes all of it; a detected cluster
    (link_efficiency 1.0: measured bus bandwidth) keeps its figure."""
    pcie = _dgx(8, intra=32.0)
    assert pcie.group_gbps(list(range(4))) == pytest.approx(32.0 * PCIE_STAGED_SHARE)
    assert _dgx(8).group_gbps(list(range(4))) == 300.0
    said = _dgx(8, intra=100.0, gpu_link="pcie")
    assert said.group_gbps([0, 1]) == pytest.approx(100.0 * PCIE_STAGED_SHARE)
    measured = ClusterSpec.from_dict({**{"version": 1, "link_efficiency": 1.0,
                                         "device_types": {"g": {"memory_gib": 24, "peak_tflops": 120}}},
                                      "nodes": [{"devices": {"g": 4}, "intra_node_gbps": 12.0}]})
    assert measured.group_gbps([0, 1, 2, 3]) == 12.0


def test_bad_gpu_link_is_one_line_naming_the_field():
    from memx_launch.errors import ConfigError
    with pytest.raises(ConfigError, match="gpu_link"):
        _dgx(8, gpu_link="nvswitch")


def test_zero3_gathers_hide_behind_compute_until_they_outlast_it():
    """Per micro-batch each layer gathers twice and reduce-scatters once; prefetching hides them
    behind the micro-batch's compute, all but the first gather; over 1,536 ranks the ring's
    steps make them outlast a short micro-batch."""
    from memx_launch.planning.data_parallel import fully_sharded_exposed_time
    training = TrainingSpec(setup="zero3")
    layer, layers = 200e6, 32
    args = (32 * layer, layer, layers)
    long = float(fully_sharded_exposed_time(*args, 10.0, training, 64, 160.0, 8))
    first = float(co.collective_seconds("all_gather", layer * 2, 64, 160.0, 8))
    assert long == pytest.approx(first)
    short_small = float(fully_sharded_exposed_time(*args, 0.05, training, 64, 160.0, 8))
    short_large = float(fully_sharded_exposed_time(*args, 0.05, training, 1536, 160.0, 192))
    assert first < short_small < short_large


def test_collectives_beside_compute_slow_it_by_the_sms_they_hold():
    """A collective holds COLLECTIVE_CTAS SMs: compute beside it loses that share for as long as
    both run; what outlasts the compute is exposed whole. A CPU has no SMs to lose."""
    share = co.collective_sm_share([132, 108, 0])
    assert share == pytest.approx([24 / 132, 24 / 108, 0.0])
    hidden = co.overlapped_exposed_seconds(0.2, 1.0, share[0])
    assert hidden == pytest.approx(0.2 * 24 / 132)
    assert co.overlapped_exposed_seconds(3.0, 1.0, share[0]) == pytest.approx(2.0)
    assert co.overlapped_exposed_seconds(0.2, 1.0, 0.0) == 0.0
    comm, compute = np.linspace(0, 3, 31)[:, None], np.linspace(0.1, 3, 30)[None, :]
    exposed = co.overlapped_exposed_seconds(comm, compute, share[1])
    assert (exposed >= np.maximum(comm - compute, 0.0)).all() and (exposed <= comm).all()


def test_zero3_gathers_cost_what_their_sms_take_from_the_compute_they_hide_behind():
    from memx_launch.planning.data_parallel import fully_sharded_exposed_time
    training = TrainingSpec(setup="zero3")
    layer = 200e6
    args = (32 * layer, layer, 32, 10.0, training, 64, 160.0, 8)
    free, held = (float(fully_sharded_exposed_time(*args, sm_share=s)) for s in (0.0, 0.25))
    gathers = float(32 * (2 * co.collective_seconds("all_gather", layer * 2, 64, 160.0, 8)
                          + co.collective_seconds("reduce_scatter", layer * 2, 64, 160.0, 8)))
    assert gathers < 10.0 and held - free == pytest.approx(0.25 * gathers, rel=0.05)


def test_sm_count_is_read_and_checked():
    from memx_launch.errors import ConfigError
    spec = {"version": 1, "nodes": [{"devices": {"g": 1}, "intra_node_gbps": 450}]}
    device = {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 756, "compute_capability": 9.0}
    cluster = ClusterSpec.from_dict({**spec, "device_types": {"g": {**device, "sm_count": 114}}})
    assert cluster.device_types[0].sm_count == 114
    with pytest.raises(ConfigError, match="sm_count"):
        ClusterSpec.from_dict({**spec, "device_types": {"g": {**device, "sm_count": 0}}})
