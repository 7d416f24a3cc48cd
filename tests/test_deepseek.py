"""DeepSeek-V3's blocks (``kv_lora_rank``, ``dense_layers``, ``mtp_layers``): the parameters as
published, its Hugging Face config, latent attention's linears, attention FLOPs and selective
recompute (Megatron's mla_up_proj), the dense first blocks on the first stage, the multi-token
prediction module on the last, the search, the Megatron export and the runtime's refusal. No
processes."""

import dataclasses

import pytest
from one_node import H100, one_node

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.planning.activations import activation_bytes
from memx_launch.planning.estimate import evaluate_layout
from memx_launch.planning.matmuls import linear_shapes
from memx_launch.planning.model_states import rank_layer_params
from memx_launch.planning.search import search
from memx_launch.planning.search_space import SearchSpace
from memx_launch.specs.catalog import get_model
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.training import TrainingSpec

GIB = 2**30
V3 = get_model("deepseek-v3")
HF_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
             "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
             "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
             "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
             "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
             "vocab_size": 129280, "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
             "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6}
# DeepSeek-V3's kinds of blocks at a size a test plans in a moment.
SMALL = dataclasses.replace(V3, name="deepseek-small", num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=8,
                            ffn_hidden_size=2816, vocab_size=32000, attention_head_dim=64, rope_head_dim=32,
                            v_head_dim=64, q_lora_rank=256, kv_lora_rank=128, num_experts=16, experts_per_token=2,
                            expert_ffn_hidden_size=256, shared_expert_ffn_hidden_size=256)
NODE = ClusterSpec.from_dict(one_node(H100, 8, 450))


def _training(**kw):
    return TrainingSpec(**{"global_batch_size": 32, "seq_len": 2048, "setup": "megatron", **kw})


def _estimate(model, training=None, **layout):
    return evaluate_layout(model, NODE, training or _training(), references=(1, 1, 1),
                           **{"tp": 1, "pp": 2, "dp": 4, "micro_batch_size": 1, "recompute": "none", **layout})


def test_deepseek_v3_has_its_published_parameters_and_reads_from_its_hugging_face_config():
    assert V3.total_params == pytest.approx(671.0e9, rel=0.001)  # published: 671B, 37B active
    active = (V3.num_layers * (V3.attention_params + 2 * V3.norm_params) + V3.dense_layers * V3.dense_block.mlp_params
              + (V3.num_layers - V3.dense_layers) * V3.active_mlp_params + V3.embedding_params + V3.head_params)
    assert active == pytest.approx(37e9, rel=0.02)
    # The module: one more block, its 2h x h projection and three norms (the embedding and head shared).
    assert V3.mtp_params == V3.layer_params + 2 * 7168**2 + 3 * 7168
    read = model_from_hf_dict(HF_CONFIG, "deepseek-v3")
    assert dataclasses.replace(read, rope_theta=V3.rope_theta, tensor_parallel_blocks=True) == V3
    lite = model_from_hf_dict({**HF_CONFIG, "q_lora_rank": None, "num_nextn_predict_layers": 0}, "lite")
    assert (lite.q_lora_rank, lite.mtp_layers) == (0, 0)
    assert lite.attention_params == V3.attention_params - (7168 * 1536 + 1536 + 1536 * 128 * 192) + 7168 * 128 * 192
    with pytest.raises(ConfigError, match="model.kv_lora_rank: 0, but q_lora_rank"):
        dataclasses.replace(V3, kv_lora_rank=0)
    with pytest.raises(ConfigError, match="model.dense_layers: set on a model without experts"):
        dataclasses.replace(get_model("llama3-8b"), dense_layers=2)
    with pytest.raises(ConfigError, match="model.dense_layers"):
        dataclasses.replace(V3, dense_layers=61)


