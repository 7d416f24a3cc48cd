"""The Hugging Face configs of 2025-26 model families: Llama 4's chunked attention, shared expert
and multimodal wrapper read as they are; the hybrid and recurrent families (linear attention,
Mamba) refused by the field that names their other blocks, never planned as attention."""

import dataclasses
import json

import numpy as np
import pytest

from memx_launch.errors import ConfigError
from memx_launch.planning import costmodel as cm
from memx_launch.specs.catalog import get_model
from memx_launch.specs.hf_config import model_from_hf_dict

# Llama-4-Scout-17B-16E's config.json as Meta publishes it (the vision part cut to its type).
SCOUT = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
         "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408, "num_hidden_layers": 34},
         "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                         "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                         "intermediate_size": 8192, "intermediate_size_mlp": 16384, "vocab_size": 202048,
                         "max_position_embeddings": 10485760, "num_local_experts": 16, "num_experts_per_tok": 1,
                         "interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "no_rope_layers": [],
                         "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "use_qk_norm": True}}
SMALL = {"num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512,
         "vocab_size": 1000}


def _kept_as_built_and_stripped(build, strip, position_of, seq, hidden) -> list:
    """Bytes autograd saves for a Hugging Face module's forward in bf16 on CPU (its parameters,
    input and position tables not counted): as ``build()`` makes it, and with ``strip(module)``
    having taken some of its norms out."""
    import torch
    from memx_launch.profiling.saved_tensors import saved_storage_bytes

    kept = []
    for stripped in (False, True):
        module = build().to(torch.bfloat16)
        if stripped:
            strip(module)
        x = torch.randn(1, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        position = position_of(x)
        kept.append(saved_storage_bytes(lambda: module(x, position, None), owned=(*module.parameters(), x, *position)))
    return kept


def _active(model):
    return model.num_layers * (model.attention_params + model.active_mlp_params + 2 * model.norm_params) \
        + model.embedding_params + model.head_params


def test_llama4_is_read_from_its_multimodal_config_as_the_catalog_holds_it():
    scout = model_from_hf_dict(SCOUT, "llama4-scout")
    # memx-run has no Llama 4 blocks of its own: read from a config, they plan TP = 1 under it.
    assert dataclasses.replace(scout, seq_len=8192, tensor_parallel_blocks=True) == get_model("llama4-scout")
    # The language model's share of the published 109B (17B active): the vision encoder is not planned.
    assert scout.total_params == pytest.approx(107.8e9, rel=0.005) and scout.total_params < 109e9
    assert _active(scout) == pytest.approx(17e9, rel=0.03)
    assert scout.lm_head and not scout.tie_embeddings
    assert (scout.shared_expert_ffn_hidden_size, scout.moe_ffn_hidden_size) == (8192, 8192)
    # Three blocks in four attend within chunks, the NoPE fourth to the whole sequence, however the config says it.
    assert (scout.attention_chunk_size, scout.full_attention_layers) == (8192, 12)
    text = SCOUT["text_config"]
    for extra in ({"no_rope_layers": [1, 1, 1, 0] * 12}, {"layer_types": ["chunked_attention"] * 3 * 12 + [
            "full_attention"] * 12}, {"no_rope_layer_interval": 4}):
        assert model_from_hf_dict({**text, **extra}, "t").full_attention_layers == 12


def test_chunked_attention_computes_each_chunk_s_causal_square():
    scout = get_model("llama4-scout")
    assert cm.attended_share(scout, 8192) == 1.0 and cm.attended_share(scout, 4096) == 1.0  # one chunk
    # 32k tokens: four chunks' causal squares, a quarter of the whole one, in 36 of 48 blocks.
    assert cm.attended_share(scout, 32768) == pytest.approx(0.25 + 0.75 * 0.25)
    # A last partial chunk: 2 whole chunks of 8192 and 4096 left of 20480.
    assert cm.attended_share(scout, 20480) == pytest.approx(0.25 + 0.75 * (2 * 8192**2 + 4096**2) / 20480**2)
    seqs = np.array([1024, 8192, 8193, 16384, 65536, 262144])
    share = cm.attended_share(scout, seqs)
    assert np.all(share <= 1.0) and np.all(np.diff(share) <= 0) and share[-1] >= 0.25
    full = dataclasses.replace(scout, attention_chunk_size=0, full_attention_layers=0)
    assert float(cm.causal_attention_flops(scout, 1, 65536, 1)) == pytest.approx(
        float(cm.attended_share(scout, 65536)) * float(cm.causal_attention_flops(full, 1, 65536, 1)))
    with pytest.raises(ConfigError, match="model.attention_chunk_size: set beside sliding_window"):
        dataclasses.replace(scout, sliding_window=4096)


def test_a_plan_times_the_chunks_and_its_megatron_export_says_them():
    from one_node import H100, one_node

    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.planning.exporters import megatron_args
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.training import TrainingSpec

    small = dataclasses.replace(get_model("llama4-scout"), num_layers=4, full_attention_layers=1, name="scout-small")
    whole = dataclasses.replace(small, attention_chunk_size=0, full_attention_layers=0, name="scout-whole")
    node = ClusterSpec.from_dict(one_node(H100, 8, 450))
    training = TrainingSpec(global_batch_size=8, seq_len=65536, setup="megatron", expert_parallel=8)
    plans = [evaluate_layout(m, node, training, references=(1, 1, 1), tp=1, pp=1, dp=8, micro_batch_size=1,
                             recompute="full") for m in (small, whole)]
    # Three blocks of four compute an eighth of their scores: the step is shorter by far.
    assert plans[0].predicted_iteration_time_s < 0.8 * plans[1].predicted_iteration_time_s
    notes = " ".join(megatron_args(plans[0]).notes)
    assert "3 of the model's 4 blocks attend within chunks of 8192 tokens" in notes


@pytest.mark.parametrize("config,field", [
    ({"model_type": "llama", "full_attention_interval": 4}, "full_attention_interval"),
    ({"model_type": "deepseek_v32", "layer_types": ["indexed_attention"] * 8}, "layer_types"),  # and GLM-5's
    ({"model_type": "deepseek_v4", "layer_types": ["compressed_sparse_attention"] * 8}, "layer_types"),
    ({"model_type": "llama", "layer_types": ["linear_attention", "full_attention"] * 4}, "layer_types"),
    ({"model_type": "falcon_h1", "mamba_d_ssm": 1024}, "model_type"),
    ({"model_type": "llama", "hybrid_override_pattern": "M-M-M*-"}, "hybrid_override_pattern"),
    ({"model_type": "jamba", "attn_layer_period": 8}, "model_type"),
    ({"model_type": "mamba2"}, "model_type"),
    ({"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [1, 2, 3]}}, "model_type"),
    ({"model_type": "minimax", "attn_type_list": [0, 0, 0, 1] * 2}, "model_type")])
def test_hybrid_and_recurrent_families_are_refused_by_the_field_that_names_them(config, field):
    with pytest.raises(ConfigError, match=rf"model \(config\)\.{field}: .*(other than softmax attention|not modelled)"
                                          r".*memx models blocks of softmax attention"):
        model_from_hf_dict({**SMALL, **config}, "hybrid")


def test_a_hybrid_family_is_refused_before_the_keys_an_attention_model_needs_are_asked_for():
    with pytest.raises(ConfigError, match="mamba2 has blocks other than softmax attention"):  # Mamba has no heads
        model_from_hf_dict({"model_type": "mamba2", "num_hidden_layers": 64, "hidden_size": 2560}, "mamba")


def test_gemma3_s_text_model_keeps_its_family_s_tied_head_and_gated_gelu(tmp_path):
    text = {**SMALL, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 64,
            "sliding_window_pattern": 4}
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    gemma = get_model(str(tmp_path))
    assert gemma.tie_embeddings and gemma.gated_mlp and gemma.lm_head
    assert (gemma.sliding_window, gemma.full_attention_layers) == (64, 2)
    with pytest.raises(ConfigError, match=r"model \(.*config.json.text_config\)\.num_hidden_layers"):
        (tmp_path / "config.json").write_text(json.dumps({**wrapped, "text_config": {**text, "num_hidden_layers": 0}}))
        get_model(str(tmp_path))


def test_a_rotary_embedding_that_concatenates_and_norms_that_centre_are_read_from_the_config():
    concatenates = {name: model_from_hf_dict({**SMALL, **extra}, name).rotary_concatenates for name, extra in (
        ("stablelm", {"model_type": "stablelm", "partial_rotary_factor": 0.25}),
        ("glm5", {"model_type": "glm", "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
        ("neox", {"model_type": "gpt_neox", "rotary_pct": 0.25}), ("gptj", {"model_type": "gptj", "rotary_dim": 32}),
        ("phi3", {"model_type": "phi3"}), ("whole", {"model_type": "stablelm", "partial_rotary_factor": 1.0}),
        ("gptj_whole", {"model_type": "gptj", "rotary_dim": 10_000}), ("llama", {"model_type": "llama"}))}
    assert concatenates == {"stablelm": True, "glm5": True, "neox": True, "gptj": True, "phi3": True,
                            "whole": False, "gptj_whole": False, "llama": False}
    assert model_from_hf_dict({**SMALL, "model_type": "cohere"}, "cohere").centred_norm_ops
    assert not model_from_hf_dict(SMALL, "llama").centred_norm_ops
    for key, value in (("partial_rotary_factor", 1.5), ("rotary_pct", "a quarter"), ("rotary_dim", 0)):
        with pytest.raises(ConfigError, match=rf"\.{key}:"):
            model_from_hf_dict({**SMALL, key: value}, "bad")


def test_gpt_oss_s_sinks_and_clamped_glu_are_read_and_its_attention_runs_eager_only_in_transformers_blocks():
    """GPT-OSS's config (``swiglu_limit``) gives its clamped GLU, its family its attention sinks, which
    Transformers' blocks run eager (SDPA has none) and Megatron's in its fused kernel, and its experts'
    biases; the clamped GLU and the experts' biases describe experts and are refused on a dense model."""
    from memx_launch.specs.model import ModelSpec
    from memx_launch.specs.training import TrainingSpec

    experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
    gpt_oss = model_from_hf_dict({**SMALL, **experts, "model_type": "gpt_oss", "swiglu_limit": 7.0}, "gpt-oss")
    mixtral = model_from_hf_dict({**SMALL, **experts, "model_type": "mixtral"}, "mixtral")
    assert (gpt_oss.attention_sinks, gpt_oss.clamped_glu, gpt_oss.expert_biases) == (True, True, True)
    assert (mixtral.attention_sinks, mixtral.clamped_glu, mixtral.expert_biases) == (False, False, False)
    assert get_model("gpt-oss-120b").attention_sinks and get_model("gpt-oss-20b").clamped_glu
    as_run = {setup: cm.training_as_run(gpt_oss, TrainingSpec(setup=setup)).flash_attention
              for setup in ("memx-run", "megatron")}
    assert as_run == {"memx-run": False, "megatron": True}
    assert cm.training_as_run(mixtral, TrainingSpec(setup="memx-run")).flash_attention
    for field in ("clamped_glu", "expert_biases"):
        with pytest.raises(ConfigError, match=rf"model\.{field}"):
            ModelSpec("dense", 2, 64, 4, 4, 128, 100, 32, **{field: True})


def test_ernie_4_5_s_mixture_is_read_by_its_own_keys():
    """ERNIE 4.5's MoE config names its experts ``moe_num_experts``, its top-k ``moe_k``, its shared
    experts ``moe_num_shared_experts`` (each of the experts' width) and its first expert block
    ``moe_layer_start_index``; expert blocks at an interval are refused by the key that places them.
    AFMoE's and GraniteMoeShared's names too, a bad value named by the family's own key."""
    ernie = {**SMALL, "model_type": "ernie4_5_moe", "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 96,
             "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": -1}
    spec = model_from_hf_dict(ernie, "ernie")
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn_hidden_size) == (8, 2, 96)
    assert (spec.shared_expert_ffn_hidden_size, spec.dense_layers) == (2 * 96, 1)
    with pytest.raises(ConfigError, match=r"moe_layer_interval"):
        model_from_hf_dict({**ernie, "moe_layer_interval": 2}, "ernie")
    # Other families' names (hf_family_keys.RENAMED_KEYS), at their config classes' defaults where omitted.
    afmoe = model_from_hf_dict({**SMALL, "model_type": "afmoe", "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 96}, "afmoe")
    assert (afmoe.shared_expert_ffn_hidden_size, afmoe.dense_layers) == (2 * 96, 1)
    shared = model_from_hf_dict({**SMALL, "model_type": "granitemoeshared", "num_local_experts": 8,
                                 "num_experts_per_tok": 2, "shared_intermediate_size": 64}, "granite")
    assert shared.shared_expert_ffn_hidden_size == 64
    with pytest.raises(ConfigError, match=r"\.num_shared_experts"):
        model_from_hf_dict({**SMALL, "model_type": "exaone_moe", "num_experts": 8, "num_experts_per_tok": 2,
                            "num_shared_experts": "one"}, "exaone")


def test_query_and_key_head_norms_are_read_counted_and_exported():
    from test_exporters import _megatron_config

    from memx_launch.planning.elementwise import FUSED_NORM_BYTES, elementwise_traffic_bytes
    from memx_launch.specs.training import TrainingSpec

    read = {name: model_from_hf_dict({**SMALL, **extra}, name).qk_norm for name, extra in (
        ("qwen3", {"model_type": "qwen3"}), ("qwen3_moe", {"model_type": "qwen3_moe", "num_experts": 4,
                                                           "num_experts_per_tok": 2}),
        ("gemma3", {"model_type": "gemma3_text"}), ("olmo2", {"model_type": "olmo2"}),
        ("glm", {"model_type": "glm4_moe", "use_qk_norm": True}), ("qwen2", {"model_type": "qwen2"}),
        ("llama4_off", {"model_type": "llama4_text", "use_qk_norm": False}))}
    assert read == {"qwen3": True, "qwen3_moe": True, "gemma3": True, "olmo2": True, "glm": True, "qwen2": False,
                    "llama4_off": False}
    assert model_from_hf_dict(SCOUT, "scout").qk_norm and get_model("qwen3-235b-a22b").qk_norm
    with pytest.raises(ConfigError, match=r"use_qk_norm"):
        model_from_hf_dict({**SMALL, "use_qk_norm": "yes"}, "bad")

    qwen = dataclasses.replace(get_model("qwen3-30b-a3b"), num_layers=2)
    plain = dataclasses.replace(qwen, qk_norm=False)
    assert qwen.layer_params - plain.layer_params == 2 * 128  # one weight of a head's width each
    widths = qwen.q_hidden_size + qwen.kv_hidden_size  # 4,096 queries and 512 keys
    tp, seq = 2, 4096
    for level, fused, per_element in ((cm.NONE, True, 2), (cm.SELECTIVE, True, 2), (cm.FULL, True, 0),
                                      (cm.NONE, False, 4 + 2)):
        kept = [float(cm.activation_bytes(m, 1, seq, tp, level, 2, True, fused_norm=fused).activation_bytes)
                for m in (qwen, plain)]
        assert kept[0] - kept[1] == pytest.approx(seq * widths / tp * per_element), (level, fused)
    training = TrainingSpec(seq_len=seq)
    traffic = [float(elementwise_traffic_bytes(m, training, 1, seq, tp, cm.NONE)) for m in (qwen, plain)]
    assert traffic[0] - traffic[1] == pytest.approx(seq * widths / tp * 2 * sum(FUSED_NORM_BYTES))

    from one_node import H100, one_node

    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.planning.exporters import megatron_args
    from memx_launch.specs.cluster import ClusterSpec

    plan = evaluate_layout(qwen, ClusterSpec.from_dict(one_node(H100, 8, 450)),
                           TrainingSpec(global_batch_size=8, seq_len=seq, setup="megatron", expert_parallel=8),
                           references=(1, 1, 1), tp=1, pp=1, dp=8, micro_batch_size=1, recompute="none")
    args = megatron_args(plan).args
    assert "--qk-layernorm" in args and _megatron_config(plan, args).qk_layernorm


def test_qwen2_s_qkv_biases_and_its_mixture_s_shared_expert_gate_are_exported_as_megatron_core_builds_them():
    from one_node import H100, one_node
    from test_exporters import _megatron_config

    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.planning.exporters import megatron_args
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.training import TrainingSpec

    moe = {"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 128}
    for extra, gate in (({"model_type": "qwen2"}, False), (moe, True), ({"model_type": "llama"}, False)):
        model = model_from_hf_dict({**SMALL, **extra}, extra["model_type"])
        plan = evaluate_layout(model, ClusterSpec.from_dict(one_node(H100, 8, 450)),
                               TrainingSpec(global_batch_size=8, seq_len=128, setup="megatron"),
                               references=(1, 1, 1), tp=1, pp=1, dp=8, micro_batch_size=1, recompute="none")
        args = megatron_args(plan).args
        config = _megatron_config(plan, args)
        qkv = extra["model_type"].startswith("qwen2")
        assert ("--add-qkv-bias" in args) == config.add_qkv_bias == qkv, extra
        assert config.moe_shared_expert_gate == gate if model.num_experts else "--moe-shared-expert-gate" not in args


def test_what_autograd_saves_for_hugging_face_s_query_and_key_norms_is_the_model():
    """Qwen3's attention in bf16 on CPU with its per-head RMSNorms and with them taken out: the
    difference autograd saves is what ``activation_bytes`` counts for them with torch-op norms
    (the fp32 copy and the normalised tensor: 4 + 2 bytes per query and key element)."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    seq, config = 128, Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                   intermediate_size=512, num_hidden_layers=1, vocab_size=100,
                                   attn_implementation="sdpa")
    rotary = qwen3.Qwen3RotaryEmbedding(config)

    def strip(attention):
        attention.q_norm, attention.k_norm = torch.nn.Identity(), torch.nn.Identity()
    kept = _kept_as_built_and_stripped(lambda: qwen3.Qwen3Attention(config, layer_idx=0), strip,
                                       lambda x: rotary(x, torch.arange(seq)[None]), seq, 256)
    spec = model_from_hf_dict(config.to_dict(), "qwen3-tiny")
    model = [float(cm.activation_bytes(dataclasses.replace(spec, qk_norm=q), 1, seq, 1, cm.NONE, 2, True,
                                       fused_norm=False).activation_bytes) for q in (True, False)]
    assert spec.qk_norm and kept[0] - kept[1] == pytest.approx(model[0] - model[1], rel=0.02)


def test_gemma_s_sandwich_norms_are_read_counted_and_named_in_the_export():
    from one_node import H100, one_node

    from memx_launch.planning.elementwise import FUSED_NORM_BYTES, elementwise_traffic_bytes
    from memx_launch.planning.estimate import evaluate_layout
    from memx_launch.planning.exporters import megatron_args
    from memx_launch.specs.cluster import ClusterSpec
    from memx_launch.specs.training import TrainingSpec

    read = {t: (m.post_norms, m.norm_weight_in_fp32) for t in ("gemma", "gemma2", "gemma3_text", "llama", "olmo2")
            for m in [model_from_hf_dict({**SMALL, "model_type": t}, t)]}
    assert read == {"gemma": (False, True), "gemma2": (True, True), "gemma3_text": (True, True),
                    "llama": (False, False), "olmo2": (True, True)}
    assert [model_from_hf_dict({**SMALL, "model_type": t}, t).pre_norms for t in ("gemma2", "olmo2")] == [True, False]
    with pytest.raises(ConfigError, match="model.pre_norms: off without post_norms"):
        dataclasses.replace(model_from_hf_dict({**SMALL, "model_type": "llama"}, "l"), pre_norms=False)
    gemma = model_from_hf_dict({**SMALL, "model_type": "gemma3_text", "num_key_value_heads": 2}, "g")
    plain = dataclasses.replace(gemma, post_norms=False)
    assert gemma.norms_per_block == 4 and gemma.layer_params - plain.layer_params == 2 * gemma.hidden_size
    with pytest.raises(ConfigError, match="model.post_norms: set with parallel_blocks"):
        dataclasses.replace(gemma, parallel_blocks=True)
    h, seq, tp = gemma.hidden_size, 1024, 2
    # Two more norm inputs of the hidden size: replicated over TP unless sequence parallel, dropped by full recompute.
    for level, fused, sp, per_element in ((cm.NONE, True, False, 2 * 2), (cm.SELECTIVE, True, True, 2 * 2 / tp),
                                          (cm.FULL, True, False, 0), (cm.NONE, False, False, 2 * (4 + 4))):
        kept = [float(cm.activation_bytes(m, 1, seq, tp, level, 2, True, sequence_parallel=sp,
                                          fused_norm=fused).activation_bytes) for m in (gemma, plain)]
        assert kept[0] - kept[1] == pytest.approx(seq * h * per_element), (level, fused, sp)
    traffic = [float(elementwise_traffic_bytes(m, TrainingSpec(seq_len=seq), 1, seq, tp, cm.NONE))
               for m in (gemma, plain)]
    assert traffic[0] - traffic[1] == pytest.approx(seq * h * 2 * 2 * sum(FUSED_NORM_BYTES))
    plan = evaluate_layout(gemma, ClusterSpec.from_dict(one_node(H100, 8, 450)),
                           TrainingSpec(global_batch_size=8, seq_len=seq, setup="megatron"), references=(1, 1, 1),
                           tp=1, pp=1, dp=8, micro_batch_size=1, recompute="none")
    assert "normalise their attention's and MLP's outputs too" in " ".join(megatron_args(plan).notes)


def test_what_autograd_saves_for_gemma3_s_post_norms_is_the_model():
    """Gemma 3's block in bf16 on CPU with its post-attention and post-MLP norms and without: the
    difference autograd saves is two norms as ``activation_bytes`` counts Gemma's torch-op norms
    (the fp32 copy and the fp32 product of the weight multiply, 4 + 4 bytes per element: Hugging
    Face's Gemma norm multiplies in fp32, where Llama's casts first and keeps 4 + 2)."""
    torch = pytest.importorskip("torch")
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    from transformers import Gemma3TextConfig

    seq, h = 128, 256
    config = Gemma3TextConfig(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              intermediate_size=512, num_hidden_layers=1, vocab_size=100, sliding_window=512,
                              attn_implementation="sdpa")
    rotary = gemma3.Gemma3RotaryEmbedding(config)

    def strip(layer):
        layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()
    kept = _kept_as_built_and_stripped(lambda: gemma3.Gemma3DecoderLayer(config, layer_idx=0), strip,
                                       lambda x: rotary(x, torch.arange(seq)[None], config.layer_types[0]), seq, h)
    spec = model_from_hf_dict(config.to_dict(), "gemma3-tiny")
    model = [float(cm.activation_bytes(dataclasses.replace(spec, post_norms=p), 1, seq, 1, cm.NONE, 2, True,
                                       fused_norm=False).activation_bytes) for p in (True, False)]
    assert spec.post_norms and spec.norm_weight_in_fp32
    assert kept[0] - kept[1] == pytest.approx(model[0] - model[1], rel=0.02)
    assert model[0] - model[1] == 2 * (4 + 4) * seq * h


def test_gemma_s_soft_capped_logits_are_read_and_priced_with_the_tanh_they_keep():
    from memx_launch.planning.loss import SOFTCAP_PASSES, logits_bytes, loss_hbm_bytes_per_logit
    from memx_launch.specs.training import TrainingSpec

    capped = model_from_hf_dict({**SMALL, "model_type": "gemma2", "final_logit_softcapping": 30.0}, "g")
    plain = model_from_hf_dict({**SMALL, "model_type": "gemma2", "final_logit_softcapping": None}, "g")
    assert capped.logit_softcapping and not plain.logit_softcapping
    # Gemma 2 soft-caps unless its config says otherwise, as Transformers' Gemma2Config does; Gemma 3 does not.
    assert model_from_hf_dict({**SMALL, "model_type": "gemma2"}, "g").logit_softcapping
    assert not model_from_hf_dict({**SMALL, "model_type": "gemma3_text"}, "g").logit_softcapping
    assert capped.signature() != plain.signature()  # profiles of the one are not the other's
    for dtype, d in (("fp32", 4), ("bf16", 2)):
        training = TrainingSpec(dtype=dtype, vocab_parallel_loss=False)
        kept = logits_bytes(capped, 2, 512, 1, training) - logits_bytes(plain, 2, 512, 1, training)
        assert float(kept) == d * 2 * 512 * SMALL["vocab_size"]  # the tanh's output, a logit of the dtype each
        moved = loss_hbm_bytes_per_logit(capped, training, 1) - loss_hbm_bytes_per_logit(plain, training, 1)
        assert float(moved) == sum(SOFTCAP_PASSES) * d
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        model_from_hf_dict({**SMALL, "model_type": "gemma2", "final_logit_softcapping": "30"}, "g")


def test_memx_runs_tensor_parallel_families_are_read_from_the_config():
    """memx-run splits by TP the blocks of the families whose Transformers plan is Megatron's split
    (models/hf_tensor_parallel.py; every family: tests/test_hf_tensor_parallel.py): Qwen3, Gemma 2
    and 3, Gemma 2's soft-capped attention too (its own, unfused: the planner says so where a config
    caps it or leaves Gemma 2's default cap of 50), not OLMo 2 (its plan gathers q, k and v)."""
    read = {t: model_from_hf_dict({**SMALL, "model_type": t, **extra}, t)
            for t, extra in (("qwen3", {}), ("gemma3_text", {}), ("gemma2", {}), ("olmo2", {}))}
    assert {t: m.tensor_parallel_blocks for t, m in read.items()} == \
        {"qwen3": True, "gemma3_text": True, "gemma2": True, "olmo2": False}
    assert {t: m.attention_softcapping for t, m in read.items()} == \
        {"qwen3": False, "gemma3_text": False, "gemma2": True, "olmo2": False}
    uncapped = model_from_hf_dict({**SMALL, "model_type": "gemma2", "attn_logit_softcapping": None}, "g")
    assert uncapped.tensor_parallel_blocks and not uncapped.attention_softcapping
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        model_from_hf_dict({**SMALL, "model_type": "gemma2", "attn_logit_softcapping": 0}, "g")


def _measured(kind: str, tmp_path, fields: dict | None = None) -> dict:
    """``benchmarks/hf_block_memory.py``'s row of ``kind``'s layer (its ``FAMILIES`` fields unless
    given): measured over counted, fp32 and bf16."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks.hf_block_memory import FAMILIES, measure

    return measure(kind, FAMILIES[kind] if fields is None else fields, str(tmp_path))


# Each family memx reads by what its layer runs (why each was counted wrong before:
# docs/bring-your-own-model.md), and the tolerances on what autograd saves for its first layer and
# on what that layer's later backward holds (None: a mixture's, whose experts' gate-and-up gradient
# memx takes as its peak at few tokens, an over-count; or Granite's residual multiplier, not counted).
MEASURED_FAMILIES = {
    "exaone4": (0.012, 0.011),  # norms on the attention's and MLP's outputs only, q and k norms
    "hunyuan_v1_dense": (0.012, 0.011),  # q and k norms after RoPE: fp32 under autocast
    "glm4": (0.012, 0.011),  # norms on 16-bit linear outputs: 4 + 2 bytes an element under autocast
    "dots1": (0.012, None),  # q and k norms
    "apertus": (0.012, 0.011),  # q and k norms, xIELU as torch ops
    "arcee": (0.012, 0.011),  # squared ReLU as torch ops
    "olmo": (0.012, 0.011),  # a LayerNorm without weights, q, k and v clamped in place
    "exaone_moe": (0.012, None),  # q and k norms, a shared expert
    "granite_swa": (0.012, None), "granitemoe_swa": (0.012, None),  # eager attention, a sink scaling its output
    "flex_olmo": (0.012, None),  # q and k norms
    "granitemoeshared": (0.012, None),  # its shared expert's own key, its gate and up one linear
    "afmoe": (0.012, None),  # sandwich and q and k norms, an output gate of its own linear, shared experts
    "glm4_moe": (0.012, None),  # partial rotary, q and k norms
    "minimax_m2": (0.012, None),  # q and k norms over all heads, with no config key
    # latent attention: torch-op latent norms, the value a view keeping the up projection's output, the
    # flash kernel's output laid out by head as the concatenated query
    "deepseek_v3": (0.012, None), "glm4_moe_lite": (0.012, None),
    "llama4_text": (0.012, 0.011),  # every token through every expert, weightless q and k norms
    # sandwich, q and k norms, a weightless v norm; E2B's per-layer inputs
    "gemma4_text": (0.012, 0.011), "gemma4_unified_text": (0.012, 0.011),
    "hyperclovax": (0.016, 0.01),  # norms on the attention's and MLP's outputs, its use_post_norm
    "jais2": (0.016, 0.01),  # LayerNorms, biases on every linear
    "nanochat": (0.016, 0.01),  # weightless norms, q and k norms after RoPE
    "phimoe": (0.016, None),  # LayerNorms; its sparsemixer router's masks and indices not counted
    "cohere2_moe": (0.016, None),  # a parallel block
    "mellum": (0.016, None), "hy_v3": (0.016, None),  # q and k norms; HunYuan 3's shared experts by its own key
    "kolibri1": (0.016, None),  # sandwich and q and k norms, the one on its experts' fp32 output fp32
    "aria_text": (0.016, None),  # its mixture's own keys
    "minimax_m3_vl_text": (0.016, None),  # a shared clamped-GLU MLP, Gemma-style norms, a concatenating rotary
    "persimmon": (0.016, 0.01),  # LayerNorm kernels, q and k norms on the fused projection's views
    "phi4_multimodal": (0.016, 0.01),  # a rotary that concatenates even whole
    "opt": (0.016, 0.01),  # a ReLU MLP by ffn_dim where intermediate_size is null
    "mpt": (0.016, None),  # LayerNorm kernels read off the block, ALiBi attention as torch ops
    "gpt2": (0.012, 0.011),  # Conv1D, gelu_new as torch ops
    "gpt_bigcode": (0.012, 0.011),  # multi-query: one key-value head; a learned position table
    "phi": (0.012, 0.011),  # one LayerNorm feeding attention and MLP side by side
    "nemotron": (0.012, 0.011),  # LayerNorm1P: torch's layer_norm kernel
    "bloom": (0.012, 0.011),  # ALiBi attention as torch ops; GeLUFunction's torch-op backward (five tensors)
}


@pytest.mark.parametrize("kind", list(MEASURED_FAMILIES))
def test_families_keep_what_memx_counts(kind, tmp_path):
    """What autograd saves for one layer of each family, in fp32 and under bf16 autocast, is
    memx-run's count to the family's tolerance (1.2%, or 1.6% where small uncounted router or norm
    tensors weigh more at h = 128), and what its later backward holds (the step's autocast casts made
    first, as memx-run's one region a step makes them) its working set."""
    pytest.importorskip("transformers")
    kept, backward = MEASURED_FAMILIES[kind]
    row = _measured(kind, tmp_path)
    for dtype in ("fp32", "bf16"):
        assert row[dtype]["measured_over_counted"] == pytest.approx(1.0, abs=kept), dtype
        if backward is not None:
            assert row[dtype]["working_measured_over_counted"] == pytest.approx(1.0, abs=backward), dtype


def test_gemma4_s_mixture_keeps_what_memx_counts(tmp_path):
    """Gemma 4 26B-A4B's layer: its experts beside the dense MLP, with their own norms and router's,
    within 1.5% (its router's per-token top-k weights, indices and scalings uncounted at h = 128)."""
    pytest.importorskip("transformers")
    mixture = dict(head_dim=32, global_head_dim=64, hidden_size_per_layer_input=0, enable_moe_block=True,
                   num_experts=8, top_k_experts=2, moe_intermediate_size=96)
    row = _measured("gemma4_text", tmp_path, mixture)
    for dtype in ("fp32", "bf16"):
        assert row[dtype]["measured_over_counted"] == pytest.approx(1.0, abs=0.015), dtype


def test_seed_oss_s_residual_dropout_is_read_off_its_layer(tmp_path):
    """Seed-OSS drops out the attention's and the MLP's outputs in training (``residual_dropout``):
    memx-run reads it off the layer and counts the masks (a byte an element on CUDA; CPU's dropout
    keeps its scaled mask in the input's dtype, which the measured layer shows above the count)."""
    pytest.importorskip("transformers")
    row = _measured("seed_oss", tmp_path)
    assert row["block_read"] == {"dropout": True, "selective_recompute": "block"}
    assert all(1.0 <= row[dtype]["measured_over_counted"] < 1.08 for dtype in ("fp32", "bf16"))


def test_glm_and_minimax_mixtures_read_their_own_norms_and_dense_blocks():
    """GLM-4.7-Flash (glm4_moe_lite) has no post-norms (GLM-4's dense model has) and places its dense
    blocks by mlp_layer_types (its first one where omitted, whatever first_k_dense_replace says);
    MiniMax-M2 normalises its queries and keys with no config key saying so."""
    base = {**SMALL, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}
    lite = model_from_hf_dict({**base, "model_type": "glm4_moe_lite"}, "g")
    assert not lite.post_norms and lite.dense_layers == 1
    lite = model_from_hf_dict({**base, "model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse"] * 8}, "g")
    assert lite.dense_layers == 0
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        model_from_hf_dict({**base, "model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense"] * 4}, "g")
    minimax = model_from_hf_dict({**SMALL, "model_type": "minimax_m2", "num_local_experts": 8,
                                  "num_experts_per_tok": 2}, "m")
    assert minimax.qk_norm
