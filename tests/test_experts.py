"""Mixtures of experts (``num_experts``, ``--expert-parallel``): the models' parameters as
published, Hugging Face configs, what a rank holds and shards, the experts' GEMMs and
all-to-alls, the layouts expert parallelism allows, what is refused, and the Megatron export.
No processes."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning import experts, host_time
from memx_launch.planning.elementwise import elementwise_traffic_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

GIB = 2**30
MIXTRAL = get_model("mixtral-8x7b")
QWEN3 = dataclasses.replace(get_model("qwen3-30b-a3b"), seq_len=4096)
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))
# What one of its GEMMs runs at: Hopper's default share of the peak, the sustained HBM rate, its SMs, bf16.
H100_GEMM = (H100["peak_tflops"] * 0.58e12, hbm_gbps(NODE.device_type("gpu")) * 1e9, 132, 2)
TWO_NODES = ClusterSpec.from_dict({"version": 1, "name": "two", "device_types": {"gpu": H100},
                                   "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 450}] * 2,
                                   "inter_node_gbps": 50})


def _training(**kw):
    return TrainingSpec(**{"global_batch_size": 64, "seq_len": 4096, "setup": "megatron", **kw})


def _estimate(model, training, cluster=NODE, **layout):
    return evaluate_layout(model, cluster, training, references=(1, 1, 1),
                           **{"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "recompute": "none", **layout})


def _active(model):
    return model.num_layers * (model.attention_params + model.active_mlp_params + 2 * model.norm_params) \
        + model.embedding_params + model.head_params


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                               ("qwen3-235b-a22b", 235e9, 22e9)])
def test_the_catalog_s_mixtures_have_their_published_parameters(name, total, active):
    model = get_model(name)
    assert model.total_params == pytest.approx(total, rel=0.01)
    assert _active(model) == pytest.approx(active, rel=0.03)


def test_hugging_face_configs_of_mixtures_of_experts():
    mixtral = model_from_hf_dict({"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
                                      "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                      "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}, "m")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.moe_ffn_hidden_size) == (8, 2, 14336)
    assert mixtral.total_params == MIXTRAL.total_params
    qwen2 = model_from_hf_dict({"model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048,
                                    "num_attention_heads": 16, "intermediate_size": 5632, "vocab_size": 151936,
                                    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                    "shared_expert_intermediate_size": 5632}, "q")
    assert (qwen2.moe_ffn_hidden_size, qwen2.shared_expert_ffn_hidden_size) == (1408, 5632)
    with pytest.raises(ConfigError, match="dense MLP blocks among the expert ones.*first_k_dense_replace"):
        model_from_hf_dict({"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                            "intermediate_size": 5632, "vocab_size": 151936, "num_experts": 60,
                            "num_experts_per_tok": 4, "mlp_only_layers": [0, 5]}, "qwen-moe")
    with pytest.raises(ConfigError, match="model.experts_per_token: 0 of 8 experts"):
        dataclasses.replace(MIXTRAL, experts_per_token=0)


def test_a_rank_holds_its_share_of_the_experts_and_shards_their_state_over_the_rest():
    one, eight = (_estimate(QWEN3, _training(expert_parallel=ep)).stages[0].memory_parts_gib for ep in (1, 8))
    experts_gib = QWEN3.num_layers * QWEN3.expert_params / GIB
    # bf16 weights and fp32 main grads: 2 + 4 bytes, 7/8 of the experts gone from each rank.
    assert one["parameters"] - eight["parameters"] == pytest.approx(2 * experts_gib * 7 / 8)
    assert one["gradients"] - eight["gradients"] == pytest.approx(4 * experts_gib * 7 / 8)
    # Adam's 12 bytes of the experts: sharded over DP 8 at EP 1, or on one rank whole of each
    # expert at EP 8, whose eighth of the experts it holds: the same bytes per rank either way.
    assert one["optimizer_states"] == pytest.approx(eight["optimizer_states"])
    dense_gib = (QWEN3.num_layers * (QWEN3.layer_params - QWEN3.expert_params) + QWEN3.embedding_params
                 + QWEN3.head_params) / GIB
    assert eight["optimizer_states"] == pytest.approx(12 * (experts_gib + dense_gib) / 8)
    sixteen = _estimate(QWEN3, _training(expert_parallel=8), TWO_NODES, dp=16).stages[0].memory_parts_gib
    assert eight["optimizer_states"] - sixteen["optimizer_states"] == pytest.approx(
        12 * experts_gib / 8 / 2 + 12 * (QWEN3.num_layers * (QWEN3.layer_params - QWEN3.expert_params)
                                        + QWEN3.embedding_params + QWEN3.head_params) / GIB * (1 / 8 - 1 / 16))


def test_fully_sharded_experts_are_gathered_over_their_expert_data_parallel_group_only():
    from memx_launch.planning.data_parallel import fully_sharded_exposed_time
    from memx_launch.planning.model_states import fully_sharded_layer_params, rank_layer_params
    training = _training(expert_parallel=8, setup="zero3", max_live_params=0.0)  # FSDP's units, bf16
    dense, experts = rank_layer_params(QWEN3, training, 1)
    assert experts == pytest.approx(QWEN3.expert_params / 8)
    # EP 8 over DP 8: each rank's experts are whole on it, nothing of theirs is gathered; over DP 16
    # two ranks share each expert and gather it.
    assert fully_sharded_layer_params(QWEN3, training, 1, 8) == (dense, 0.0)
    assert fully_sharded_layer_params(QWEN3, training, 1, 16) == (dense, pytest.approx(experts))
    args = (30 * (dense + experts), dense + experts, 30, 1e-3, training, 16, 160.0, 2)
    alone, shared = (float(fully_sharded_exposed_time(*args, expert_params=experts, expert_dp=n)) for n in (1, 2))
    dense_only = float(fully_sharded_exposed_time(30 * dense, dense, 30, 1e-3, training, 16, 160.0, 2))
    assert alone == pytest.approx(dense_only) and shared > alone
    # The estimate holds each part: at DP 16 a rank keeps half the experts' weights it keeps at
    # DP 8 (bf16, 2 bytes) but gathers a layer of them (two layers' buffers while prefetching).
    eight = _estimate(QWEN3, training).stages[0].memory_parts_gib
    sixteen = _estimate(QWEN3, training, TWO_NODES, dp=16).stages[0].memory_parts_gib
    experts_gib, dense_gib = QWEN3.num_layers * experts / GIB, (QWEN3.num_layers * dense + QWEN3.embedding_params
                                                                  + QWEN3.head_params) / GIB
    assert eight["parameters"] - sixteen["parameters"] == pytest.approx(
        2 * (experts_gib / 2 + dense_gib / 16) - 2 * 2 * experts / GIB, rel=1e-6)


def test_routed_experts_sync_their_gradients_over_their_expert_data_parallel_group_only():
    from memx_launch.planning.data_parallel import data_parallel_sync_time, stage_gradient_sync
    from memx_launch.planning.layouts import layout_from_stage_devices
    from memx_launch.planning.model_states import expert_parameters_per_rank, parameters_per_rank, rank_layer_params
    training = _training(expert_parallel=8, overlap_grad_reduce=False)  # Megatron's distributed optimizer
    dense, experts = rank_layer_params(QWEN3, training, 1)
    stage = 48 * (dense + experts)
    over_dp = float(data_parallel_sync_time(stage, training, 16, 160.0, 2))
    alone, shared = (float(data_parallel_sync_time(stage, training, 16, 160.0, 2, expert_params=48 * experts,
                                                   expert_dp=n)) for n in (1, 2))
    dense_only = float(data_parallel_sync_time(48 * dense, training, 16, 160.0, 2))
    assert alone == pytest.approx(dense_only) and dense_only < shared < over_dp
    # A stage at EP 8 on DP 8: each rank's experts are its own, only the dense parameters sync.
    layout = layout_from_stage_devices(QWEN3, NODE, ("gpu",), 1, 1, 8, None, 1)
    layers = np.array([[QWEN3.num_layers]])
    params = parameters_per_rank(QWEN3, training, layout, layers)
    experts_of_stage = expert_parameters_per_rank(QWEN3, training, layout, layers)
    assert experts_of_stage[0, 0] == pytest.approx(QWEN3.num_layers * experts)
    _, sync = stage_gradient_sync(QWEN3, training, layout, layers, 1, params, np.zeros_like(params), 450.0, 0.0)
    assert sync[0, 0] == pytest.approx(float(data_parallel_sync_time(params - experts_of_stage, training, 8, 450.0,
                                                                     layout.dp_nodes, layout.dp_hop)[0, 0]))


def test_experts_run_their_tokens_routed_and_exchange_them_by_all_to_all():
    # The device's time (the host's for 128 local experts' ops would hide it).
    alone, spread = (cm.AnalyticalCostModel(QWEN3, NODE, _training(expert_parallel=ep))
                     .layer_costs(0, 1, 1, 4096, cm.NONE, host=False).time_s for ep in (1, 8))
    # A rank's 4,096 tokens x top-8 over 128 experts: the same FLOPs either way, in 256 rows per
    # expert on one rank, in 2,048 per expert over eight; the thin GEMMs reach less of the peak.
    thin, wide = (float(sum(experts.expert_seconds(QWEN3, _training(expert_parallel=ep), 4096, 1, *H100_GEMM)))
                  for ep in (1, 8))
    assert thin > 1.5 * wide
    link = 450 * NODE.link_efficiency
    per_byte = experts.exchange_seconds_per_byte(QWEN3, _training(expert_parallel=8), NODE, "gpu")
    exchanged = float(experts.exchange_seconds(QWEN3, _training(expert_parallel=8), 4096, 1, per_byte))
    assert exchanged == pytest.approx(4 * (experts.ALL_TO_ALL_LATENCY_S + 4096 * 8 * 2048 * 2 * 7 / 8 / (link * 1e9)))
    assert float(alone - spread) == pytest.approx(thin - wide - exchanged, rel=1e-6)
    assert float(experts.exchange_seconds(QWEN3, _training(), 4096, 1, 1.0)) == 0.0
    # Beyond a node the share to the other node crosses the network: the group of 16 is slower.
    assert experts.ep_link_gbps(TWO_NODES, "gpu", 16) < experts.ep_link_gbps(TWO_NODES, "gpu", 8)
    # Never faster than the active matmuls at the peak (forward and backward: 3 x the forward).
    flops = 3 * float(cm.layer_forward_flops(QWEN3, 1, 4096, 1))
    assert float(alone) >= flops / (H100["peak_tflops"] * 1e12)


def test_overlapped_all_to_alls_cost_only_what_the_compute_does_not_hide():
    plain, hidden = (cm.AnalyticalCostModel(QWEN3, TWO_NODES, _training(expert_parallel=16, overlap_expert_comm=o))
                     .layer_costs(0, 1, 1, 4096, cm.NONE, host=False).time_s for o in (False, True))
    sixteen = _training(expert_parallel=16)
    exchange = float(experts.exchange_seconds(QWEN3, sixteen, 4096, 1,
                                              experts.exchange_seconds_per_byte(QWEN3, sixteen, TWO_NODES, "gpu")))
    compute = float(plain) - exchange
    assert float(hidden) == pytest.approx(compute + max(exchange - compute, 0.0))
    assert float(hidden) < float(plain)


def test_expert_parallelism_is_checked_and_the_search_keeps_it():
    with pytest.raises(ConfigError, match="--expert-parallel: 2, but llama2-7b has no experts"):
        _estimate(get_model("llama2-7b"), _training(expert_parallel=2))
    with pytest.raises(ConfigError, match="--expert-parallel: 3 does not divide the model's 128 experts"):
        _estimate(QWEN3, _training(expert_parallel=3), tp=1, dp=8)
    with pytest.raises(ConfigError, match="--expert-parallel: 8 does not divide a stage's TP x CP x DP = 4 ranks"):
        _estimate(QWEN3, _training(expert_parallel=8), pp=2, dp=4)
    with pytest.raises(ConfigError, match="--lora-rank: not modelled for the experts"):
        _estimate(QWEN3, _training(expert_parallel=8, lora_rank=16))
    best = search(QWEN3, TWO_NODES, _training(expert_parallel=8, global_batch_size=128), top_k=5,
                  space=SearchSpace(micro_batch_sizes=(1, 2))).plans
    assert best and all(p.tp * p.dp % 8 == 0 for p in best)
    assert all(p.training["expert_parallel"] == 8 for p in best)
    # Fully sharded too (FSDP2 with EP): the search prices each layout's expert group as the estimate does.
    sharded = search(QWEN3, TWO_NODES, _training(expert_parallel=8, setup="fsdp2", global_batch_size=128), top_k=3,
                     space=SearchSpace(micro_batch_sizes=(1,))).plans
    assert sharded and all(p.training["fully_sharded"] and p.training["expert_parallel"] == 8 for p in sharded)
    for plan in sharded[:1]:
        again = evaluate_layout(QWEN3, TWO_NODES, _training(expert_parallel=8, setup="fsdp2", global_batch_size=128),
                                references=(1, 1, 1), tp=plan.tp, pp=plan.pp, dp=plan.dp, micro_batch_size=1,
                                layers_per_stage=[s.num_layers for s in plan.stages],
                                recompute=[s.recompute for s in plan.stages], schedule=plan.schedule,
                                virtual_stages=plan.virtual_stages)
        assert again.predicted_iteration_time_s == pytest.approx(plan.predicted_iteration_time_s, rel=1e-6)


def test_memx_plan_chooses_the_expert_parallel_degree_unless_given(tmp_path, capsys):
    from estimates import cluster_file

    from memx_launch.cli import main
    from memx_launch.planning.plan import Plan

    assert experts.search_degrees(QWEN3, 16) == (1, 2, 4, 8, 16) and experts.search_degrees(MIXTRAL, 64) == (1, 2, 4, 8)
    assert experts.search_degrees(get_model("llama2-7b"), 16) == ()
    # A host that issues the MoE layer's ops faster than its device runs them: at EP 1-4 the
    # host's time for 32-128 local experts would rank every other degree after EP 8-16.
    result = search(QWEN3, TWO_NODES, _training(global_batch_size=128, host_ms_per_layer=0.01), top_k=20,
                    space=SearchSpace(micro_batch_sizes=(1, 2), expert_degrees=(1, 2, 4, 8, 16)))
    degrees = {p.training["expert_parallel"] for p in result.plans}
    assert len(degrees) > 1 and all(p.tp * p.dp % p.training["expert_parallel"] == 0 for p in result.plans)
    path = cluster_file(tmp_path, {"version": 1, "name": "two", "device_types": {"gpu": H100},
                                   "nodes": [{"devices": {"gpu": 8}, "intra_node_gbps": 450}] * 2,
                                   "inter_node_gbps": 50})
    args = ["plan", "--model", "qwen3-30b-a3b", "--cluster", path, "--global-batch-size", "128", "--seq-len", "4096",
            "--setup", "megatron", "--micro-batch-sizes", "1,2", "--quiet"]
    assert main([*args, "--json", str(tmp_path / "chosen.json")]) == 0
    chosen = Plan.load(str(tmp_path / "chosen.json"))
    assert chosen.training["expert_parallel"] > 1 and f"ep={chosen.training['expert_parallel']}" in capsys.readouterr().out
    assert main([*args, "--expert-parallel", "2", "--json", str(tmp_path / "given.json")]) == 0
    assert Plan.load(str(tmp_path / "given.json")).training["expert_parallel"] == 2


def test_the_megatron_export_builds_the_experts_in_megatron_core(tmp_path):
    from test_exporters import _megatron_config

    from memx_launch.planning.exporters import megatron_args
    from memx_launch.runtime.layout import rank_layout

    small = dataclasses.replace(QWEN3, num_layers=4, name="qwen3-moe-small")
    plan = _estimate(small, _training(expert_parallel=4, overlap_expert_comm=True), tp=2, dp=4)
    args = megatron_args(plan).args
    assert args[args.index("--expert-model-parallel-size") + 1] == "4"
    config = _megatron_config(plan, args)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 768)
    assert config.overlap_moe_expert_parallel_comm and config.delay_wgrad_compute
    # Each expert whole on one rank, as memx prices it: Megatron-Core's default would split it over TP 2.
    assert config.expert_tensor_parallel_size == 1 and config.tensor_model_parallel_size == 2
    # memx's runtime trains a mixture as its own module, every expert whole on each rank: not this plan.
    with pytest.raises(ConfigError, match=r"--plan: tp=2, expert parallelism over 4 rank\(s\).*TP 1, EP 1.*memx export"):
        rank_layout(plan, 0)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64,
                                                      "num_attention_heads": 4, "intermediate_size": 128,
                                                      "vocab_size": 100, "num_local_experts": 4,
                                                      "num_experts_per_tok": 1}))
    assert get_model(str(tmp_path)).num_experts == 4


def test_the_megatron_export_builds_gpt_oss_s_attention_sinks_and_clamped_glu_as_priced():
    """GPT-OSS exported as its recipe runs it (``--no-fused-activation``): quick GeGLU clamped at 7 with
    up offset by 1, learnable softmax offsets on Transformer Engine's cuDNN kernel, the activation
    unfused; megatron-core builds and validates that config."""
    from test_exporters import _megatron_config

    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from memx_launch.planning.exporters import megatron_args

    small = dataclasses.replace(get_model("gpt-oss-120b"), num_layers=4, full_attention_layers=2, name="gpt-oss-small")
    plan = _estimate(small, _training(expert_parallel=4, fused_activation=False), tp=1, dp=8)
    args = megatron_args(plan).args
    assert "--swiglu" not in args and args[args.index("--attention-backend") + 1] == "fused"
    config = _megatron_config(plan, args)
    assert (config.activation_func, config.gated_linear_unit) == (quick_gelu, True)
    assert (config.activation_func_clamp_value, config.glu_linear_offset) == (7.0, 1.0)
    assert config.softmax_type == "learnable" and not config.bias_activation_fusion
    fused = megatron_args(_estimate(small, _training(expert_parallel=4), tp=1, dp=8)).args
    assert "--no-bias-gelu-fusion" not in fused and _megatron_config(plan, fused).bias_activation_fusion
    # Granite SWA's sinks scale the output after the softmax: no Megatron-LM option, said in a note.
    scaled = megatron_args(_estimate(dataclasses.replace(small, attention_sink_scale=True),
                                     _training(expert_parallel=4), tp=1, dp=8))
    assert "--softmax-type" not in scaled.args and any("after the softmax" in note for note in scaled.notes)


def test_what_megatron_lm_has_no_option_for_is_said_in_a_note():
    """BLOOM's ALiBi biases (exported without positions, not as rotary ones), Gemma 4's value norm and
    per-layer inputs: each a note beside the arguments, none dropped silently."""
    from memx_launch.planning.exporters import megatron_args

    base = dataclasses.replace(get_model("llama2-7b"), num_layers=4, name="small")
    plain = megatron_args(_estimate(base, _training(), tp=1, dp=8)).notes
    assert not any("no such option" in note for note in plain)
    for field, value, words in (("alibi_attention", True, "ALiBi"), ("value_norm", True, "value head"),
                                ("per_layer_input_size", 256, "per-layer inputs")):
        exported = megatron_args(_estimate(dataclasses.replace(base, **{field: value}), _training(), tp=1, dp=8))
        assert [note for note in exported.notes if words in note] != [], field
        positions = exported.args[exported.args.index("--position-embedding-type") + 1]
        assert positions == ("none" if field == "alibi_attention" else "rope")


def test_sliding_windows_shrink_the_attention_of_the_blocks_that_have_them():
    gpt_oss = get_model("gpt-oss-120b")
    assert gpt_oss.total_params == pytest.approx(116.8e9, rel=0.001)  # published: 116.8B, 5.1B active
    assert _active(gpt_oss) - gpt_oss.embedding_params == pytest.approx(5.13e9, rel=0.01)
    # Half the blocks attend within 128 of 4,096 tokens: 2 w/s - (w/s)^2 of the causal half.
    w = 128 / 4096
    assert cm.attended_share(gpt_oss, 4096) == pytest.approx(0.5 + 0.5 * (2 * w - w * w))
    full = dataclasses.replace(gpt_oss, sliding_window=0, full_attention_layers=0)
    assert float(cm.causal_attention_flops(gpt_oss, 1, 4096, 1)) == pytest.approx(
        cm.attended_share(gpt_oss, 4096) * float(cm.causal_attention_flops(full, 1, 4096, 1)))
    assert cm.attended_share(dataclasses.replace(gpt_oss, sliding_window=8192), 4096) == 1.0  # wider than seq
    base = {"num_hidden_layers": 12, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512,
            "vocab_size": 1000, "sliding_window": 128}
    read = {name: model_from_hf_dict({**base, **extra}, name) for name, extra in (
        ("types", {"layer_types": ["sliding_attention", "full_attention"] * 6}),
        ("gemma3", {"model_type": "gemma3_text", "sliding_window_pattern": 6}),
        ("gemma2", {"model_type": "gemma2"}), ("mistral", {"model_type": "mistral"}),
        ("qwen2", {"model_type": "qwen2", "use_sliding_window": False}))}
    assert {n: (m.sliding_window, m.full_attention_layers) for n, m in read.items()} == {
        "types": (128, 6), "gemma3": (128, 2), "gemma2": (128, 6), "mistral": (128, 0), "qwen2": (0, 0)}


def test_the_other_exports_refuse_or_name_expert_parallelism():
    from memx_launch.planning.config_exports import deepspeed_json, torchtitan_toml

    plan = _estimate(QWEN3, _training(expert_parallel=8, setup="zero1"))
    with pytest.raises(ConfigError, match="plan: expert_parallel=8: torchtitan carves expert parallelism.*Megatron-LM"):
        torchtitan_toml(plan)
    assert any("8 expert-parallel ranks" in n for n in deepspeed_json(plan).notes)


def test_the_all_to_all_holds_against_megatron_core_s_measured_latencies():
    # NVIDIA's measured dispatch and combine of DeepSeek-V3's layer (arXiv 2603.07685, Table 7):
    # memx's uncalibrated all-to-all within 0.6-1.4 of each, and, as measured, several times
    # slower once an H100 group leaves its node (EP 8 -> 16: 4.6x measured).
    import csv
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import all_to_all_latency as a2a

    with open(a2a.DATA) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 16
    for r in rows:
        for dispatcher, measured in (("alltoall", "all_to_all_us"), ("flex", "hybridep_us")):
            assert 0.6 < a2a.predicted_us(r["system"], int(r["ep"]), dispatcher) / float(r[measured]) < 1.4, r
    assert a2a.predicted_us("dgx-h100", 16) > 3 * a2a.predicted_us("dgx-h100", 8)
    assert a2a.predicted_us("dgx-gb200", 16) < 1.2 * a2a.predicted_us("dgx-gb200", 8)  # one NVLink domain
    # HybridEP sends a token once per node across them (at most 4 of DeepSeek-V3's 8 groups):
    # measured 2.0x faster than the all-to-all at EP 64 on H100.
    assert 1.6 < a2a.predicted_us("dgx-h100", 64) / a2a.predicted_us("dgx-h100", 64, "flex") < 2.6


def test_the_flex_dispatcher_sends_a_token_once_per_rank_and_once_per_node():
    groupless = dataclasses.replace(get_model("deepseek-v3"), expert_groups=0, expert_groups_per_token=0)
    # Top-8 of 256 experts over 8 ranks of 32: a rank holds none of a token's with chance C(224, 8) / C(256, 8).
    assert experts._missed_share(groupless, 8) == pytest.approx(math.comb(224, 8) / math.comb(256, 8))
    # Group-limited: 4 of 8 groups, one a node of 8: a node is skipped half the time, else holds
    # none of the 8 drawn from the chosen groups' 128 experts with chance C(96, 8) / C(128, 8).
    assert experts._missed_share(get_model("deepseek-v3"), 8) == pytest.approx(
        0.5 + 0.5 * math.comb(96, 8) / math.comb(128, 8))
    flex, every_copy = (_training(expert_parallel=8, expert_dispatcher=d) for d in ("flex", "alltoall"))
    per_byte = experts.exchange_seconds_per_byte(QWEN3, flex, NODE, "gpu")
    link = 450 * NODE.link_efficiency * 1e9
    assert per_byte == pytest.approx(7 * (1 - experts._missed_share(QWEN3, 8)) / link)
    # The device's times: the exchanges, not the host's ops, tell the dispatchers apart.
    sent, sent_every = (float(cm.AnalyticalCostModel(QWEN3, NODE, tr).layer_costs(0, 1, 1, 4096, cm.NONE, host=False)
                              .time_s) for tr in (flex, every_copy))
    assert sent < sent_every
    with pytest.raises(ConfigError, match="--expert-dispatcher: unknown dispatcher 'deepep'; use one of alltoall, flex"):
        _training(expert_dispatcher="deepep")


def test_consecutive_routing_sends_a_token_to_the_ranks_of_its_k_neighbouring_experts():
    # NeMo AutoModel's fake balanced gate: token t to experts 8t .. 8t + 7. Qwen3's 128 experts over
    # EP 8 (16 a rank): one rank; DeepSeek-V3's 256 over EP 64 (4 a rank): two, on one node of 8;
    # Kimi K2's 384 over EP 32 (12 a rank): one rank for two tokens in three, two for the third.
    neighbours = _training(expert_routing="consecutive")
    reached = {name: units * experts.hit_share(get_model(name), neighbours, units)
               for name, units in (("qwen3-30b-a3b", 8), ("deepseek-v3", 64), ("kimi-k2", 32))}
    assert reached == pytest.approx({"qwen3-30b-a3b": 1.0, "deepseek-v3": 2.0, "kimi-k2": 4 / 3})
    assert experts.hit_share(get_model("deepseek-v3"), neighbours, 8) == pytest.approx(1 / 8)  # one node of 8
    # At random a token reaches more of them: DeepSeek-V3's top-8 over EP 64, 7.4 ranks (groups limit it).
    assert 64 * experts.hit_share(get_model("deepseek-v3"), _training(), 64) == pytest.approx(7.36, abs=0.01)
    random, consecutive = (_training(expert_parallel=8, expert_dispatcher="flex", expert_routing=r)
                           for r in ("random", "consecutive"))
    link = 450 * NODE.link_efficiency * 1e9
    assert experts.exchange_seconds_per_byte(QWEN3, consecutive, NODE, "gpu") == pytest.approx(7 * (1 / 8) / link)
    assert experts.exchange_seconds_per_byte(QWEN3, consecutive, NODE, "gpu") < \
        experts.exchange_seconds_per_byte(QWEN3, random, NODE, "gpu")
    # The all-to-all dispatcher sends every routed copy whichever experts they are.
    every_copy = [_training(expert_parallel=8, expert_routing=r) for r in ("random", "consecutive")]
    assert experts.exchange_seconds_per_byte(QWEN3, every_copy[0], NODE, "gpu") == \
        experts.exchange_seconds_per_byte(QWEN3, every_copy[1], NODE, "gpu")
    with pytest.raises(ConfigError, match="--expert-routing: unknown routing 'greedy'; use one of random, consecutive"):
        _training(expert_routing="greedy")


def _moe_layer_seconds(training, recompute=cm.NONE, seq=16):
    """One Qwen3-30B MoE layer on an H100 at a few tokens: host bound."""
    one = np.ones(1)
    return float(cm.AnalyticalCostModel(QWEN3, NODE, training).layer_costs(
        np.zeros(1, int), one, one, np.full(1, seq), np.full(1, recompute)).time_s[0])


def test_a_mixture_layer_takes_the_host_time_of_its_router_dispatch_and_each_local_expert():
    # The block's fused kernels at a launch each; the MoE layer's eager ops at what one took measured.
    block, per_op = host_time.FUSED_BLOCK_HOST_S, host_time.EAGER_OP_HOST_S
    for ep in (1, 8):
        local = QWEN3.num_experts / ep
        ops = sum(per_layer + per_expert * local for per_layer, per_expert in experts.MOE_HOST_OPS.values())
        assert _moe_layer_seconds(_training(expert_parallel=ep)) == pytest.approx(block + ops * per_op)
    # Recomputing the forward issues its ops again; a bigger host time per block scales them.
    forward = experts.MOE_HOST_OPS["forward"][0] + experts.MOE_HOST_OPS["forward"][1] * QWEN3.num_experts / 8
    assert _moe_layer_seconds(_training(expert_parallel=8), cm.FULL) - _moe_layer_seconds(_training(expert_parallel=8)) \
        == pytest.approx(0.5 * block + forward * per_op)
    slow_host = _training(expert_parallel=8, host_ms_per_layer=1e3 * block * 3)
    assert _moe_layer_seconds(slow_host) == pytest.approx(3 * _moe_layer_seconds(_training(expert_parallel=8)))
    # At 16,384 tokens a micro-batch the device, not the host, sets the time (at 4,096 the host does).
    big = _moe_layer_seconds(_training(expert_parallel=8), seq=16384)
    assert big > block + float(experts.host_ops(QWEN3, _training(expert_parallel=8))) * per_op


def test_a_mixture_layer_forward_waits_at_the_dispatcher_for_its_token_counts():
    """The host issues what follows the dispatcher's wait only once the device has run what precedes
    it: the two add up in the forward, where a layer without the wait takes the slower of the two."""
    training, block, per_op = _training(expert_parallel=8), host_time.FUSED_BLOCK_HOST_S, host_time.EAGER_OP_HOST_S
    (per_layer, per_expert), (before, before_per_expert) = experts.MOE_HOST_OPS["forward"], \
        experts.MOE_FORWARD_OPS_BEFORE_WAIT
    local = QWEN3.num_experts / 8
    after_wait = (per_layer - before + (per_expert - before_per_expert) * local) * per_op
    host = float(host_time.layer_host_seconds(QWEN3, training, block, cm.NONE))

    def issued(device, moe_forward=0.0, model=QWEN3, block_s=block):
        return float(host_time.issued_layer_seconds(model, training, block_s, cm.NONE, device, moe_forward))

    # A device three times the host's time, its forward all before the wait: the forward's device
    # part and the host's issue after the wait add up, the backward stays the device's.
    assert issued(3 * host) == pytest.approx(3 * host + after_wait)
    # Its forward all experts and exchanges after the wait: the host's issue of them overlaps them.
    assert issued(3 * host, moe_forward=host) == pytest.approx(3 * host)
    # Never faster than the host or the device; a dense layer takes the slower; a CPU stand-in (no
    # host time) its device's.
    for device in (0.1 * host, host, 3 * host):
        assert issued(device) >= max(host, device) - 1e-15
    dense = get_model("llama2-7b")
    dense_host = float(host_time.layer_host_seconds(dense, training, block, cm.NONE))
    assert issued(0.5 * dense_host, model=dense) == pytest.approx(dense_host)
    assert issued(3 * host, block_s=0.0) == pytest.approx(3 * host)
    # In the cost model: a layer of 4,096 tokens, host bound over the step, takes longer than either.
    one = np.ones(1)
    model = cm.AnalyticalCostModel(QWEN3, NODE, training)
    query = (np.zeros(1, int), one, one, np.full(1, 4096), np.full(1, cm.NONE))
    layer, device = (float(model.layer_costs(*query, host=h).time_s[0]) for h in (True, False))
    assert layer > max(device, float(model.layer_host_seconds(query[0], query[4])[0]))


def test_estimate_names_the_stages_whose_layers_the_host_sets(tmp_path, capsys):
    from estimates import cluster_file

    from memx_launch.cli import main
    from memx_launch.planning.estimate import host_bound_stages

    # Qwen3-30B at EP 8 on H100s: 16 local experts' ops take the host longer than 4,096 tokens take
    # the device, not 4 x 4,096; a dense block's 40 launches bind neither.
    for mbs, bound in ((1, True), (4, False)):
        plan = evaluate_layout(QWEN3, NODE, _training(expert_parallel=8), references=(1, 1, 1), tp=1, pp=1, dp=8,
                               micro_batch_size=mbs)
        found = host_bound_stages(plan, NODE)
        assert bool(found) == bound and all(b.host_s > b.device_s for b in found)
        if bound:
            one = cm.AnalyticalCostModel(QWEN3, NODE, _training(expert_parallel=8))
            assert [(b.stage, b.device_type, b.layers) for b in found] == [(0, "gpu", 48)]
            assert found[0].host_s == pytest.approx(float(one.layer_host_seconds(0, cm.NONE)))
            # The layer takes the host's time, and more: its forward waits for the device at the dispatcher.
            assert found[0].device_s < found[0].host_s <= float(one.layer_costs(0, 1, 1, 4096, cm.NONE).time_s)
    dense = get_model("llama2-7b")
    plan = evaluate_layout(dense, NODE, _training(), references=(1, 1, 1), tp=1, pp=1, dp=8, micro_batch_size=1)
    assert host_bound_stages(plan, NODE) == []
    path = cluster_file(tmp_path, one_node({**H100, "memory_gib": 200}, 8, 450))  # room for micro-batch 4
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", path, "--global-batch-size", "64", "--seq-len", "4096",
            "--setup", "megatron", "--tp", "1", "--pp", "1", "--dp", "8", "--expert-parallel", "8"]
    assert main([*args, "--micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "host bound: stage 0 (gpu): 48 of its 48 layers take the host" in out and "16 local experts" in out
    assert main([*args, "--micro-batch-size", "4"]) == 0 and "host bound" not in capsys.readouterr().out
    # memx plan says it of its winner.
    assert main(["plan", "--model", "qwen3-30b-a3b", "--cluster", path, "--global-batch-size", "64", "--seq-len", "4096",
                 "--setup", "megatron", "--expert-parallel", "8", "--micro-batch-sizes", "1", "--quiet"]) == 0
    assert "host bound: stage 0 (gpu)" in capsys.readouterr().out
    # A dense model behind a slow host: the block's host time, and no word of experts.
    assert main(["estimate", "--model", "llama2-7b", "--cluster", path, "--global-batch-size", "64", "--tp", "1",
                 "--pp", "1", "--dp", "8", "--micro-batch-size", "1", "--host-ms-per-layer", "100"]) == 0
    out = capsys.readouterr().out
    assert "host bound: stage 0 (gpu): 32 of its 32 layers take the host 100.0 ms each" in out and "experts" not in out


def test_the_mixture_host_ops_are_the_ones_counted_in_megatron_core():
    """The constants are benchmarks/moe_host_ops.py's counts of Megatron-Core's MoE layer."""
    counted = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "moe_host_ops.json").read_text())
    for direction, (per_layer, per_expert) in experts.MOE_HOST_OPS.items():
        fit = counted[direction]
        assert (fit["per_layer"], fit["per_local_expert"], fit["largest_miss"]) == (per_layer, per_expert, 0)
    assert all(row[f"{d}_ops"] == experts.MOE_HOST_OPS[d][0] + experts.MOE_HOST_OPS[d][1] * row["local_experts"]
               for row in counted["rows"] for d in ("forward", "backward"))
    # Of the forward's, those before the host waits for the token counts (the dispatcher's synchronisation).
    fit = counted["forward_before_wait"]
    assert (fit["per_layer"], fit["per_local_expert"], fit["largest_miss"]) == (*experts.MOE_FORWARD_OPS_BEFORE_WAIT, 0)
    # The host time per op is the file's measurement, within its run-to-run spread on that host.
    assert host_time.EAGER_OP_HOST_S * 1e6 == pytest.approx(counted["host_us_per_op"], rel=0.1)


def test_a_routed_copy_keeps_what_megatron_core_s_experts_keep():
    """benchmarks/moe_host_ops.py measured megatron-core's unfused experts keeping, per routed copy,
    the dispatched token (hidden 64), the gate-and-up output, silu(gate), the linear half plus its
    offset, the product the routing weights multiply and the down projection's input (6 x width
    32), and the weight itself; memx counts the same tensors (units: 2 bytes per hidden element)."""
    counted = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "moe_host_ops.json").read_text())
    h, f = counted["hidden_size"], counted["expert_width"]
    assert {row["kept_elements_per_routed_copy"] for row in counted["rows"]} == {h + 6 * f + 1}
    toy = ModelSpec("toy-moe", 1, h, 4, 4, 32, 256, 16, num_experts=4, experts_per_token=2, expert_ffn_hidden_size=f)
    kept, down = experts.kept_units(toy, 1, 1.0, False, dtype_bytes=2)
    router = 4.0 * toy.num_experts / h
    assert (kept - router + down) * h / 2 / toy.experts_per_token == pytest.approx(h + 6 * f)
    # Fused (Megatron's weighted SwiGLU keeps its input and the weights): the gate-and-up output only.
    fused, fused_down = experts.kept_units(toy, 1, 1.0, True, dtype_bytes=2)
    assert (fused - router + fused_down) * h / 2 / toy.experts_per_token == pytest.approx(h + 3 * f)


def test_the_all_to_all_dispatcher_sorts_a_rank_s_copies_into_expert_order_and_back():
    """Megatron-Core's all-to-all dispatcher receives a rank's copies in rank order and, where the
    rank holds several experts, sorts them into expert order (``sort_chunks_by_idxs``) and back
    before the combine: two more reads and writes of every copy each way, beyond permute and
    unpermute. The flex dispatcher delivers them grouped; a rank of one expert has nothing to
    sort; Transformers' blocks gather each expert's tokens instead."""
    tokens, h, k = 4096.0, QWEN3.hidden_size, QWEN3.experts_per_token
    permute_unpermute = 2 * (k + 1) * h * 2 * tokens
    sorted_twice = 4 * k * h * 2 * tokens
    every_copy, flex, one_each, transformers = (
        _training(expert_parallel=8), _training(expert_parallel=8, expert_dispatcher="flex"),
        _training(expert_parallel=128), _training(expert_parallel=8, transformers_blocks=True))
    assert experts.permutation_bytes(QWEN3, every_copy, tokens, 1, 2) == pytest.approx(permute_unpermute + sorted_twice)
    for training in (flex, one_each, transformers):
        assert experts.permutation_bytes(QWEN3, training, tokens, 1, 2) == pytest.approx(permute_unpermute)
    # The block's element-wise traffic moves by the sorts forward and again backward.
    sorted_, grouped = (elementwise_traffic_bytes(QWEN3, tr, 1, 4096, 1, cm.NONE) for tr in (every_copy, flex))
    assert float(sorted_ - grouped) == pytest.approx(2 * sorted_twice)
    assert experts.permutation_bytes(get_model("llama2-7b"), every_copy, tokens, 1, 2) == 0.0


def test_transformers_llama4_experts_run_every_token_through_every_expert():
    """Transformers' Llama 4 repeats each token to all its experts (scaled by the sigmoid router score, 0 off
    its top-k) and runs them as one bmm: its blocks' expert GEMMs take E / k times the rows Megatron-Core's
    routed ones take, and keep E copies a token; a model that routes (Qwen3's) is unchanged by the setup."""
    scout = get_model("llama4-scout")
    e, k = scout.num_experts, scout.experts_per_token
    routed, every = (experts.routed_tokens(scout, _training(transformers_blocks=blocks), 4096, 1)
                     for blocks in (False, True))
    assert float(every) == pytest.approx(float(routed) * e / k)
    assert (experts.copies_per_token(QWEN3, _training(transformers_blocks=True))
            == experts.copies_per_token(QWEN3, _training()) == QWEN3.experts_per_token)
    kept = [float(experts.kept_units(scout, 1, 1.0, False, 1, share, dtype_bytes=2)[0]) for share in (None, 1.0)]
    assert kept[1] > kept[0] * e / k / 2