def test_latent_attention_s_linears_flops_and_tensor_parallel_split():
    shapes = linear_shapes(V3, _training(), 1)[:5]
    norms = V3.q_lora_rank + V3.kv_lora_rank
    assert sum(float(n * k) for n, k in shapes) == V3.attention_params - norms
    # QK^T at 128 x (128 + 64), AV at 128 x 128: the causal half of 2 s^2 each.
    assert float(cm.causal_attention_flops(V3, 1, 4096, 1)) == pytest.approx(4096**2 * 128 * (192 + 128))
    # Megatron keeps the down projections whole on every TP rank; the heads' up projections split.
    dense_one, _ = rank_layer_params(V3, _training(), 1)
    dense_two, _ = rank_layer_params(V3, _training(), 2)
    assert float(dense_two) == pytest.approx((dense_one - V3.latent_attention_params) / 2 + V3.latent_attention_params)


def test_selective_recompute_of_latent_attention_is_megatron_s_mla_up_proj():
    from test_exporters import _megatron_config

    from memx_launch.planning.exporters import megatron_args

    levels = [activation_bytes(V3, 1, 4096, 1, level) for level in (cm.NONE, cm.SELECTIVE)]
    sbh = 4096 * 7168
    # Q, K and V go (heads' widths 2 x 24,576 + 4 x 20,480 over h); the latents stay.
    heads_qkv = (2 * V3.q_hidden_size + 4 * V3.kv_hidden_size) / 7168
    assert float(levels[0].activation_bytes - levels[1].activation_bytes) == pytest.approx(heads_qkv * sbh)
    assert float(levels[1].working_bytes - levels[0].working_bytes) == pytest.approx(heads_qkv * sbh)
    # The device's time (the host's for 256 local experts' ops at EP 1 would hide it).
    none, selective, full = (float(cm.AnalyticalCostModel(V3, NODE, _training())
                                   .layer_costs(0, 1, 1, 4096, level, host=False).time_s)
                             for level in (cm.NONE, cm.SELECTIVE, cm.FULL))
    assert none < selective < full
    plan = _estimate(SMALL, recompute="selective")
    args = megatron_args(plan).args
    assert args[args.index("--recompute-granularity"):][:4] == ["--recompute-granularity", "selective",
                                                                "--recompute-modules", "mla_up_proj"]
    assert _megatron_config(plan, args).recompute_modules == ["mla_up_proj"]


def test_the_dense_first_blocks_sit_on_the_first_stage():
    mixture = dataclasses.replace(SMALL, dense_layers=0, mtp_layers=0)
    dense_first = dataclasses.replace(SMALL, mtp_layers=0)
    plain, with_dense = (_estimate(m).stages for m in (mixture, dense_first))
    rank_moe, rank_dense = (sum(rank_layer_params(m, _training(), 1)) for m in (mixture, dense_first.dense_block))
    # bf16 weights: 2 bytes per parameter of three blocks turned dense, on the first stage only.
    assert with_dense[0].memory_parts_gib["parameters"] - plain[0].memory_parts_gib["parameters"] == pytest.approx(
        2 * 3 * float(rank_dense - rank_moe) / GIB)
    assert with_dense[1].memory_parts_gib == plain[1].memory_parts_gib
    for stages in (plain, with_dense):
        for stage in stages:
            assert sum(stage.memory_parts_gib.values()) == pytest.approx(stage.predicted_peak_memory_gib, abs=1e-5)
    # Megatron builds the blocks in order: all three in the first stage's first chunk.
    with pytest.raises(ConfigError, match="--layers-per-stage: \\[2, 6\\] puts 2 layers on the first stage.*"
                                          "at least 3 layers"):
        _estimate(dense_first, layers_per_stage=[2, 6])
    with pytest.raises(ConfigError, match="at least 4 layers"):
        _estimate(dense_first, schedule="interleaved", virtual_stages=2, layers_per_stage=[3, 5])


def test_the_multi_token_prediction_module_runs_on_the_last_stage():
    without, with_mtp = (_estimate(dataclasses.replace(SMALL, mtp_layers=n)) for n in (0, 1))
    first, last = (with_mtp.stages[i].memory_parts_gib for i in (0, 1))
    assert first == without.stages[0].memory_parts_gib
    # Its own logits for its loss, and on the last of two stages a copy of the word embeddings.
    assert last["logits_loss"] == pytest.approx(2 * without.stages[1].memory_parts_gib["logits_loss"])
    # bf16 weights of the module (its block whole at EP 1) and of the embedding's copy.
    assert last["parameters"] - without.stages[1].memory_parts_gib["parameters"] == pytest.approx(
        2 * (SMALL.mtp_params + SMALL.word_embedding_params) / GIB)
    assert with_mtp.stages[1].predicted_stage_time_s > without.stages[1].predicted_stage_time_s
    assert with_mtp.stages[0].predicted_stage_time_s == without.stages[0].predicted_stage_time_s


