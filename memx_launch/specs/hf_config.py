"""Reading a model's shape from a Hugging Face config (a ``config.json``, or a loaded model's ``config.to_dict()``):
the Llama (4 included), Mistral, Qwen, Gemma, Mixtral, DeepSeek, GLM and GPT-OSS families, GPT-2 style keys, OPT's,
GPT-Neo's, Falcon's, BLOOM's, MPT's and StarCoder's, the language model of a multimodal config (its ``text_config``)
and Nemotron-H's hybrid of Mamba-2, attention and MLP layers. Other hybrid and recurrent families (linear
attention, other Mamba hybrids, RWKV) are refused by name."""

from __future__ import annotations

import os
from typing import Any, Mapping

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number, require_type
from memx_launch.specs.hf_family_keys import (family_keys, gemma4_mixture_keys, per_layer_inputs, renamed_keys,
                                              splits_by_tp)
from memx_launch.specs.hf_hybrid import DELTANET_TYPES, LINEAR_ATTENTION, hybrid_of
from memx_launch.specs.inputs import load_json
from memx_launch.specs.model import MAX_DIMENSION, ModelSpec

# Model types whose blocks are GPT-2 style: LayerNorm with a bias, a bias on every linear layer.
GPT_STYLE = ("gpt2", "opt", "gpt_neo", "phi", "bloom", "gpt_bigcode")
# Model types whose q, k and v linears carry biases, the block's other linears none (by prefix: Qwen2,
# Qwen2-MoE); others say it with a key: StableLM's use_qkv_bias, the Llama family's attention_bias
# (Seed-OSS; Llama's own adds the output projection's h biases, which memx does not count).
QKV_BIAS = ("qwen2",)
QKV_BIAS_KEYS = ("use_qkv_bias", "attention_bias")
# Model types whose shared expert's output passes a sigmoid gate of h weights (by prefix).
SHARED_EXPERT_GATE = ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
# Model types whose config class ties the head to the embedding unless told otherwise (by prefix:
# Gemma 2 and Gemma 3's text model are gemma2 and gemma3_text).
TIED_BY_DEFAULT = ("gpt2", "opt", "gemma", "gpt_neo", "falcon", "cohere", "bloom", "mpt")
# Model types with a gated MLP whose activation is not SiLU (Gemma: GeGLU), by prefix.
GATED_GELU = ("gemma",)
# Model types whose attention and MLP read one normed input side by side, and the config key
# that turns it off (GPT-J, CodeGen, Cohere and Phi-1/2 always; GPT-NeoX's use_parallel_residual, Falcon's
# parallel_attn).
PARALLEL_BLOCK_KEYS = {"gptj": None, "codegen": None, "cohere": None, "cohere2": None, "cohere2_moe": None, "phi": None,
                       "gpt_neox": "use_parallel_residual", "falcon": "parallel_attn"}
# Families with blocks other than softmax attention's (linear attention, Mamba, RWKV's recurrence),
# which memx does not model: by model type, and by the key naming such blocks in a config.
OTHER_BLOCK_TYPES = ("kimi_linear", "minimax", "minimax_m1", "jamba", "bamba", "zamba",
                     "zamba2", "falcon_h1", "granitemoehybrid", "lfm2", "mamba", "mamba2", "falcon_mamba", "rwkv",
                     "recurrent_gemma")
OTHER_BLOCK_KEYS = ("full_attention_interval", "linear_attn_config", "attn_type_list", "hybrid_override_pattern",
                    "attn_layer_period", "mamba_d_ssm", "ssm_cfg")
