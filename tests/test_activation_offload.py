"""Activation offloading (``--activation-offload-layers``, Megatron's --cpu-offloading-num-layers):
the offloaded layers' kept activations leave the device but for one in transit, their copies cost
only what the neighbouring layers' compute cannot hide at the device type's ``host_link_gbps``, a
stage keeps more layers than it offloads; and Megatron's fused activation keeps no silu(gate).
No torch."""

import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import activation_offload
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
GIB = 2**30


def _estimate(training, host_link_gbps=None, **layout):
    device = {**H100, **({"host_link_gbps": host_link_gbps} if host_link_gbps else {})}
    layout = {"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 2, "recompute": "none", **layout}
    return evaluate_layout(MODEL, ClusterSpec.from_dict(one_node(device, 8, 450)), training,
                           references=(1, 1, 1), **layout)


def _training(**kw):
    return TrainingSpec(global_batch_size=64, seq_len=4096, setup="megatron", **kw)


def test_offloaded_layers_leave_the_device_but_one_in_transit():
    kept, off = (_estimate(_training(activation_offload_layers=n)).stages[0] for n in (0, 12))
    per_layer = kept.memory_parts_gib["activations"] / MODEL.num_layers  # one micro-batch in flight at PP 1
    assert kept.memory_parts_gib["activations"] - off.memory_parts_gib["activations"] == pytest.approx(
        11 * per_layer, rel=0.02)
    assert off.predicted_peak_memory_gib == pytest.approx(sum(off.memory_parts_gib.values()))
    assert {k: v for k, v in kept.memory_parts_gib.items() if k != "activations"} == \
        {k: v for k, v in off.memory_parts_gib.items() if k != "activations"}


def test_copies_hide_behind_compute_on_a_fast_link_and_stall_on_a_slow_one():
    base = _estimate(_training()).predicted_iteration_time_s
    fast = _estimate(_training(activation_offload_layers=12), host_link_gbps=400).predicted_iteration_time_s
    slow = _estimate(_training(activation_offload_layers=12), host_link_gbps=5).predicted_iteration_time_s
    assert fast == pytest.approx(base)
    assert slow > base
    # A copy of c seconds behind a layer of t: out behind a forward (t/3), back behind a backward (2t/3).
    assert float(activation_offload.exposed_copy_seconds(3e9, 0.03, 100)) == pytest.approx(0.03 - 0.01 + 0.03 - 0.02)
    assert float(activation_offload.exposed_copy_seconds(0.5e9, 0.03, 100)) == 0.0


def test_a_stage_keeps_more_layers_than_it_offloads():
    with pytest.raises(ConfigError, match="--activation-offload-layers: 16, but a stage of the split .16, 16. holds "
                                          "16 layers.*offload at most 15"):
        _estimate(_training(activation_offload_layers=16), pp=2, dp=4)
    assert _estimate(_training(activation_offload_layers=15), pp=2, dp=4).stages[0].num_layers == 16
    with pytest.raises(ConfigError, match="--activation-offload-layers"):
        TrainingSpec(activation_offload_layers=-1)


def test_the_optimizer_offload_takes_the_device_s_host_link():
    pcie, c2c = (_estimate(_training(optimizer_offload=True), host_link_gbps=g).predicted_iteration_time_s
                 for g in (25, 400))
    assert c2c < pcie


def test_megatron_s_fused_swiglu_keeps_no_silu_of_the_gate():
    fused, torch_ops = (_estimate(_training(fused_activation=f)).stages[0].memory_parts_gib["activations"]
                        for f in (True, False))
    silu = MODEL.num_layers * 2 * 4096 * MODEL.ffn_hidden_size * 2 / GIB  # mbs 2 x seq x f, 2 bytes
    assert torch_ops - fused == pytest.approx(silu, rel=1e-6)
    assert TrainingSpec(setup="megatron").fused_activation and not TrainingSpec().fused_activation
