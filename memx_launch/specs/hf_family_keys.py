"""Families' own names for the keys a Hugging Face config reader asks: GPT-Neo's, Falcon's,
BLOOM's and MPT's for the Llama-style ones, others' attribute maps (ERNIE 4.5's, EXAONE MoE's,
AFMoE's, GraniteMoeShared's and JetMoE's: :data:`RENAMED_KEYS`), Gemma 4's mixture and per-layer
inputs; ``hf_config.py`` reads the rest."""

from __future__ import annotations

from typing import Any, Mapping

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number
from memx_launch.specs.model import MAX_DIMENSION

# Hugging Face model types whose Llama-style blocks memx's own LLaMA measures in their place (the same linears).
LLAMA_FAMILY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
# Model types whose dense blocks memx-run splits by TP with Transformers' own plan for them, Megatron's split
# (models/hf_tensor_parallel.py), each checked against its unsplit model (tests/test_hf_tensor_parallel.py).
# Not: OLMo (its clip_qkv clamps the split q, k and v in place), Apertus (its xIELU activation's weights see a
# rank's share of the MLP width, the plan leaves their gradients unsummed), families whose plan gathers a split
# output or splits packed experts (Phi-3, OLMo 2, GLM, Llama 4, ...), any mixture (routed experts stay whole).
TP_MODEL_TYPES = (*LLAMA_FAMILY_TYPES, "gemma4_text", "gemma4_unified_text", "granite", "cohere", "gpt_neox",
                  "seed_oss", "exaone4", "arcee", "hyperclovax", "jais2", "nanochat", "ernie4_5", "phi", "nemotron",
                  "gptj", "codegen")
# Of those, families whose optional query and key norms (Cohere's use_qk_norm, Phi's qk_layernorm) see a rank's
# heads with weights the plan leaves whole.
QK_NORMS_OUTSIDE_TP_PLAN = ("cohere", "phi")

# Families with per-layer embeddings (Gemma 4's PLE): their config keys (width, rows) and their config class's
# defaults where a config.json omits them (Gemma 4 Unified's text model has none).
PER_LAYER_INPUT_KEYS = {"gemma4_text": (("hidden_size_per_layer_input", 256), ("vocab_size_per_layer_input", 262_144))}