# Families whose torch-op norms multiply their weight in fp32 and cast after: Gemma's x * (1 + w),
# OLMo 2's and GPT-OSS's (self.weight * x).to(dtype), where Llama's casts first (by prefix).
FP32_WEIGHT_NORM_TYPES = ("gemma", "olmo2", "olmo3", "flex_olmo", "gpt_oss", "afmoe", "minimax_m3")
# Families whose blocks normalise the attention's and the MLP's outputs too (Gemma 2 and 3's sandwich;
# GLM-4's dense model, not its mixtures glm4_moe and glm4_moe_lite).
POST_NORM_TYPES = ("gemma2", "gemma3", "gemma4", "glm4", "afmoe", "kolibri1")
# Families whose blocks normalise those outputs unless their config's key turns it off (HyperCLOVA X's post_norm1
# and post_norm2).
POST_NORM_KEYS = {"hyperclovax": "use_post_norm"}
# Families whose blocks normalise only the attention's and the MLP's outputs (OLMo 2's reordering).
POST_NORM_ONLY_TYPES = ("olmo2", "olmo3", "flex_olmo", "exaone4")
# Families that normalise every query and key head with no config key saying so (by prefix).
QK_NORM_TYPES = ("qwen3", "gemma3", "gemma4", "olmo2", "olmo3", "olmoe", "exaone4", "exaone_moe", "hunyuan_v1", "dots1",
                 "apertus", "flex_olmo", "afmoe", "mellum", "nanochat", "kolibri1", "hy_v3", "laguna", "minimax_m3")
# Families whose queries and keys Transformers normalises whatever their config's use_qk_norm says: MiniMax-M2's
# q_norm and k_norm over all heads' width at once (modeling_minimax_m2.py's MiniMaxM2Attention builds them always).
QK_NORM_ALWAYS_TYPES = ("minimax_m2",)
# Families that also normalise every value head, without a weight (Gemma 4's v_norm), by prefix.
VALUE_NORM_TYPES = ("gemma4",)
# Families whose sinks scale the attention's output after the softmax (Granite SWA's), not join it.
SINK_SCALE_TYPES = ("granite_swa", "granitemoe_swa")
# Hugging Face's layer_types that memx models: whole-sequence, sliding-window and chunked attention.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def model_from_hf_config(path: str, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face style ``config.json`` (LLaMA, Mistral, Qwen2 families; GPT-2 style keys)."""
    cfg = load_json(path, "--model", fix="pass a Hugging Face config.json")
    if not isinstance(cfg, dict):
        raise ConfigError(f"model ({path})", "config.json must be a JSON object", "pass a Hugging Face config.json")
    if cfg.get("_name_or_path") is not None:
        require_type(cfg["_name_or_path"], str, f"model ({path})._name_or_path")
    return model_from_hf_dict(cfg, name or cfg.get("_name_or_path") or _name_from_path(path), where=path)


