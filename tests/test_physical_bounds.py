"""Physical bounds over random layouts of every kind of model and precision memx expresses (dense,
wide heads, sliding windows, experts, latent attention with dense first blocks and multi-token
prediction, hybrids of Mamba, attention, MLP and expert layers; bf16, FP8, MXFP8, NVFP4; recompute, offloading): no
iteration is faster than its matmul FLOPs at the device's peak for its precision, and every stage's
memory is its parts, none negative. Seeded, no processes."""

import dataclasses

import numpy as np
import pytest

from memx_launch.planning import costmodel as cm
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.peaks import fp4_peak_tflops, fp8_peak_tflops
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

B200 = {"vendor": "nvidia", "memory_gib": 179, "peak_tflops": 2250, "memory_bandwidth_gbps": 8000,
        "compute_capability": 10.0, "host_link_gbps": 50}
CLUSTER = ClusterSpec.from_dict({"version": 1, "name": "b200x16", "device_types": {"b200": B200},
                                 "nodes": [{"devices": {"b200": 8}, "intra_node_gbps": 900}] * 2,
                                 "inter_node_gbps": 50})
MODELS = [dataclasses.replace(m, num_layers=8, full_attention_layers=m.full_attention_layers * 8 // m.num_layers)
          for m in map(get_model, ("llama3-8b", "qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b", "llama2-7b",
                                   "llama4-scout", "llama4-maverick"))]
MODELS.append(dataclasses.replace(get_model("deepseek-v3"), num_layers=8, dense_layers=1))
MODELS.append(dataclasses.replace(get_model("nemotron-h-56b"), num_layers=8, hybrid_pattern="M-M*M-M-"))
MODELS.append(dataclasses.replace(get_model("nemotron-3-nano-30b-a3b"), num_layers=8, hybrid_pattern="MEM*EMEM",
                                  num_kv_heads=8))  # TP 4 splits its KV heads
PRECISIONS = [{}, {"fp8": "current"}, {"fp8": "mxfp8", "fp8_params": True}, {"fp4": "nvfp4"}]


def _peak_flops(training):
    device = CLUSTER.device_types[0]
    if training.fp8:
        return fp8_peak_tflops(device) * 1e12
    return (fp4_peak_tflops(device) if training.fp4 else device.peak_tflops) * 1e12


@pytest.mark.parametrize("seed", range(24))
def test_no_layout_beats_its_flops_at_the_peak_and_its_memory_is_its_parts(seed):
    rng = np.random.default_rng(seed)
    model = MODELS[seed % len(MODELS)]
    tp, pp = (int(x) for x in rng.choice([1, 2, 4], 2))
    dp, mbs, seq = 16 // (tp * pp), int(rng.choice([1, 2])), int(rng.choice([1024, 4096]))
    ep = int(rng.choice([e for e in (1, 2, 4, 8) if (tp * dp) % e == 0 and model.num_experts % e == 0]
                        or [1])) if model.num_experts else 1
    training = TrainingSpec(global_batch_size=dp * mbs * 4, seq_len=seq, setup="megatron", expert_parallel=ep,
                            activation_offload_layers=int(rng.integers(0, 8 // pp)),
                            **PRECISIONS[int(rng.integers(len(PRECISIONS)))])
    plan = evaluate_layout(model, CLUSTER, training, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs,
                           recompute=str(rng.choice(["none", "selective", "full"])), references=(1, 1, 1))
    tokens = training.global_batch_size * seq
    # Every block's forward, input-gradient and weight-gradient matmuls (3 x the forward) over the
    # world's peak for the precision (the linears' at most: attention runs in 16 bits).
    dense = model.dense_layers * float(cm.layer_forward_flops(model.dense_block, 1, seq, 1)) if model.dense_layers else 0
    blocks = (model.num_layers - model.dense_layers) * float(cm.layer_forward_flops(model, 1, seq, 1)) + dense
    flops = 3.0 * blocks * tokens / seq
    assert plan.predicted_iteration_time_s >= flops / (16 * _peak_flops(training)), plan.stages
    for stage in plan.stages:
        parts = stage.memory_parts_gib
        assert min(parts.values()) >= 0.0, parts
        assert sum(parts.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-5)  # its 6 decimals
