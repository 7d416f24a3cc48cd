"""Specs: the model catalog, cluster files (good and bad), training settings."""

import glob
import json
import os

import pytest

from memx_launch.errors import ConfigError
from memx_launch.specs.cluster import ClusterSpec
from memx_launch.specs.node import PCIE_STAGED_SHARE
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.hf_config import model_from_hf_dict
from memx_launch.specs.catalog import get_model
from memx_launch.specs.training import TrainingSpec

CLUSTERS = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters")
EXAMPLE_MODELS = os.path.join(os.path.dirname(__file__), "..", "examples", "models")

GOOD = """
version: 1
device_types:
  big: {memory_gib: 80, peak_tflops: 312}
  small: {memory_gib: 16, peak_tflops: 65, flash_attention: false}
nodes:
  - {devices: {big: 2}, intra_node_gbps: 300}
  - {devices: {small: 2}, intra_node_gbps: 12}
inter_node_gbps: 12.5
"""


def write(tmp_path, text, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_catalog_matches_the_published_shapes():
    m = get_model("llama2-7b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.vocab_size, m.seq_len) == (32, 4096, 32, 32000, 4096)
    assert 6.7e9 < m.total_params < 6.8e9  # 6.74 B
    m = get_model("llama3-70b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size) == (80, 8192, 64, 8, 128256)
    assert 70.4e9 < m.total_params < 70.8e9  # 70.6 B
    assert get_model("llama-tiny").total_params < 2e6


def test_unknown_model_suggests_nearest_names():
    with pytest.raises(ConfigError, match=r"--model: unknown model 'llama2-7B'; did you mean llama2-7b"):
        get_model("llama2-7B")


def test_hf_config_json(tmp_path):
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
           "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert m.signature() == get_model("llama3-8b").signature()
    assert (m.rope_theta, m.norm_eps) == (10000.0, 1e-5)  # the config gives neither: Megatron's defaults
    cfg.update(rope_theta=500000.0, rms_norm_eps=1e-6)
    path.write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert (m.rope_theta, m.norm_eps) == (500000.0, 1e-6) and get_model("llama3-8b").rope_theta == 500000.0
    # Neither changes time or memory: the profiles and plans of the shape stay its own.
    assert m.signature() == get_model("llama3-8b").signature()
    # Transformers 5 writes the base inside rope_parameters (a model's config.to_dict(), its saved config.json).
    del cfg["rope_theta"]
    path.write_text(json.dumps({**cfg, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}))
    assert get_model(str(tmp_path)).rope_theta == 500000.0
    cfg.update(rope_theta="big")
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="rope_theta"):
        get_model(str(tmp_path))


def test_gpt2_style_config_json(tmp_path):
    # GPT-2 small's config.json as published (n_inner null: 4 x n_embd; tied embeddings by default)
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "n_positions": 1024,
           "vocab_size": 50257, "activation_function": "gelu_new"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size, m.seq_len) == \
        (12, 768, 12, 12, 3072, 50257, 1024)
    assert not m.gated_mlp and m.tie_embeddings and m.norm_eps == 1e-5
    assert 120e6 < m.total_params < 130e6  # GPT-2 small: 124M (memx counts no biases or position table)
    assert not m.tensor_parallel_blocks  # memx-run has no TP plan for GPT-2 blocks


@pytest.mark.parametrize("cfg,expected", [
    # OPT-350m as published: ffn_dim, ReLU, tied by default
    ({"model_type": "opt", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_dim": 4096,
      "vocab_size": 50272, "max_position_embeddings": 2048, "activation_function": "relu"},
     dict(ffn_hidden_size=4096, gated_mlp=False, relu_mlp=True, tie_embeddings=True, tensor_parallel_blocks=False)),
    # Gemma-2B: a gated GELU MLP, tied by default, Llama-family blocks
    ({"model_type": "gemma", "num_hidden_layers": 18, "hidden_size": 2048, "num_attention_heads": 8,
      "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000,
      "hidden_act": "gelu_pytorch_tanh"},
     dict(gated_mlp=True, tie_embeddings=True, tensor_parallel_blocks=True)),
    # Qwen2-0.5B says tie_word_embeddings itself; Phi-2 (parallel blocks, GELU) does not tie
    ({"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
      "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
     dict(gated_mlp=True, tie_embeddings=True, tensor_parallel_blocks=True)),
    ({"model_type": "phi", "num_hidden_layers": 32, "hidden_size": 2560, "num_attention_heads": 32,
      "intermediate_size": 10240, "vocab_size": 51200, "hidden_act": "gelu_new"},  # split by Transformers' TP plan
     dict(gated_mlp=False, relu_mlp=False, tie_embeddings=False, tensor_parallel_blocks=True)),
    # Falcon-7B as published (GPT-2's names in its first configs: n_layer, n_head): one KV head
    # (multi_query), parallel blocks, LayerNorm, no linear biases, tied; Falcon-40B's KV heads
    ({"model_type": "falcon", "n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True,
      "parallel_attn": True, "bias": False, "vocab_size": 65024},
     dict(num_layers=32, num_kv_heads=1, ffn_hidden_size=18176, gated_mlp=False, parallel_blocks=True,
          layer_norm=True, linear_biases=False, tie_embeddings=True)),
    ({"model_type": "falcon", "num_hidden_layers": 60, "num_attention_heads": 128, "hidden_size": 8192,
      "new_decoder_architecture": True, "num_kv_heads": 8, "parallel_attn": True, "vocab_size": 65024},
     dict(num_kv_heads=8, ffn_hidden_size=32768, parallel_blocks=True)),
    # GPT-Neo-2.7B as published: its own names, its MLP 4x unless intermediate_size, a learned position table
    ({"model_type": "gpt_neo", "num_layers": 32, "num_heads": 20, "hidden_size": 2560, "intermediate_size": None,
      "vocab_size": 50257, "max_position_embeddings": 2048, "activation_function": "gelu_new",
      "attention_types": [[["global", "local"], 16]], "window_size": 256},
     dict(num_layers=32, num_heads=20, ffn_hidden_size=10240, gated_mlp=False, relu_mlp=False, layer_norm=True,
          position_embeddings=2048, tie_embeddings=True, sliding_window=0)),
    # BLOOM-560M and MPT-7B as published: their own names, ALiBi (no position table), tied
    ({"model_type": "bloom", "n_layer": 24, "n_head": 16, "hidden_size": 1024, "vocab_size": 250880},
     dict(num_layers=24, num_heads=16, ffn_hidden_size=4096, gated_mlp=False, layer_norm=True, linear_biases=True,
          position_embeddings=0, tie_embeddings=True)),
    ({"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32, "expansion_ratio": 4, "max_seq_len": 2048,
      "vocab_size": 50432, "no_bias": True},
     dict(num_layers=32, hidden_size=4096, ffn_hidden_size=16384, gated_mlp=False, layer_norm=False,
          linear_biases=False, tie_embeddings=True, seq_len=2048)),
], ids=["opt-350m", "gemma-2b", "qwen2-0.5b", "phi-2", "falcon-7b", "falcon-40b", "gpt-neo-2.7b", "bloom-560m",
        "mpt-7b"])
def test_hf_configs_of_other_families(tmp_path, cfg, expected):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert {k: getattr(m, k) for k in expected} == expected


def test_falcon_cohere_mpt_bloom_and_gpt_neo_count_the_hugging_face_models_parameters():
    """Falcon (parallel blocks, one KV head, no biases) and Cohere (parallel blocks, tied) exactly;
    GPT-Neo within its q, k and v biases, which it lacks and memx's all-or-none linear biases count."""
    transformers = pytest.importorskip("transformers")
    falcon = transformers.FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100)
    cohere = transformers.CohereConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=100)
    for config, family in ((falcon, "Falcon"), (cohere, "Cohere")):
        model = model_from_hf_dict(config.to_dict(), family)
        assert model.parallel_blocks and model.total_params == \
            sum(p.numel() for p in getattr(transformers, f"{family}ForCausalLM")(config).parameters())
    # MPT (weight-only norms, no biases, ALiBi, tied) exactly; BLOOM but for its embedding's LayerNorm.
    mpt = transformers.MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=100, max_seq_len=128)
    assert model_from_hf_dict(mpt.to_dict(), "mpt").total_params == \
        sum(p.numel() for p in transformers.MptForCausalLM(mpt).parameters())
    bloom = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=100)
    assert sum(p.numel() for p in transformers.BloomForCausalLM(bloom).parameters()) - \
        model_from_hf_dict(bloom.to_dict(), "bloom").total_params == 2 * 64
    neo = transformers.GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2, vocab_size=100,
                                    max_position_embeddings=128, attention_types=[[["global", "local"], 1]])
    assert model_from_hf_dict(neo.to_dict(), "neo").total_params - \
        sum(p.numel() for p in transformers.GPTNeoForCausalLM(neo).parameters()) == 2 * 3 * 64