def _name_from_path(path: str) -> str:
    """A config's model name where it names none: its folder's for a ``config.json`` (a Hugging
    Face checkpoint's layout), else the file's own (``gemma2-9b.json`` is ``gemma2-9b``)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "config" else stem


def model_from_hf_dict(cfg: Mapping[str, Any], name: str, where: str = "config") -> ModelSpec:
    """The shape in a Hugging Face config's dict (``model.config.to_dict()``, or a config.json):
    Llama-style keys, GPT-2's (``n_layer``, ...) or OPT's (``ffn_dim``); in a multimodal config
    (Llama 4, Gemma 3, Mistral 3), its language model's ``text_config`` (the vision encoder is not
    planned)."""
    # A config naming its architectures names its head: causal-LM and generation classes have an LM head.
    architectures = cfg.get("architectures") or []
    require_type(architectures, list, f"model ({where}).architectures")
    lm_head = not architectures or any(k in str(a) for a in architectures
                                       for k in ("CausalLM", "LMHead", "ForConditionalGeneration"))
    if "num_hidden_layers" not in cfg and "n_layer" not in cfg and isinstance(cfg.get("text_config"), dict):
        # The wrapper may say whether the head is tied (Llama 4's does); its text_config then need not.
        tied = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
        cfg, where = {**tied, **cfg["text_config"]}, f"{where}.text_config"
    model_type = cfg.get("model_type", "gpt2" if "n_layer" in cfg else "llama")
    require_type(model_type, str, f"model ({where}).model_type")
    _refuse_other_blocks(cfg, model_type, where)
    rope = cfg.get("rope_parameters")  # Transformers 5 keeps the RoPE base and share there (model.config.to_dict())
    if isinstance(rope, dict):
        cfg = {**cfg, **{k: rope[k] for k in ("rope_theta", "partial_rotary_factor")
                         if cfg.get(k) is None and rope.get(k) is not None}}
    if "intermediate_size" not in cfg and cfg.get("moe_intermediate_size"):  # experts in every block (Qwen3.5 MoE)
        cfg = {**cfg, "intermediate_size": cfg["moe_intermediate_size"]}
    if "ffn_dim" in cfg and cfg.get("intermediate_size") is None:  # OPT
        cfg = {**cfg, "intermediate_size": cfg["ffn_dim"], "hidden_act": cfg.get("activation_function", "relu")}
    cfg = {**cfg, **{k: v for k, v in family_keys(cfg, model_type, where).items() if v is not None}}
    cfg = {**cfg, **renamed_keys(cfg, model_type, where), **gemma4_mixture_keys(cfg, model_type)}
    if "n_layer" in cfg and "num_hidden_layers" not in cfg:  # GPT-2's names (GPT-2, GPT-J): GELU, 4x unless n_inner
        require_number(cfg.get("n_embd"), f"model ({where}).n_embd", lo=0, lo_open=True, hi=MAX_DIMENSION,
                       integer=True, fix="config.json must give it as a positive integer")
        cfg = {"num_hidden_layers": cfg["n_layer"], "hidden_size": cfg.get("n_embd"),
               "num_attention_heads": cfg.get("n_head"),
               "intermediate_size": cfg.get("n_inner") or 4 * int(cfg.get("n_embd") or 0),
               "vocab_size": cfg.get("vocab_size"), "hidden_act": cfg.get("activation_function", "gelu"),
               "max_position_embeddings": cfg.get("n_positions") or cfg.get("n_ctx") or 1024,
               "tie_word_embeddings": cfg.get("tie_word_embeddings"),
               "layer_norm_epsilon": cfg.get("layer_norm_epsilon")}
        cfg = {k: v for k, v in cfg.items() if v is not None}
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise ConfigError(f"model ({where})", f"config.json lacks {', '.join(missing)}",
                          "use a decoder-only config with these keys (or GPT-2's n_layer, n_embd, n_head)")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "num_key_value_heads", "max_position_embeddings"):
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a positive integer")
    if cfg.get("hidden_act") is not None:
        require_type(cfg["hidden_act"], str, f"model ({where}).hidden_act")
    if cfg.get("tie_word_embeddings") is not None:
        require_type(cfg["tie_word_embeddings"], bool, f"model ({where}).tie_word_embeddings")
    # Gemma 2 soft-caps its logits at 30 and its attention at 50 unless its config says otherwise (Gemma 3: neither).
    softcaps = {key: cfg.get(key, default if model_type == "gemma2" else None)
                for key, default in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))}
    for key, cap in softcaps.items():
        if cap is not None:
            require_number(cap, f"model ({where}).{key}", lo=0, lo_open=True)
    act = str(cfg.get("hidden_act", cfg.get("mlp_hidden_act", "silu")))  # Nemotron-H: mlp_hidden_act relu2
    gated = act in ("silu", "swiglu", "swish") or model_type.startswith(GATED_GELU) or model_type == "bitnet"  # relu2
    heads = cfg["num_attention_heads"]
    head_dim = 0
    if cfg.get("head_dim") is not None:
        require_number(cfg["head_dim"], f"model ({where}).head_dim", lo=0, lo_open=True, hi=MAX_DIMENSION,
                       integer=True, fix="config.json must give it as a positive integer")
        head_dim = 0 if cfg["head_dim"] * heads == cfg["hidden_size"] else cfg["head_dim"]
    tied = cfg.get("tie_word_embeddings", model_type.startswith(TIED_BY_DEFAULT))
    layer_norm, linear_biases = _norms_and_biases(cfg, model_type, where)
    for key in QKV_BIAS_KEYS:
        if cfg.get(key) is not None:
            require_type(cfg[key], bool, f"model ({where}).{key}")
    qkv_bias = not linear_biases and (model_type.startswith(QKV_BIAS) or any(cfg.get(k) for k in QKV_BIAS_KEYS))
    # Learned position tables: GPT-2's and StarCoder's n_positions rows, GPT-Neo's max_position_embeddings, OPT's
    # + 2 (its offset).
    positions = {"gpt2": cfg.get("max_position_embeddings") or 1024,
                 "gpt_bigcode": cfg.get("max_position_embeddings") or 1024,
                 "gpt_neo": cfg.get("max_position_embeddings") or 2048,
                 "opt": (cfg.get("max_position_embeddings") or 2048) + 2}.get(model_type, 0)
    # The MLP width (a mixture's dense blocks may set their own), the experts and local attention.
    blocks = {"ffn_hidden_size": cfg["intermediate_size"], **_experts_of(cfg, model_type, where),
              **_local_attention_of(cfg, model_type, where), **hybrid_of(cfg, model_type, where)}
    latent = _latent_attention_of(cfg, where)
    head_dim = latent.pop("attention_head_dim", head_dim)
    parallel = False
    if model_type in PARALLEL_BLOCK_KEYS:
        key = PARALLEL_BLOCK_KEYS[model_type]
        parallel = True if key is None else cfg.get(key, True)
        require_type(parallel, bool, f"model ({where}).{key}")
    qk_norm = _qk_norm_of(cfg, model_type, where)
    return ModelSpec(
        name=name,
        num_layers=blocks.pop("num_layers", cfg["num_hidden_layers"]),
        hidden_size=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"],
        seq_len=min(cfg.get("max_position_embeddings") or 4096, 8192),
        gated_mlp=gated, relu_mlp=act == "relu" and not gated,  # OPT's MLP: ReLU
        tanh_gelu_ops=act == "gelu_new" and not gated,  # Transformers' gelu_new: GPT-2, GPT-J, Phi
        squared_relu_ops=act == "relu2" and not gated, xielu_ops=act == "xielu" and not gated,  # Arcee; Apertus
        bloom_gelu_ops=model_type == "bloom",  # modeling_bloom.py's GeLUFunction: bloom_gelu_back as torch ops
        tie_embeddings=bool(tied),
        layer_norm=layer_norm,
        linear_biases=linear_biases,
        qkv_bias=qkv_bias,
        position_embeddings=positions,
        parallel_blocks=parallel,
        lm_head=lm_head,
        tensor_parallel_blocks=splits_by_tp(model_type, qk_norm, blocks.get("num_experts", 0)),
        attention_head_dim=head_dim,
        qk_norm=qk_norm, qk_norm_weightless=qk_norm and model_type.startswith(("llama4", "nanochat")),
        qk_norm_after_rope=model_type.startswith(("hunyuan_v1", "nanochat")),  # NanoChat: RoPE, then its q and k norms
        weightless_norms=model_type == "nanochat",  # NanoChatRMSNorm: no weight (modeling_nanochat.py:44-53)
        value_norm=model_type.startswith(VALUE_NORM_TYPES),
        experts_beside_mlp_norms=model_type.startswith("gemma4") and bool(blocks.get("num_experts")),
        **per_layer_inputs(cfg, model_type, where),
        clipped_qkv=model_type == "olmo" and cfg.get("clip_qkv") is not None,  # modeling_olmo.py: clamp_
        centred_norm_ops=model_type.startswith("cohere"),  # CohereLayerNorm: torch ops, x - mean twice
        # Phi-3's, Phi-4-multimodal's and MiniMax-M3's rotary concatenates even whole (M3's reads no rotary_dim)
        rotary_concatenates=model_type in ("phi3", "phi4_multimodal", "minimax_m3_vl_text") or _partial_rotary(
            cfg, head_dim or cfg["hidden_size"] // heads, where),
        post_norms=_post_norms_of(cfg, model_type, where),
        pre_norms=not model_type.startswith(POST_NORM_ONLY_TYPES),
        norm_weight_in_fp32=model_type.startswith(FP32_WEIGHT_NORM_TYPES),
        logit_softcapping=softcaps["final_logit_softcapping"] is not None,
        attention_softcapping=softcaps["attn_logit_softcapping"] is not None,
        attention_sinks=model_type in ("gpt_oss", "mimo_v2_flash") + SINK_SCALE_TYPES,  # a learned logit per head
        attention_sink_scale=model_type in SINK_SCALE_TYPES,  # Granite SWA's: sigmoid(lse - sink) after AV
        alibi_attention=model_type in ("bloom", "mpt"),  # scores plus the ALiBi bias, fp32 softmax, AV: torch ops
        attention_output_gate=blocks.pop("attention_output_gate", False) or model_type == "afmoe",
        output_gate_linear=model_type == "afmoe",  # AFMoE's sigmoid(gate_proj(x)) * out: a linear of its own
        clamped_glu=cfg.get("swiglu_limit") is not None,  # GPT-OSS's experts' clamped GLU
        expert_biases=model_type == "gpt_oss",  # and its experts' biases
        **blocks,
        **latent,
        **{field: cfg[key] for field, key in (("rope_theta", "rope_theta"), ("norm_eps", "rms_norm_eps"),
                                              ("norm_eps", "layer_norm_epsilon"), ("norm_eps", "layer_norm_eps"))
           if cfg.get(key) is not None},
    )


def _norms_and_biases(cfg: Mapping[str, Any], model_type: str, where: str) -> tuple[bool, bool]:
    """(LayerNorm with a bias, a bias on every linear layer) of a family's blocks: GPT-2 style ones
    both (OPT's ``enable_bias`` may drop the biases), StarCoder2's by its ``use_bias``, GPT-NeoX's
    and Jais 2's by their ``attention_bias``, Falcon's by its ``bias`` (none by default), Nemotron's
    LayerNorm1P (torch's kernel, weight + 1) by its ``attention_bias`` (none by default; its ``mlp_bias``
    not read); StableLM's, PhiMoE's and OLMo 1's LayerNorm alone (their q, k and v biases, if any, are
    read apart); the Llama family and MPT neither (Hugging Face's MPT: weight-only norms, counted as
    RMSNorm's weight, and no linear biases; memx-run reads its LayerNorm kernels off the block)."""
    if model_type in ("stablelm", "phimoe", "olmo"):  # OLMo 1's: F.layer_norm without weight or bias
        return True, False
    key, default = {"falcon": ("bias", False), "starcoder2": ("use_bias", True), "gpt_neox": ("attention_bias", True),
                    "jais2": ("attention_bias", True), "nemotron": ("attention_bias", False),
                    "modernbert-decoder": ("attention_bias", False)}.get(
        model_type, ("enable_bias", True))
    flag = cfg.get(key, default)
    require_type(flag, bool, f"model ({where}).{key}")
    layer_norm = model_type in GPT_STYLE or model_type in ("falcon", "starcoder2", "gpt_neox", "jais2", "nemotron",
                                                           "persimmon", "modernbert-decoder")  # nn.LayerNorm
    return layer_norm, layer_norm and flag


def _refuse_other_blocks(cfg: Mapping[str, Any], model_type: str, where: str) -> None:
    """Refuse a hybrid or recurrent family (:data:`OTHER_BLOCK_TYPES`, :data:`OTHER_BLOCK_KEYS`,
    ``layer_types`` beyond :data:`ATTENTION_LAYER_TYPES`): planned as attention, its time and
    memory would be wrong without a word."""
    fix = "memx models blocks of softmax attention (whole, sliding-window or chunked); plan such a model"
    if model_type in OTHER_BLOCK_TYPES:
        raise ConfigError(f"model ({where}).model_type", f"{model_type} has blocks other than softmax attention "
                          "(linear attention, Mamba or recurrent ones)", fix)
    own = {"nemotron_h": "hybrid_override_pattern", **dict.fromkeys(DELTANET_TYPES, "full_attention_interval")}.get(
        model_type)
    for key in OTHER_BLOCK_KEYS:
        if cfg.get(key) is not None and key != own:
            raise ConfigError(f"model ({where}).{key}", "names blocks other than softmax attention "
                              "(linear attention, Mamba or recurrent ones)", fix)
    types = cfg.get("layer_types")
    if types is not None:
        require_type(types, list, f"model ({where}).layer_types")
        known = ATTENTION_LAYER_TYPES + ((LINEAR_ATTENTION,) if model_type in DELTANET_TYPES else ())
        other = sorted({str(t) for t in types} - set(known))
        if other:
            raise ConfigError(f"model ({where}).layer_types", f"{', '.join(other)} blocks are not modelled", fix)


def _partial_rotary(cfg: Mapping[str, Any], head_dim: int, where: str) -> bool:
    """Rotary positions on part of each head: the config's ``partial_rotary_factor`` (StableLM,
    GLM, Phi, Persimmon) or ``rotary_pct`` (GPT-NeoX) below 1, or ``rotary_dim`` (GPT-J, CodeGen)
    below the head's width."""
    for key in ("partial_rotary_factor", "rotary_pct"):
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, lo_open=True, hi=1,
                           fix="config.json must give the share of each head that turns, in (0, 1]")
            if cfg[key] < 1:
                return True
    rotary_dim = cfg.get("rotary_dim")
    if rotary_dim is not None:
        require_number(rotary_dim, f"model ({where}).rotary_dim", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                       fix="config.json must give the width that turns as a positive integer")
    return rotary_dim is not None and rotary_dim < head_dim