def family_keys(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """GPT-Neo's, Falcon's, BLOOM's, MPT's and StarCoder's own names for the Llama-style keys (None: not given).
    GPT-Neo: ``num_layers``, ``num_heads``, its MLP 4x wide unless ``intermediate_size``; its local blocks
    stay whole-sequence ones, as Hugging Face's GPT-Neo computes every score and masks those out of
    its window. Falcon: its layers and heads (GPT-2's names in its first configs),
    ``ffn_hidden_size`` (4x unless given) and its key-value heads: ``num_kv_heads`` with
    ``new_decoder_architecture``, else one with ``multi_query`` (its default), else one per head.
    BLOOM: ``n_layer``, ``n_head``, a 4x GELU MLP (its embedding's own LayerNorm not counted), a key-value head
    per head (its model reads no ``num_key_value_heads``). StarCoder's (``gpt_bigcode``): GPT-2's names, its
    MLP ``n_inner`` wide (4x unless given), one key-value head with ``multi_query`` (its default), else one a head.
    MPT: ``d_model``, ``n_layers``, ``n_heads``, an ``expansion_ratio`` x GELU MLP, ``max_seq_len``."""
    if model_type not in ("gpt_neo", "falcon", "bloom", "mpt", "gpt_bigcode"):
        return {}
    if model_type == "gpt_bigcode":  # modeling_gpt_bigcode.py: kv_heads = 1 if multi_query else num_heads
        require_number(cfg.get("n_embd"), f"model ({where}).n_embd", lo=0, lo_open=True, hi=MAX_DIMENSION,
                       integer=True, fix="config.json must give it as a positive integer")
        heads = cfg.get("n_head")
        return {"num_hidden_layers": cfg.get("n_layer"), "num_attention_heads": heads, "hidden_size": cfg["n_embd"],
                "num_key_value_heads": 1 if cfg.get("multi_query", True) else heads,
                "intermediate_size": cfg.get("n_inner") or 4 * cfg["n_embd"],
                "hidden_act": cfg.get("activation_function", "gelu_pytorch_tanh"),
                "max_position_embeddings": cfg.get("n_positions")}
    key = "d_model" if model_type == "mpt" else "hidden_size" if "hidden_size" in cfg or model_type != "bloom" \
        else "n_embed"  # BLOOM's first configs
    hidden = cfg.get(key)
    require_number(hidden, f"model ({where}).{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                   fix="config.json must give it as a positive integer")
    if model_type == "bloom":
        return {"num_hidden_layers": cfg.get("n_layer"), "num_attention_heads": cfg.get("n_head"),
                "num_key_value_heads": cfg.get("n_head"), "hidden_size": hidden, "intermediate_size": 4 * hidden,
                "hidden_act": "gelu"}
    if model_type == "mpt":
        ratio = cfg.get("expansion_ratio", 4)
        require_number(ratio, f"model ({where}).expansion_ratio", lo=0, lo_open=True, hi=64, integer=True)
        return {"num_hidden_layers": cfg.get("n_layers"), "num_attention_heads": cfg.get("n_heads"),
                "hidden_size": hidden, "intermediate_size": ratio * hidden, "hidden_act": "gelu",
                "max_position_embeddings": cfg.get("max_seq_len")}
    if model_type == "gpt_neo":
        return {"num_hidden_layers": cfg.get("num_layers"), "num_attention_heads": cfg.get("num_heads"),
                "intermediate_size": cfg.get("intermediate_size") or 4 * hidden,
                "hidden_act": cfg.get("activation_function", "gelu_new")}
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    if cfg.get("new_decoder_architecture"):
        kv_heads = cfg.get("num_kv_heads") or heads
    else:
        kv_heads = 1 if cfg.get("multi_query", True) else heads
    return {"num_hidden_layers": cfg.get("num_hidden_layers") or cfg.get("n_layer"), "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": cfg.get("ffn_hidden_size") or 4 * hidden,
            "hidden_act": cfg.get("activation", "gelu")}


# Families' own names for keys the reader asks by others' names (their Transformers attribute maps), each
# with the default their config class takes where a config.json omits it: (their key, the reader's, default).
RENAMED_KEYS = {
    "ernie4_5_moe": (("moe_num_experts", "num_experts", 64), ("moe_k", "num_experts_per_tok", 6),
                     ("moe_num_shared_experts", "n_shared_experts", 2),  # shared experts of the experts' width
                     ("moe_layer_start_index", "first_k_dense_replace", 1)),
    "exaone_moe": (("num_shared_experts", "n_shared_experts", 1),),
    "hy_v3": (("num_shared_experts", "n_shared_experts", 1),),  # modeling_hy_v3.py:348: of the experts' width
    "afmoe": (("num_shared_experts", "n_shared_experts", 2), ("num_dense_layers", "first_k_dense_replace", 1)),
    "granitemoeshared": (("shared_intermediate_size", "shared_expert_intermediate_size", 0),),
    "jetmoe": (("kv_channels", "head_dim", 128),),
    "minimax_m3_vl_text": (("shared_intermediate_size", "shared_expert_intermediate_size", 3072),),  # one shared MLP
    # Aria (modeling_aria.py's AriaTextMoELayer): every block's experts intermediate_size wide, its shared MLP
    # moe_num_shared_experts times that.
    "aria_text": (("moe_num_experts", "num_experts", 8), ("moe_topk", "num_experts_per_tok", 2),
                  ("moe_num_shared_experts", "n_shared_experts", 2),
                  ("intermediate_size", "moe_intermediate_size", 4096)),
}


def per_layer_inputs(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """Gemma 4's per-layer embeddings (:data:`PER_LAYER_INPUT_KEYS`): each block's input width
    (``hidden_size_per_layer_input``; 0 or null: none) and the table's rows."""
    if model_type not in PER_LAYER_INPUT_KEYS:
        return {}
    (width_key, width_default), (rows_key, rows_default) = PER_LAYER_INPUT_KEYS[model_type]
    width = cfg.get(width_key, width_default) or 0
    rows = cfg.get(rows_key, rows_default) or 0
    for key, value in ((width_key, width), (rows_key, rows)):
        require_number(value, f"model ({where}).{key}", lo=0, hi=MAX_DIMENSION, integer=True,
                       fix="config.json must give it as a non-negative integer")
    return {"per_layer_input_size": width, "per_layer_input_vocab": rows} if width else {}


def gemma4_mixture_keys(cfg: Mapping[str, Any], model_type: str) -> dict:
    """Gemma 4's mixture (``enable_moe_block``) in the reader's keys: its routed experts
    (``num_experts``, ``top_k_experts``, ``moe_intermediate_size``) beside the block's dense MLP of
    ``intermediate_size``, which every token runs through (a shared expert's part); without the flag
    no experts, whatever ``num_experts`` says (modeling_gemma4.py's Gemma4TextDecoderLayer)."""
    if not model_type.startswith("gemma4"):
        return {}
    if not cfg.get("enable_moe_block"):
        return {"num_experts": None}
    return {"num_experts_per_tok": cfg.get("top_k_experts"), "shared_expert_intermediate_size": cfg.get(
        "intermediate_size")}


def renamed_keys(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """The reader's keys a family gives under its own names (:data:`RENAMED_KEYS`), where the config
    does not give the reader's own. ERNIE 4.5's expert blocks run from its start index to the last
    block (``moe_layer_interval`` 1): others are refused."""
    if model_type == "ernie4_5_moe":
        layers, interval = cfg.get("num_hidden_layers") or 0, cfg.get("moe_layer_interval") or 1
        if interval != 1 or cfg.get("moe_layer_end_index", -1) not in (-1, layers - 1):
            raise ConfigError(f"model ({where}).moe_layer_interval", "dense MLP blocks among the expert ones at "
                              "places memx does not model", "memx models a mixture of experts' dense blocks as its "
                              "first ones")
    renamed = {}
    for theirs, ours, default in RENAMED_KEYS.get(model_type, ()):
        if cfg.get(ours) is None:
            value = cfg[theirs] if cfg.get(theirs) is not None else default
            require_number(value, f"model ({where}).{theirs}", lo=0, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a non-negative integer")
            renamed[ours] = value
    return renamed


def splits_by_tp(model_type: str, qk_norm: bool, experts: int) -> bool:
    """Whether memx's runtime splits the blocks of a Hugging Face config of ``model_type`` by TP
    (:data:`TP_MODEL_TYPES`, without experts or query and key norms its plan leaves whole)."""
    return model_type in TP_MODEL_TYPES and not experts and not (qk_norm and model_type in QK_NORMS_OUTSIDE_TP_PLAN)
