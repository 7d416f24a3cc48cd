"""The catalog of named models, and :func:`get_model`: a catalog name or a Hugging Face config."""

from __future__ import annotations

import difflib
import os

from memx_launch.errors import ConfigError
from memx_launch.specs.hf_config import model_from_hf_config
from memx_launch.specs.model import ModelSpec


NEMOTRON_H_56B_PATTERN = "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-"


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq, rope_theta=10000.0) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, ffn, vocab, seq, rope_theta=rope_theta)


def _gpt_style(name, layers, hidden, heads, ffn, vocab, seq, positions, relu=False) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, heads, ffn, vocab, seq, gated_mlp=False, relu_mlp=relu,
                     tie_embeddings=True, layer_norm=True, linear_biases=True, position_embeddings=positions)


# Paper Table 4 plus the published FFN and KV-head sizes; the small flavors run on a CPU.
MODEL_CATALOG: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    _llama("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, 8192, rope_theta=500000.0),
    _llama("llama-tiny", 8, 128, 4, 2, 352, 512, 64),
    _llama("llama-small", 8, 512, 8, 4, 1376, 2048, 256),
    _llama("tinyllama-1.1b", 22, 2048, 32, 4, 5632, 32000, 2048),  # TinyLlama-1.1B's shape: benchmarks/gpu_check.py
    # Models of the public GPU profiles in shared/peer-data/sailor (OPT's ReLU MLP, GPT-Neo's GELU;
    # LayerNorm, biases, learned positions: OPT's table has 2 rows more than its context; fp32 there).
    _gpt_style("opt-350m", 24, 1024, 16, 4096, 50272, 2048, positions=2050, relu=True),
    # GPT-J-6B (EleutherAI): attention and MLP side by side, rotary positions on 64 of each head's 256
    # (rotary_dim), an untied head.
    ModelSpec("gpt-j-6b", 28, 4096, 16, 16, 16384, 50400, 2048, gated_mlp=False, layer_norm=True,
              linear_biases=True, parallel_blocks=True, rotary_concatenates=True),
    _gpt_style("gpt-neo-2.7b", 32, 2560, 20, 10240, 50257, 2048, positions=2048),
    _gpt_style("opt-30b", 48, 7168, 56, 28672, 50272, 2048, positions=2050, relu=True),
    # Mixtures of experts (their Hugging Face configs): Mixtral-8x7B; Qwen3-30B-A3B and
    # Qwen3-235B-A22B, whose 128-wide heads are wider than hidden / heads, each normalised.
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, rope_theta=1e6, num_experts=8,
              experts_per_token=2),
    ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096, rope_theta=1e6, attention_head_dim=128,
              num_experts=128, experts_per_token=8, expert_ffn_hidden_size=768, qk_norm=True),
    ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096, rope_theta=1e6, attention_head_dim=128,
              num_experts=128, experts_per_token=8, expert_ffn_hidden_size=1536, qk_norm=True),
    # GPT-OSS-120B: every other block attends within 128 tokens; attention sinks, a clamped GLU and
    # biases on its experts, priced, not counted (with its attention's: 0.01% of its parameters).
    ModelSpec("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096, rope_theta=150000.0, attention_head_dim=64,
              num_experts=128, experts_per_token=4, sliding_window=128, full_attention_layers=18,
              attention_sinks=True, clamped_glu=True, expert_biases=True),
    ModelSpec("gpt-oss-20b", 24, 2880, 64, 8, 2880, 201088, 4096, rope_theta=150000.0, attention_head_dim=64,
              num_experts=32, experts_per_token=4, sliding_window=128, full_attention_layers=12,
              attention_sinks=True, clamped_glu=True, expert_biases=True),
    # Llama-4-Scout-17B-16E's language model (Meta's text_config): 16 routed experts, top-1, and a
    # shared expert in every block; three blocks in four attend within chunks of 8,192 tokens, the
    # fourth (no rotary positions) to the whole sequence; its query and key heads are normalised.
    ModelSpec("llama4-scout", 48, 5120, 40, 8, 8192, 202048, 8192, rope_theta=500000.0, num_experts=16,
              experts_per_token=1, shared_expert_ffn_hidden_size=8192, attention_chunk_size=8192,
              full_attention_layers=12, qk_norm=True, qk_norm_weightless=True, experts_take_every_token=True),
    # Llama-4-Maverick-17B-128E's language model: Scout's attention, without its query/key norms;
    # every other block (the second, fourth, ...) runs 128 routed experts (top-1) and a shared
    # one, 8,192 wide, the others a dense MLP 16,384 wide.
    ModelSpec("llama4-maverick", 48, 5120, 40, 8, 16384, 202048, 8192, rope_theta=500000.0, num_experts=128,
              experts_per_token=1, expert_ffn_hidden_size=8192, shared_expert_ffn_hidden_size=8192,
              moe_layer_step=2, attention_chunk_size=8192, full_attention_layers=12, experts_take_every_token=True),
    # DeepSeek-V3 (671B, 37B active): latent attention, three dense first blocks, one shared and
    # 256 routed experts in 8 groups (a token's top-8 from 4 of them), one multi-token prediction module.
    ModelSpec("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, norm_eps=1e-6, attention_head_dim=128,
              num_experts=256, experts_per_token=8, expert_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048,
              kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128, dense_layers=3, mtp_layers=1,
              expert_groups=8, expert_groups_per_token=4),
    # Kimi K2 (1.03T, 33B active as counted here; "1T, 32B" published): DeepSeek-V3's blocks with 64
    # heads, 384 routed experts (top-8, no groups), one dense first block and no multi-token
    # prediction (moonshotai/Kimi-K2-Base config.json).
    ModelSpec("kimi-k2", 61, 7168, 64, 64, 18432, 163840, 4096, norm_eps=1e-6, attention_head_dim=128,
              num_experts=384, experts_per_token=8, expert_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048,
              kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128, dense_layers=1),
    # Nemotron-H 56B: 54 Mamba-2 layers, 54 MLP layers (squared ReLU: an ungated MLP) and 10 attention
    # layers without positions (NeMo's NemotronHConfig56B).
    ModelSpec("nemotron-h-56b", 118, 8192, 64, 8, 32768, 131072, 8192, gated_mlp=False, squared_relu_ops=True,
              hybrid_pattern=NEMOTRON_H_56B_PATTERN, mamba_heads=256, mamba_head_dim=64, mamba_state_size=256,
              mamba_groups=8),
    # Nemotron 3 Nano 30B-A3B: 23 Mamba-2 layers, 23 expert layers (128 experts of 1,856, top-6, and
    # a shared one of 3,712; squared ReLU, ungated) and 6 attention layers (Megatron-Bridge's
    # Nemotron3NanoProvider, the model's config.json).
    ModelSpec("nemotron-3-nano-30b-a3b", 52, 2688, 32, 2, 1856, 131072, 8192, gated_mlp=False, squared_relu_ops=True,
              attention_head_dim=128, hybrid_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
              mamba_heads=64, mamba_head_dim=64, mamba_state_size=128, mamba_groups=8,
              num_experts=128, experts_per_token=6, expert_ffn_hidden_size=1856, shared_expert_ffn_hidden_size=3712),
    # Qwen3-Next-80B-A3B: 48 blocks, three of Gated DeltaNet (16 key and 32 value heads) to one of
    # gated attention (16 heads of 256, 2 KV heads, query/key norms), each with 512 experts of 512
    # (top-10) and a shared one of 512 (the model's config.json); memx counts a block's mixer and
    # its experts as two hybrid layers (G or *, then E).
    ModelSpec("qwen3-next-80b-a3b", 96, 2048, 16, 2, 5120, 151936, 8192, rope_theta=10000000.0, norm_eps=1e-6,
              attention_head_dim=256, qk_norm=True, hybrid_pattern="GEGEGE*E" * 12, linear_key_heads=16,
              linear_value_heads=32, attention_output_gate=True, num_experts=512, experts_per_token=10,
              expert_ffn_hidden_size=512, shared_expert_ffn_hidden_size=512, shared_expert_gate=True,
              rotary_concatenates=True),  # rotary positions on a quarter of each head
)}


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog name, or the path of a Hugging Face ``config.json`` (or its folder)."""
    if name_or_path in MODEL_CATALOG:
        return MODEL_CATALOG[name_or_path]
    candidate = name_or_path
    if os.path.isdir(candidate):
        candidate = os.path.join(candidate, "config.json")
    if candidate.endswith(".json") and os.path.exists(candidate):
        return model_from_hf_config(candidate)
    close = difflib.get_close_matches(name_or_path, MODEL_CATALOG, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(MODEL_CATALOG)}"
    raise ConfigError("--model", f"unknown model {name_or_path!r}",
                      f"{hint} (or pass a Hugging Face config.json)")