def _post_norms_of(cfg: Mapping[str, Any], model_type: str, where: str) -> bool:
    """Norms on the attention's and the MLP's outputs: the family's (:data:`POST_NORM_TYPES`,
    :data:`POST_NORM_ONLY_TYPES`), or its key's (:data:`POST_NORM_KEYS`, on where omitted)."""
    key = POST_NORM_KEYS.get(model_type)
    if key is not None and cfg.get(key) is not None:
        require_type(cfg[key], bool, f"model ({where}).{key}")
        return cfg[key]
    family = model_type.startswith(POST_NORM_TYPES + POST_NORM_ONLY_TYPES) and not model_type.startswith("glm4_moe")
    return key is not None or family


def _qk_norm_of(cfg: Mapping[str, Any], model_type: str, where: str) -> bool:
    """A norm on every query and key head: the config's ``use_qk_norm`` (GLM-4.5, Llama 4, Cohere),
    ``qk_layernorm`` (Persimmon) or ``qk_norm``, else its family's (:data:`QK_NORM_TYPES`); always in a family
    whose Transformers model reads no such key (:data:`QK_NORM_ALWAYS_TYPES`)."""
    if model_type.startswith(QK_NORM_ALWAYS_TYPES):
        return True
    for key in ("use_qk_norm", "qk_layernorm", "qk_norm"):
        if cfg.get(key) is not None:
            require_type(cfg[key], bool, f"model ({where}).{key}")
            return cfg[key]
    return model_type.startswith(QK_NORM_TYPES)


