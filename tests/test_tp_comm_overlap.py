"""TP communication overlap (Megatron's --tp-comm-overlap): the TP collectives in chunks behind
the linear GEMMs; it needs sequence parallelism. No torch."""

import pytest
from one_node import A100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import tp_overlap
from memx_launch.planning.matmuls import (forward_backward_seconds, gemm_seconds, linear_seconds, linear_shapes,
                                          row_parallel_shapes)
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")


def _cluster(intra_node_gbps):
    return ClusterSpec.from_dict(one_node(A100, 8, intra_node_gbps))


def _layer(cluster, overlap, tp=8):
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", tp_comm_overlap=overlap)
    return cm.AnalyticalCostModel(MODEL, cluster, training).layer_costs(0, tp, 1, 4096, cm.NONE).time_s


def test_overlap_hides_tp_collectives_behind_the_gemms_but_never_the_first_chunk():
    """The collectives hide behind the GEMMs but for their first chunk; the GEMMs behind the
    forward reduce-scatters (the output and down projections) run on 16 of an A100's 108 SMs fewer."""
    fast = _cluster(300)
    plain, overlapped = _layer(fast, False), _layer(fast, True)
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron")
    model = cm.AnalyticalCostModel(MODEL, fast, training)
    comm = 4 * float(model.tp_allreduce_time(4096 * MODEL.hidden_size * 2, 0, 8))
    rate = (312e12 * 0.75, 2039e9, 108, 2)
    reduce_scattered = sum(float(gemm_seconds(4096, n, k, *rate)) for n, k in row_parallel_shapes(MODEL, training, 8))
    margin = float(tp_overlap.sm_margin_seconds(reduce_scattered, 108))
    assert margin == pytest.approx(reduce_scattered * 16 / 92) and margin > 0
    # Over NVLink the GEMMs cover all but the first of 8 chunks.
    assert plain - overlapped == pytest.approx(comm * 7 / 8 - margin, rel=1e-6)
    # Over a slow link the GEMMs cannot cover it: what exceeds them stays.
    slow = _cluster(5)
    linear = float(forward_backward_seconds(4096, linear_shapes(MODEL, training, 8), *rate))
    slow_plain, slow_overlapped = _layer(slow, False), _layer(slow, True)
    assert slow_plain - slow_overlapped == pytest.approx(linear - margin, rel=1e-6)
    assert _layer(fast, True, tp=1) == _layer(fast, False, tp=1)  # no TP, nothing to hide


def test_overlap_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match="--tp-comm-overlap: overlaps sequence parallelism.*--sequence-parallel"):
        TrainingSpec(tp_comm_overlap=True)
    TrainingSpec(tp_comm_overlap=True, sequence_parallel=True)


def _async(cluster, async_tp, recompute=cm.NONE, tp=8):
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="torchtitan", async_tp=async_tp)
    return cm.AnalyticalCostModel(MODEL, cluster, training).layer_costs(0, tp, 1, 4096, recompute).time_s


def test_torch_async_tp_hides_the_first_forward_s_collectives_only():
    """torch's AsyncTP: the first forward's two all-reduces' worth of gathers and scatters behind its
    GEMMs (all but the first chunk over NVLink), the backward's and the recompute's whole."""
    fast = _cluster(300)
    training = TrainingSpec(global_batch_size=64, seq_len=4096, setup="torchtitan")
    one = float(cm.AnalyticalCostModel(MODEL, fast, training).tp_allreduce_time(4096 * MODEL.hidden_size * 2, 0, 8))
    for recompute in (cm.NONE, cm.FULL):  # the recompute's collectives are not hidden
        assert _async(fast, False, recompute) - _async(fast, True, recompute) == pytest.approx(2 * one * 7 / 8,
                                                                                               rel=1e-6)
    # Less than Megatron's userbuffers hide (every pass's), more than nothing.
    assert _layer(fast, True) < _async(fast, True) < _async(fast, False)
    # Over a slow link the forward's GEMMs cannot cover it: what exceeds them stays.
    slow = _cluster(5)
    forward, _ = linear_seconds(4096, linear_shapes(MODEL, training, 8), 312e12 * 0.75, 2039e9, 108, 2)
    assert _async(slow, False) - _async(slow, True) == pytest.approx(float(forward), rel=1e-6)
    assert _async(fast, True, tp=1) == _async(fast, False, tp=1)
    with pytest.raises(ConfigError, match="--async-tp: and --tp-comm-overlap both hide"):
        TrainingSpec(setup="torchtitan", async_tp=True, tp_comm_overlap=True)
    with pytest.raises(ConfigError, match="--async-tp: micro-pipelines sequence parallelism.*--sequence-parallel"):
        TrainingSpec(setup="fsdp2", async_tp=True)