def test_the_search_keeps_the_dense_blocks_on_the_first_stage_and_the_export_builds_deepseek():
    from test_exporters import _megatron_config

    from memx_launch.planning.exporters import megatron_args, pipeline_layout

    plans = search(SMALL, NODE, _training(expert_parallel=4), top_k=5,
                   space=SearchSpace(micro_batch_sizes=(1, 2), pipeline_degrees=(2, 4))).plans
    assert plans and all(p.stages[0].num_layers >= SMALL.dense_layers + p.virtual_stages - 1 for p in plans)
    plan = _estimate(SMALL, _training(expert_parallel=4, expert_dispatcher="flex"), schedule="interleaved",
                     virtual_stages=2, layers_per_stage=[4, 4])
    assert pipeline_layout(plan) == "Et*3|t*2|t|t*2mL"  # the first chunk holds the three dense blocks
    args = megatron_args(plan).args
    config = _megatron_config(plan, args)
    assert config.multi_latent_attention and (config.q_lora_rank, config.kv_lora_rank) == (256, 128)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (64, 32, 64)
    assert config.moe_layer_freq == [0] * 3 + [1] * 5 and config.mtp_num_layers == 1
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (8, 4)


def test_memx_s_runtime_trains_deepseek_s_own_module_without_its_multi_token_prediction():
    """Its latent attention and experts train in the model's own module (memx-run refuses the catalog
    name, which memx's LLaMA would build: tests/test_launcher.py); its MTP module the model Transformers
    builds has none of."""
    from memx_launch.planning.runtime_support import as_memx_run_trains, runnable_model

    trained = as_memx_run_trains(runnable_model(V3))
    assert trained.mtp_layers == 0 and trained.kv_lora_rank == V3.kv_lora_rank and V3.mtp_layers == 1


def test_sixteen_bit_moments_take_eight_bytes_beside_fp32_master_weights_and_four_without_them():
    from memx_launch.planning.exporters import megatron_args

    plans = {d: _estimate(SMALL, _training(optimizer_dtype=d))
             for d in ("fp32", "bf16-moments", "bf16", "bf16-no-master")}
    states = {d: p.stages[1].memory_parts_gib["optimizer_states"] for d, p in plans.items()}
    assert states["bf16-moments"] == pytest.approx(states["fp32"] * 8 / 12)  # 4 + 2 + 2 bytes of 4 + 4 + 4
    assert states["bf16"] == pytest.approx(states["fp32"] * 6 / 12)
    # torch's Adam on bf16 weights: its two bf16 moments, no master copy, the weights as before.
    assert states["bf16-no-master"] == pytest.approx(states["fp32"] * 4 / 12)
    assert plans["bf16-no-master"].stages[1].memory_parts_gib["parameters"] == pytest.approx(
        plans["fp32"].stages[1].memory_parts_gib["parameters"])
    assert any("no master copy" in n for n in megatron_args(plans["bf16-no-master"]).notes)
    # Fully sharded as FSDP2 runs it, the 16-bit weights are what it shards.
    assert TrainingSpec(setup="fsdp2", optimizer_dtype="bf16-no-master").weights_dtype == "training"
    with pytest.raises(ConfigError, match="--optimizer-dtype: bf16-no-master updates 16-bit weights"):
        TrainingSpec(weights_dtype="fp32", optimizer_dtype="bf16-no-master")
    assert plans["bf16-moments"].training["optimizer_dtype"] == "training_moments"
    args = megatron_args(plans["bf16-moments"]).args
    assert args[args.index("--use-precision-aware-optimizer") + 1:][:6] == [
        "--main-params-dtype", "fp32", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