@pytest.mark.parametrize("folder", ["hf-qwen2-tiny", "hf-mixtral-tiny"])
def test_qwen2_s_qkv_biases_and_the_mixtures_count_the_hugging_face_models_parameters(folder):
    """Qwen2's q, k and v biases (and nothing else's), Qwen2-MoE's and Qwen3-Next's shared expert and
    its gate, Qwen3-MoE's query and key norms, Mixtral's experts: each exactly."""
    transformers = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    configs = [transformers.AutoConfig.from_pretrained(os.path.join(EXAMPLE_MODELS, folder)),
               transformers.Qwen2MoeConfig(**small, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=96),
               transformers.Qwen3MoeConfig(**small, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                           num_experts_per_tok=2, head_dim=16),
               transformers.Qwen3NextConfig(**small, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=2, shared_expert_intermediate_size=32, head_dim=16,
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=16, full_attention_interval=2)]
    for config in configs:
        model = model_from_hf_dict(config.to_dict(), config.model_type)
        assert model.total_params == \
            sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()), config.model_type
        assert model.qkv_bias == config.model_type.startswith("qwen2")
        assert model.shared_expert_gate == (config.model_type in ("qwen2_moe", "qwen3_next"))


def test_starcoder2_stablelm_seed_oss_and_glm4_count_their_norms_and_biases():
    """StarCoder2: LayerNorm and a bias on every linear (use_bias); StableLM: LayerNorm, q, k and v
    biases with use_qkv_bias; Seed-OSS: q, k and v biases (attention_bias); GLM-4 those and its
    sandwich norms, GLM-4's mixture without them. Each exactly."""
    transformers = pytest.importorskip("transformers")
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=100)
    for config, flags in ((transformers.Starcoder2Config(**small), (True, True, False)),
                          (transformers.Starcoder2Config(**small, use_bias=False), (True, False, False)),
                          (transformers.StableLmConfig(**small), (True, False, False)),
                          (transformers.StableLmConfig(**small, use_qkv_bias=True), (True, False, True)),
                          (transformers.SeedOssConfig(**small), (False, False, True)),
                          (transformers.Glm4Config(**small, head_dim=16, pad_token_id=0), (False, False, True))):
        model = model_from_hf_dict(config.to_dict(), config.model_type)
        assert (model.layer_norm, model.linear_biases, model.qkv_bias) == flags, config.model_type
        assert model.total_params == \
            sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()), flags
        assert model.post_norms == (config.model_type == "glm4")


