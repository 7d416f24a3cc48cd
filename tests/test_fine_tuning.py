"""Setups of 2026 that memx expresses: TF32 for fp32, fine-tuning with frozen parameters and
LoRA, and the optimizer offloaded to the host (memory, time, flags and --cases columns)."""

import json

import pytest

from memx_launch.cli import main
from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.data_parallel import data_parallel_sync_time
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.optimizer_step import HOST_ADAM_S_PER_PARAM, optimizer_step_seconds
from memx_launch.planning.peaks import training_tflops
from memx_launch.specs.bridge import HOST_COPY_GBPS
from memx_launch.specs.efficiency import FP32_MATMUL_SHARE
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

MODEL = get_model("llama2-7b")
A100 = dict(vendor="nvidia", memory_gib=80, peak_tflops=312, peak_tflops_fp32=19.5, memory_bandwidth_gbps=2039,
            compute_capability=8.0)


def _cluster(**device):
    return ClusterSpec.from_dict({"version": 1, "device_types": {"gpu": {**A100, **device}},
                                  "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 300}]})


def _estimate(training, **layout):
    return evaluate_layout(MODEL, _cluster(), training, **{"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1,
                                                          "recompute": "full", "references": (1, 1, 1), **layout})


def test_tf32_runs_fp32_matmuls_at_half_the_16_bit_peak_on_ampere_and_later_only():
    a100 = DeviceType(name="a", **A100)
    fp32, tf32 = TrainingSpec(dtype="fp32"), TrainingSpec(dtype="fp32", tf32=True)
    assert training_tflops(a100, fp32) == pytest.approx(19.5 * FP32_MATMUL_SHARE)  # CUDA-core GEMMs
    assert training_tflops(a100, tf32) == pytest.approx(312 / 2 * 0.75)
    assert training_tflops(a100, TrainingSpec(tf32=True)) == training_tflops(a100, TrainingSpec())  # bf16
    for old in (dict(compute_capability=7.0), dict(vendor="amd")):  # V100, an AMD GPU: no TF32
        device = DeviceType(name="o", **{**A100, **old})
        assert training_tflops(device, tf32) == training_tflops(device, fp32)
    slow = cm.AnalyticalCostModel(MODEL, _cluster(), TrainingSpec(dtype="fp32", global_batch_size=64)
                                  ).layer_costs(0, 1, 4, 4096, 0).time_s
    fast = cm.AnalyticalCostModel(MODEL, _cluster(), TrainingSpec(dtype="fp32", global_batch_size=64, tf32=True)
                                  ).layer_costs(0, 1, 4, 4096, 0).time_s
    assert fast < slow / 3


def test_frozen_weights_keep_no_gradients_or_optimizer_states():
    trained = cm.trained_parameters(MODEL, TrainingSpec(frozen_fraction=0.75))
    weights, grads, optim = cm.model_state_bytes_by_part(TrainingSpec(), 1, trained)
    assert (weights, grads, optim) == (2.0, pytest.approx(0.25 * 4), pytest.approx(0.25 * 12))
    full, frozen = (_estimate(TrainingSpec(global_batch_size=64, frozen_fraction=f)) for f in (0.0, 1.0))
    # 16 of 18 bytes per parameter go: the 7B model's gradients and Adam states.
    saved = (full.stages[0].predicted_peak_memory_gib - frozen.stages[0].predicted_peak_memory_gib) * 2**30
    assert saved == pytest.approx(16 * MODEL.total_params, rel=0.01)
    # Tied embeddings' ends sum the gradient of its trained share only (memx-run skips a frozen one).
    from memx_launch.planning.data_parallel import tied_gradient_bytes

    tied = get_model("opt-350m")
    summed = [tied_gradient_bytes(tied, 2, 1, TrainingSpec(frozen_fraction=f)) for f in (0.0, 0.75, 1.0)]
    assert summed == [tied.word_embedding_params * 4, pytest.approx(0.25 * tied.word_embedding_params * 4), 0.0]


def test_lora_trains_adapters_only_and_skips_the_base_weight_gradients():
    lora = TrainingSpec(global_batch_size=64, lora_rank=16)
    assert lora.frozen_fraction == 1.0
    h, kv, f = 4096, 4096, 11008  # LLaMA-2-7B: q, k, v, o, gate, up, down
    width = 2 * h + 2 * (h + kv) + 2 * h + 2 * (h + f) + (f + h)
    trained = cm.trained_parameters(MODEL, lora)
    assert trained.adapters == pytest.approx(16 * width / MODEL.layer_params)
    weights, grads, optim = cm.model_state_bytes_by_part(lora, 1, trained)
    assert (grads, optim) == (pytest.approx(4 * trained.adapters), pytest.approx(12 * trained.adapters))
    # Time: the base's weight-gradient GEMMs go (a third of the matmuls), the adapters' FLOPs come.
    mbs, seq = 4, 4096
    full = cm.AnalyticalCostModel(MODEL, _cluster(), TrainingSpec(global_batch_size=64))
    tuned = cm.AnalyticalCostModel(MODEL, _cluster(), lora)
    tflops = A100["peak_tflops"] * 0.75 * 1e12
    matmul = 2.0 * mbs * seq * (MODEL.attention_params + MODEL.mlp_params)
    adapters = 2.0 * mbs * seq * 16 * width
    saved = float(full.layer_costs(0, 1, mbs, seq, 0).time_s - tuned.layer_costs(0, 1, mbs, seq, 0).time_s)
    assert saved == pytest.approx((matmul - 3 * adapters) / tflops, rel=1e-6)
    # The DP all-reduce carries the adapters' gradients only.
    assert float(data_parallel_sync_time(1e9, lora, 8, 100.0, trained=trained)) < \
        0.02 * float(data_parallel_sync_time(1e9, TrainingSpec(), 8, 100.0))
    with pytest.raises(ConfigError, match="--frozen-fraction"):
        TrainingSpec(lora_rank=16, frozen_fraction=0.5)
    with pytest.raises(ConfigError, match="--frozen-fraction"):
        TrainingSpec(frozen_fraction=1.5)


def test_an_offloaded_optimizer_leaves_the_gpu_and_pays_pcie_and_host_adam():
    offload = TrainingSpec(global_batch_size=64, optimizer_offload=True)
    assert cm.model_state_bytes_by_part(offload, 1)[2] == 0.0
    params = 1e9
    step = float(optimizer_step_seconds(params, offload, 2039.0, 8))
    assert step == pytest.approx(params * (4 + 2) / (HOST_COPY_GBPS * 1e9) + params * HOST_ADAM_S_PER_PARAM)
    sharded = TrainingSpec(optimizer_offload=True, distributed_optimizer=True)
    assert float(optimizer_step_seconds(params, sharded, 2039.0, 8)) == pytest.approx(
        (params / 8) * (4 + 2) / (HOST_COPY_GBPS * 1e9) + params / 8 * HOST_ADAM_S_PER_PARAM)
    plain, offloaded = _estimate(TrainingSpec(global_batch_size=64)), _estimate(offload)
    saved = (plain.stages[0].predicted_peak_memory_gib - offloaded.stages[0].predicted_peak_memory_gib) * 2**30
    assert saved == pytest.approx(12 * MODEL.total_params, rel=0.01)  # fp32 master weights and moments
    assert offloaded.predicted_iteration_time_s > plain.predicted_iteration_time_s


def test_each_is_a_cases_column_and_an_estimate_flag(tmp_path, capsys):
    cluster = tmp_path / "a100.yaml"
    cluster.write_text(json.dumps({"version": 1, "device_types": {"gpu": A100},
                                   "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 300}]}))
    cases = tmp_path / "cases.csv"
    cases.write_text("id,dtype,tf32,frozen_fraction,lora_rank,optimizer_offload\n"
                     "base,fp32,,,,\ntf32,fp32,true,,,\nfrozen,fp32,,0.5,,\nlora,fp32,,,8,\noffload,fp32,,,,yes\n")
    common = ["--model", "llama2-7b", "--cluster", str(cluster), "--global-batch-size", "64"]
    assert main(["estimate", "--cases", str(cases), *common]) == 0
    rows = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert all("error" not in r for r in rows.values()), rows
    base = rows["base"]
    assert rows["tf32"]["iteration_time_s"] < base["iteration_time_s"] / 2
    assert rows["lora"]["peak_memory_gib"] < rows["frozen"]["peak_memory_gib"] < base["peak_memory_gib"]
    assert rows["offload"]["peak_memory_gib"] < base["peak_memory_gib"]
    out = tmp_path / "lora.json"
    assert main(["estimate", *common, "--dtype", "fp32", "--tp", "1", "--pp", "1", "--dp", "8",
                 "--micro-batch-size", "1", "--lora-rank", "8", "--json", str(out)]) == 0
    capsys.readouterr()
    plan = json.loads(out.read_text())
    assert plan["training"]["lora_rank"] == 8 and plan["training"]["frozen_fraction"] == 1.0
    assert max(s["predicted_peak_memory_gib"] for s in plan["stages"]) == pytest.approx(rows["lora"]["peak_memory_gib"],
                                                                              rel=1e-6)
