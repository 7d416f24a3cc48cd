"""Pipeline sends (DeepSpeed's and memx-run's partitioned sends: 1/TP per rank over the link, the
receiver's TP all-gather; an edge between TP degrees: one whole tensor per rank pair, broadcast
over the larger TP group) and DeepSpeed's fp32 all-reduce over DP. No torch."""

import numpy as np
import pytest
from estimates import cases_rows, cluster_file, estimated_plan

from memx_launch.planning import collectives as co, costmodel as cm
from memx_launch.planning.bridge import BridgePricing
from memx_launch.planning.data_parallel import data_parallel_sync_time, sync_allreduce_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.pipeline_sends import StageSends, send_parts
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
# Two nodes of 4 GPUs over one slow NIC each: a pipeline edge between them is the slow link.
CLUSTER_DICT = {"version": 1, "name": "two-nodes",
                "device_types": {"gpu": {"vendor": "nvidia", "memory_gib": 80, "peak_tflops": 312,
                                         "memory_bandwidth_gbps": 2039, "compute_capability": 8.0}},
                "nodes": [{"devices": {"gpu": 4}, "intra_node_gbps": 300}] * 2, "inter_node_gbps": 12.5}
CLUSTER = ClusterSpec.from_dict(CLUSTER_DICT)


def test_partitioned_sends_cross_the_slow_link_in_tp_pieces_and_gather_over_the_fast_one():
    nbytes = 2 * 4096 * MODEL.hidden_size * 2
    link = np.array([12.5, np.inf])  # stage 0 -> 1 between the nodes; the last stage sends nothing
    sends = StageSends(CLUSTER, BridgePricing(CLUSTER, {}))
    whole, split = (sends.seconds(nbytes, link, [4, 4], send_parts(TrainingSpec(partitioned_sends=p), [4, 4]),
                                  lambda: ["gpu", "gpu"]) for p in (False, True))
    assert whole[0] == pytest.approx(cm.p2p_time(nbytes, 12.5 * CLUSTER.link_efficiency))
    # A quarter over the network, then an all-gather over NVLink: faster, never below the quarter.
    assert cm.p2p_time(nbytes / 4, 12.5 * CLUSTER.link_efficiency) < split[0] < whole[0] / 2
    assert whole[1] == split[1] == 0.0
    # The receivers' device types are asked for only when the sends are partitioned (the search's hot path).
    assert sends.seconds(nbytes, link, [4, 4], send_parts(TrainingSpec(), [4, 4]), lambda: 1 / 0)[0] == whole[0]
    # TP 1, stages of different TP, or sequence parallelism's sends (split over TP already): nothing to partition.
    partitioned = TrainingSpec(partitioned_sends=True)
    assert send_parts(partitioned, [1, 1]).tolist() == [1, 1]
    assert send_parts(partitioned, [2, 4, 4]).tolist() == [1, 4, 1]  # the last edge: the wrap-around to TP 2
    assert send_parts(TrainingSpec(partitioned_sends=True, sequence_parallel=True), [4, 4]).tolist() == [1, 1]


def test_an_edge_between_tp_degrees_crosses_once_a_pair_and_the_larger_group_broadcasts():
    nbytes = 2 * 4096 * MODEL.hidden_size * 2
    link = np.array([12.5, 12.5])  # interleaved: the last stage feeds the first
    sends = StageSends(CLUSTER, BridgePricing(CLUSTER, {}))
    seconds = sends.seconds(nbytes, link, [2, 4], [1, 1], lambda: ["gpu", "gpu"])
    # Only the transfers toward the TP 4 stage broadcast: half its broadcast is charged to each way, on both edges.
    broadcast = float(co.collective_seconds("broadcast", nbytes, 4, 300 * CLUSTER.link_efficiency, 1, co.NVLINK))
    assert seconds == pytest.approx(cm.p2p_time(nbytes, 12.5 * CLUSTER.link_efficiency) + broadcast / 2, rel=1e-9)
    assert sends.receiving_seconds(nbytes, [4, 4], [1, 1], lambda: 1 / 0).tolist() == [0.0, 0.0]


def test_partitioned_sends_shorten_a_pipeline_across_nodes():
    def step(partitioned):
        training = TrainingSpec(global_batch_size=64, seq_len=4096, partitioned_sends=partitioned)
        return evaluate_layout(MODEL, CLUSTER, training, tp=4, pp=2, dp=1, micro_batch_size=1,
                               references=(1, 1, 1)).predicted_iteration_time_s
    assert step(True) < step(False)


def test_fp32_allreduce_sends_4_bytes_per_16_bit_gradient():
    zero1 = dict(setup="zero1", dtype="bf16")  # bf16 gradients
    plain, fp32 = TrainingSpec(**zero1), TrainingSpec(fp32_allreduce=True, **zero1)
    params = np.array(1e9)
    # A sharded setup moves gradients (reduce-scatter) and weights (all-gather): 2 + 2 -> 4 + 2.
    assert sync_allreduce_bytes(params, fp32) / sync_allreduce_bytes(params, plain) == pytest.approx(6 / 4)
    assert data_parallel_sync_time(params, fp32, 8, 100.0) > data_parallel_sync_time(params, plain, 8, 100.0)
    ddp = dict(setup="ddp")  # fp32 gradients already: nothing changes
    assert sync_allreduce_bytes(params, TrainingSpec(fp32_allreduce=True, **ddp)) == \
        sync_allreduce_bytes(params, TrainingSpec(**ddp))


def test_both_are_flags_and_cases_columns(tmp_path, capsys):
    base = ["--model", "llama2-7b", "--cluster", cluster_file(tmp_path, CLUSTER_DICT), "--global-batch-size", "64",
            "--seq-len", "4096"]
    layout = ["--tp", "4", "--pp", "2", "--dp", "1", "--micro-batch-size", "1"]
    plain = estimated_plan(tmp_path, "plain", [*base, *layout])
    sends = estimated_plan(tmp_path, "sends", [*base, *layout, "--partitioned-sends"])
    assert sends["training"]["partitioned_sends"] is True
    assert sends["predicted_iteration_time_s"] < plain["predicted_iteration_time_s"]
    rows = cases_rows(capsys, tmp_path, "id,tp,pp,dp,micro_batch_size,setup,partitioned_sends,fp32_allreduce\n"
                      "plain,4,1,2,1,zero1,,\nfp32,4,1,2,1,zero1,,true\nsends,4,2,1,1,,true,\n", base)
    assert rows["fp32"]["iteration_time_s"] > rows["plain"]["iteration_time_s"]
    assert rows["sends"]["iteration_time_s"] == pytest.approx(sends["predicted_iteration_time_s"])