def test_an_hf_config_is_named_by_its_folder_or_its_own_file_name(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "gemma2-9b.json").write_text(json.dumps(cfg))
    (tmp_path / "named.json").write_text(json.dumps({**cfg, "_name_or_path": "org/model"}))
    assert get_model(str(tmp_path / "tiny-llama")).name == "tiny-llama"
    assert get_model(str(tmp_path / "gemma2-9b.json")).name == "gemma2-9b"
    assert get_model(str(tmp_path / "named.json")).name == "org/model"


@pytest.mark.parametrize("folder, family", [("hf-gpt2-tiny", "GPT2"), ("hf-llama-tiny", "Llama")])
def test_parameter_count_is_the_hugging_face_models(folder, family):
    # GPT-2: LayerNorm biases, a bias on every linear layer, the learned position table; Llama: none.
    transformers = pytest.importorskip("transformers")
    path = os.path.join(EXAMPLE_MODELS, folder, "config.json")
    with open(path) as f:
        config = getattr(transformers, f"{family}Config")(**{k: v for k, v in json.load(f).items()
                                                             if k not in ("architectures", "_name_or_path")})
    model = getattr(transformers, f"{family}ForCausalLM" if family == "Llama" else f"{family}LMHeadModel")(config)
    assert get_model(path).total_params == sum(p.numel() for p in model.parameters())
    opt = transformers.OPTConfig(num_hidden_layers=2, hidden_size=64, ffn_dim=256, num_attention_heads=4,
                                 vocab_size=300, max_position_embeddings=128, word_embed_proj_dim=64)
    assert model_from_hf_dict(opt.to_dict(), "opt").total_params == \
        sum(p.numel() for p in transformers.OPTForCausalLM(opt).parameters())