def _local_attention_of(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """The blocks attending within a window or a chunk, and how many attend to the whole sequence.

    A ``sliding_window`` (unless ``use_sliding_window`` is off) applies to the blocks its
    ``layer_types`` mark ``sliding_attention``, one in Gemma 3's ``sliding_window_pattern`` attending
    to the whole sequence, Gemma 2's every other one, else every block (Mistral-7B v0.1). Llama 4's
    ``attention_chunk_size`` applies to the blocks ``layer_types`` mark ``chunked_attention``, else
    to those with rotary positions (``no_rope_layers`` 1; by default all but every
    ``no_rope_layer_interval``-th, 4)."""
    layers, types = cfg["num_hidden_layers"], cfg.get("layer_types")
    chunk = cfg.get("attention_chunk_size")
    if chunk:
        require_number(chunk, f"model ({where}).attention_chunk_size", lo=0, lo_open=True, hi=MAX_DIMENSION,
                       integer=True, fix="config.json must give it as a positive integer, or null")
        if types is not None:
            chunked = sum(t == "chunked_attention" for t in types)
        elif cfg.get("no_rope_layers"):
            rope = cfg["no_rope_layers"]
            require_type(rope, list, f"model ({where}).no_rope_layers")
            chunked = sum(bool(r) for r in rope)
        else:
            interval = cfg.get("no_rope_layer_interval") or 4
            require_number(interval, f"model ({where}).no_rope_layer_interval", lo=1, hi=MAX_DIMENSION, integer=True)
            chunked = layers - layers // interval
        return {"attention_chunk_size": chunk, "full_attention_layers": layers - chunked} if chunked else {}
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    require_number(window, f"model ({where}).sliding_window", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True,
                   fix="config.json must give it as a positive integer, or null")
    if types is not None:
        if "sliding_attention" not in types:
            return {}
        full = sum(t != "sliding_attention" for t in types)
    elif cfg.get("sliding_window_pattern"):
        require_number(cfg["sliding_window_pattern"], f"model ({where}).sliding_window_pattern", lo=1,
                       hi=MAX_DIMENSION, integer=True)
        full = layers // cfg["sliding_window_pattern"]
    else:
        full = layers // 2 if model_type == "gemma2" else 0
    return {"sliding_window": window, "full_attention_layers": full}


def _experts_of(cfg: Mapping[str, Any], model_type: str, where: str) -> dict:
    """The mixture-of-experts fields of a Hugging Face config: Mixtral's and GPT-OSS's
    ``num_local_experts``, Qwen's ``num_experts`` and ``moe_intermediate_size`` (Qwen2-MoE's shared
    expert), ERNIE 4.5's (renamed: :data:`~memx_launch.specs.hf_family_keys.RENAMED_KEYS`), DeepSeek's
    ``n_routed_experts`` and ``n_shared_experts`` (Nemotron 3's of
    ``moe_shared_expert_intermediate_size``), Llama 4's shared expert of its
    experts' width, and where the dense blocks are (DeepSeek's first ones, or all but every n-th:
    Llama 4's ``interleave_moe_layer_step``, Qwen's ``decoder_sparse_step``); none in a dense config."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if not experts:
        return {}
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "experts_per_token",
                "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts",
                "moe_shared_expert_intermediate_size"):
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a non-negative integer")
    interleaved = ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step")
    for key in ("first_k_dense_replace", "n_group", "topk_group") + interleaved:
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a non-negative integer")
    # Every step-th block runs the experts (Hugging Face's (i + 1) % step == 0); DeepSeek's
    # moe_layer_freq counts from the first block instead, and mlp_only_layers names any blocks.
    step = cfg.get("interleave_moe_layer_step") or cfg.get("decoder_sparse_step") or 1
    layers = cfg.get("num_hidden_layers") or 0
    listed = cfg.get("moe_layers")  # Llama 4's own list, where the config gives one
    if listed is not None and not isinstance(listed, list):
        raise ConfigError(f"model ({where}).moe_layers", f"must be a list of block indices, got {listed!r}",
                          "give the indices of the blocks that run the experts, or drop the key")
    if model_type in DELTANET_TYPES:  # their hybrid pattern places the dense blocks (hf_hybrid.deltanet_blocks_of)
        step = 1
    elif (cfg.get("mlp_only_layers") or (cfg.get("moe_layer_freq") or 1) > 1
            or (listed is not None and listed != list(range(step - 1, layers, step)))):
        raise ConfigError(f"model ({where})", "dense MLP blocks among the expert ones at places memx does not model",
                          "memx models a mixture of experts' dense blocks as its first ones (first_k_dense_replace) "
                          "or as all but every n-th block (interleave_moe_layer_step, decoder_sparse_step)")
    if cfg.get("output_router_logits") is not None:
        require_type(cfg["output_router_logits"], bool, f"model ({where}).output_router_logits")
    dense_layers = _leading_dense_layers(cfg, model_type, where)
    expert_ffn = cfg.get("moe_intermediate_size") or 0
    shared = (cfg.get("shared_expert_intermediate_size")  # Nemotron 3: each shared expert's own width
              or (cfg.get("n_shared_experts") or 0) * (cfg.get("moe_shared_expert_intermediate_size") or expert_ffn))
    dense_ffn = {}
    if model_type.startswith("llama4"):  # every MoE block's shared expert, of the experts' width
        shared = cfg["intermediate_size"]
        if step > 1:  # Maverick: its dense blocks' MLP is wider than an expert
            require_number(cfg.get("intermediate_size_mlp"), f"model ({where}).intermediate_size_mlp", lo=0,
                           lo_open=True, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give the dense blocks' MLP width as a positive integer")
            expert_ffn, dense_ffn = cfg["intermediate_size"], {"ffn_hidden_size": cfg["intermediate_size_mlp"]}
    return {"num_experts": experts, "experts_per_token": cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
            or 0, "expert_ffn_hidden_size": expert_ffn, "shared_expert_ffn_hidden_size": shared,
            "shared_expert_gate": bool(shared) and model_type.startswith(SHARED_EXPERT_GATE),
            "experts_take_every_token": model_type.startswith("llama4"),  # modeling_llama4.py's Llama4TextMoe
            "dense_layers": dense_layers, "moe_layer_step": step, **dense_ffn,
            "router_aux_loss": bool(cfg.get("output_router_logits")),
            **({"expert_groups": cfg["n_group"], "expert_groups_per_token": cfg.get("topk_group") or 0}
               if (cfg.get("n_group") or 1) > 1 else {})}


def _leading_dense_layers(cfg: Mapping[str, Any], model_type: str, where: str) -> int:
    """A mixture's first dense blocks: its ``mlp_layer_types`` (``dense`` and ``sparse``, which the
    Transformers models that have it read instead of ``first_k_dense_replace``: GLM-4.7-Flash's
    glm4_moe_lite, whose config class makes the first block dense where it is omitted), else
    ``first_k_dense_replace``. Dense blocks after an expert one are refused."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        return 1 if model_type == "glm4_moe_lite" else cfg.get("first_k_dense_replace") or 0
    require_type(types, list, f"model ({where}).mlp_layer_types")
    if not set(types) <= {"dense", "sparse"}:  # other kinds of block (hashed experts): as before, by the other keys
        return cfg.get("first_k_dense_replace") or 0
    dense = types.index("sparse") if "sparse" in types else len(types)
    if "dense" in types[dense:]:
        raise ConfigError(f"model ({where}).mlp_layer_types", "dense MLP blocks among the expert ones at places memx "
                          "does not model", "memx models a mixture of experts' dense blocks as its first ones")
    return dense


def _latent_attention_of(cfg: Mapping[str, Any], where: str) -> dict:
    """DeepSeek's multi-head latent attention (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``) and multi-token prediction (``num_nextn_predict_layers``)."""
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "num_nextn_predict_layers"):
        if cfg.get(key) is not None:
            require_number(cfg[key], f"model ({where}).{key}", lo=0, hi=MAX_DIMENSION, integer=True,
                           fix="config.json must give it as a non-negative integer, or null")
    mtp = {"mtp_layers": cfg["num_nextn_predict_layers"]} if cfg.get("num_nextn_predict_layers") else {}
    if not cfg.get("kv_lora_rank"):
        return mtp
    return {**mtp, "kv_lora_rank": cfg["kv_lora_rank"], "q_lora_rank": cfg.get("q_lora_rank") or 0,
            "attention_head_dim": cfg.get("qk_nope_head_dim") or 0, "rope_head_dim": cfg.get("qk_rope_head_dim") or 0,
            "v_head_dim": cfg.get("v_head_dim") or 0}