def test_fields_added_at_their_defaults_keep_a_models_signature():
    # Profiles and predictors are keyed by the signature: a LLaMA's must not move when fields
    # that it does not use (LayerNorm, biases, a position table) are added to the shape.
    import dataclasses
    import hashlib

    llama = get_model("llama2-7b")
    # The shape profiles were first keyed by; every field added since is at its default on a LLaMA.
    first = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len",
             "gated_mlp", "tie_embeddings")
    before = {k: getattr(llama, k) for k in first}
    assert llama.signature() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    # A mixture's load-balancing loss changes what its stages send, not a layer's time or memory.
    mixtral = get_model("mixtral-8x7b")
    assert dataclasses.replace(mixtral, router_aux_loss=True).signature() == mixtral.signature()
    assert dataclasses.replace(mixtral, clamped_glu=True).signature() != mixtral.signature()  # off its default
    gpt_style = dataclasses.replace(llama, layer_norm=True, linear_biases=True, position_embeddings=4096)
    assert gpt_style.signature() != llama.signature() and gpt_style.total_params > llama.total_params
    assert dataclasses.replace(llama, parallel_blocks=True).signature() != llama.signature()
    assert dataclasses.replace(llama, lm_head=False).signature() != llama.signature()
    qwen2 = dataclasses.replace(llama, qkv_bias=True)
    assert qwen2.signature() != llama.signature() and qwen2.total_params > llama.total_params
    assert dataclasses.replace(gpt_style, gated_mlp=False, relu_mlp=True).signature() != \
        dataclasses.replace(gpt_style, gated_mlp=False).signature()


def test_heads_wider_than_hidden_size_over_heads_are_modelled(tmp_path):
    import dataclasses

    cfg = {"model_type": "gemma", "num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 16,
           "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000}  # Gemma-7B: 16 x 256 != 3072
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gemma = get_model(str(tmp_path))
    assert (gemma.head_dim, gemma.q_hidden_size, gemma.kv_hidden_size) == (256, 4096, 4096)
    assert gemma.total_params == pytest.approx(8.54e9, rel=0.001)  # Gemma-7B's published 8.54B
    qwen3 = model_from_hf_dict({"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
                                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600,
                                    "vocab_size": 151936}, "qwen3-32b")
    assert qwen3.total_params == pytest.approx(32.76e9, rel=0.001)  # Qwen3-32B's 32.8B, q/k norms aside
    # A head_dim that is hidden_size / num_heads is the default: the shape keeps its signature.
    llama = get_model("llama2-7b")
    assert model_from_hf_dict({**{"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                      "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096},
                                   "head_dim": 128}, "llama2-7b").signature() == llama.signature()
    assert dataclasses.replace(llama, attention_head_dim=256).signature() != llama.signature()
    with pytest.raises(ConfigError, match="model.hidden_size: 100 is not divisible by num_heads=8.*attention_head_dim"):
        ModelSpec("m", 2, 100, 8, 8, 256, 1000, 64)
    assert ModelSpec("m", 2, 100, 8, 8, 256, 1000, 64, attention_head_dim=16).q_hidden_size == 128


def test_every_example_cluster_loads():
    files = sorted(glob.glob(os.path.join(CLUSTERS, "*.yaml")))
    assert len(files) >= 4
    for path in files:
        assert ClusterSpec.from_yaml(path).world_size > 0


def test_paper_cluster_keeps_table3_ratios_and_links():
    c = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "paper-20gpu.yaml"))
    assert c.type_counts() == {"a100-80gb": 4, "vendor-b-32gb": 8, "vendor-c-32gb": 8}
    eff = {d.name: d.effective_tflops for d in c.device_types}
    assert eff["vendor-b-32gb"] / eff["a100-80gb"] == pytest.approx(99 / 128, rel=1e-3)
    assert eff["vendor-c-32gb"] / eff["a100-80gb"] == pytest.approx(46 / 128, rel=1e-3)
    assert c.link_gbps(0, 1) == 240          # A100 NVLink
    # PCIe-class links inside vendor B's node: traffic is staged through the host.
    assert c.link_gbps(4, 5) == pytest.approx(17 * PCIE_STAGED_SHARE)  # same NUMA domain
    assert c.link_gbps(4, 8) == pytest.approx(12 * PCIE_STAGED_SHARE)  # across NUMA
    assert c.link_gbps(0, 4) == 28           # between nodes


def test_table1_cluster_reaches_the_measured_standalone_rates():
    c = ClusterSpec.from_yaml(os.path.join(CLUSTERS, "table1-2vendor.yaml"))
    eff = {d.name: d.effective_tflops for d in c.device_types}
    assert eff["vendor-x-32gb"] == pytest.approx(70, rel=1e-3)
    assert eff["vendor-y-64gb"] == pytest.approx(86, rel=1e-3)


@pytest.mark.parametrize("text, match", [
    ("version: 1\ndevice_types: [unclosed", r"--cluster: .* is not valid YAML at line"),
    (GOOD.replace("inter_node_gbps", "inter_node_gbs"), r"cluster.inter_node_gbs: unknown key; did you mean 'inter_node_gbps'"),
    (GOOD.replace("memory_gib: 80", "memory_gib: 0"), r"device_types.big.memory_gib: must be a positive number, got 0"),
    (GOOD.replace("memory_gib: 16", "memory_gib: -16"), r"device_types.small.memory_gib: must be a positive number, got -16"),
    (GOOD.replace("version: 1", "version: 7"), r"cluster.version: expected 1, got 7"),
    (GOOD.replace("{big: 2}", "{huge: 2}"), r"nodes\[0\].devices.huge: unknown device type"),
    (GOOD.replace("{small: 2}", "{small: 0}"), r"devices.small: must be a positive integer"),
    ("just a string", r"cluster: the file must be a mapping"),
])
def test_bad_cluster_files_name_the_field_and_the_fix(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_yaml(write(tmp_path, text))


def test_missing_cluster_file():
    with pytest.raises(ConfigError, match=r"--cluster: cannot read 'nope.yaml'"):
        ClusterSpec.from_yaml("nope.yaml")


def test_good_cluster_parses(tmp_path):
    c = ClusterSpec.from_yaml(write(tmp_path, GOOD))
    assert c.rank_device_types() == ["big", "big", "small", "small"]
    assert not c.device_type("small").flash_attention
    assert c.link_gbps(1, 2) == 12.5


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch_size": 0}, "--global-batch-size"),
    ({"seq_len": -1}, "--seq-len"),
    ({"dtype": "fp8"}, "--dtype"),
])
def test_bad_training_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainingSpec(**kwargs)


def test_model_shape_is_checked():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelSpec("bad", 2, 128, 4, 3, 256, 100, 32)
