"""The checks a model's shape passes when it is made (``ModelSpec.__post_init__``): one clear
error naming the field and the fix for each size or combination memx does not price."""

from __future__ import annotations

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_name, require_number, require_type
from memx_launch.specs.hybrid import HYBRID_LAYER_KINDS

MAX_DIMENSION = 2**24
"""Bound on every size of a model (layers, hidden, heads, vocabulary, sequence)."""


def check_shape(model) -> None:
    """Refuse a ``ModelSpec`` whose sizes are out of range or whose fields contradict each other."""
    for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                 "ffn_hidden_size", "vocab_size", "seq_len"):
        require_number(getattr(model, name), f"model.{name}", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
    require_type(model.name, str, "model.name")
    require_name(model.name, "model.name")
    require_type(model.gated_mlp, bool, "model.gated_mlp")
    require_type(model.relu_mlp, bool, "model.relu_mlp")
    if model.relu_mlp and model.gated_mlp:
        raise ConfigError("model.relu_mlp", "set with gated_mlp (a gated ReLU is not modelled)",
                          "set gated_mlp: false for OPT's ReLU MLP, or drop relu_mlp")
    ops_flags = ("tanh_gelu_ops", "squared_relu_ops", "xielu_ops", "bloom_gelu_ops")
    for name in ops_flags:
        require_type(getattr(model, name), bool, f"model.{name}")
    ungated_ops = [name for name in ops_flags if getattr(model, name)]
    if ungated_ops and (model.gated_mlp or model.relu_mlp or len(ungated_ops) > 1):
        raise ConfigError(f"model.{ungated_ops[-1]}", "set with a gated or ReLU MLP or another activation's ops (it "
                          "describes an ungated MLP's one activation)", "set gated_mlp: false and relu_mlp: false, "
                          "and one of tanh_gelu_ops, squared_relu_ops, xielu_ops, bloom_gelu_ops")
    require_type(model.tie_embeddings, bool, "model.tie_embeddings")
    require_type(model.layer_norm, bool, "model.layer_norm")
    require_type(model.linear_biases, bool, "model.linear_biases")
    require_number(model.position_embeddings, "model.position_embeddings", lo=0, hi=MAX_DIMENSION, integer=True,
                   fix="the learned position table's rows, or 0 for rotary positions")
    require_type(model.parallel_blocks, bool, "model.parallel_blocks")
    require_type(model.lm_head, bool, "model.lm_head")
    for name in ("tensor_parallel_blocks", "qkv_bias", "shared_expert_gate", "logit_softcapping",
                 "attention_softcapping", "router_aux_loss", "attention_sinks", "clamped_glu", "expert_biases",
                 "qk_norm_after_rope", "weightless_norms", "clipped_qkv", "attention_sink_scale", "output_gate_linear",
                 "experts_take_every_token", "qk_norm_weightless", "alibi_attention"):
        require_type(getattr(model, name), bool, f"model.{name}")
    if model.clamped_glu and not (model.gated_mlp and model.num_experts):
        raise ConfigError("model.clamped_glu", "set without gated experts (it describes GPT-OSS's experts' GLU)",
                          "give num_experts and gated_mlp: true, or drop clamped_glu")
    if model.expert_biases and not model.num_experts:
        raise ConfigError("model.expert_biases", "set without experts", "give num_experts, or drop expert_biases")
    if model.experts_take_every_token and not model.num_experts:
        raise ConfigError("model.experts_take_every_token", "set without experts",
                          "give num_experts, or drop experts_take_every_token")
    require_number(model.rope_theta, "model.rope_theta", lo=0, lo_open=True, hi=1e12, fix="e.g. 10000 or 500000")
    require_number(model.norm_eps, "model.norm_eps", lo=0, lo_open=True, hi=1, fix="e.g. 1e-5")
    require_number(model.attention_head_dim, "model.attention_head_dim", lo=0, hi=MAX_DIMENSION, integer=True,
                   fix="give one head's width, or 0 for hidden_size / num_heads")
    if not model.attention_head_dim and model.hidden_size % model.num_heads:
        raise ConfigError("model.hidden_size", f"{model.hidden_size} is not divisible by "
                          f"num_heads={model.num_heads}", "use a multiple of num_heads, or give attention_head_dim")
    for name in ("num_experts", "experts_per_token", "expert_ffn_hidden_size", "shared_expert_ffn_hidden_size"):
        require_number(getattr(model, name), f"model.{name}", lo=0, hi=MAX_DIMENSION, integer=True)
    if model.num_experts and not 1 <= model.experts_per_token <= model.num_experts:
        raise ConfigError("model.experts_per_token", f"{model.experts_per_token} of {model.num_experts} experts",
                          "give the experts each token is routed to (top-k), at least 1")
    require_number(model.sliding_window, "model.sliding_window", lo=0, hi=MAX_DIMENSION, integer=True)
    require_number(model.full_attention_layers, "model.full_attention_layers", lo=0, hi=model.num_layers,
                   integer=True, fix=f"give how many of the {model.num_layers} blocks attend to the whole sequence")
    require_number(model.attention_chunk_size, "model.attention_chunk_size", lo=0, hi=MAX_DIMENSION, integer=True)
    require_type(model.qk_norm, bool, "model.qk_norm")
    require_type(model.value_norm, bool, "model.value_norm")
    require_type(model.experts_beside_mlp_norms, bool, "model.experts_beside_mlp_norms")
    for name in ("per_layer_input_size", "per_layer_input_vocab"):
        require_number(getattr(model, name), f"model.{name}", lo=0, hi=MAX_DIMENSION, integer=True)
    require_type(model.post_norms, bool, "model.post_norms")
    require_type(model.pre_norms, bool, "model.pre_norms")
    if not (model.pre_norms or model.post_norms):
        raise ConfigError("model.pre_norms", "off without post_norms: a block with no norms", "set post_norms too")
    require_type(model.norm_weight_in_fp32, bool, "model.norm_weight_in_fp32")
    if model.post_norms and model.parallel_blocks:
        raise ConfigError("model.post_norms", "set with parallel_blocks", "give a block one of them")
    if model.attention_chunk_size and model.sliding_window:
        raise ConfigError("model.attention_chunk_size", "set beside sliding_window",
                          "give the local blocks a window or chunks, not both")
    for name in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim", "mtp_layers"):
        require_number(getattr(model, name), f"model.{name}", lo=0, hi=MAX_DIMENSION, integer=True)
    if not model.kv_lora_rank and (model.q_lora_rank or model.rope_head_dim or model.v_head_dim):
        raise ConfigError("model.kv_lora_rank", "0, but q_lora_rank, rope_head_dim or v_head_dim is set",
                          "give the latent attention's kv_lora_rank, or drop the others")
    require_number(model.dense_layers, "model.dense_layers", lo=0, hi=model.num_layers - 1, integer=True,
                   fix="give how many first blocks have a dense MLP, fewer than the blocks")
    if model.dense_layers and not model.num_experts:
        raise ConfigError("model.dense_layers", "set on a model without experts", "give num_experts, or drop it")
    require_number(model.moe_layer_step, "model.moe_layer_step", lo=1, hi=model.num_layers, integer=True,
                   fix="give every how many blocks one runs the experts, at most the blocks (1: every one)")
    if model.moe_layer_step > 1 and not model.num_experts:
        raise ConfigError("model.moe_layer_step", "set on a model without experts", "give num_experts, or drop it")
    if model.moe_layer_step > 1 and model.dense_layers:
        raise ConfigError("model.moe_layer_step", "set beside dense_layers",
                          "give a mixture of experts dense first blocks or interleaved ones, not both")
    require_number(model.expert_groups, "model.expert_groups", lo=0, hi=MAX_DIMENSION, integer=True)
    if model.expert_groups and (not model.num_experts or model.num_experts % model.expert_groups
                               or not 1 <= model.expert_groups_per_token <= model.expert_groups
                               or model.experts_per_token > model.expert_groups_per_token
                               * (model.num_experts // model.expert_groups)):
        raise ConfigError("model.expert_groups", f"{model.expert_groups} groups, {model.expert_groups_per_token} a "
                          f"token, for {model.num_experts} experts and top-{model.experts_per_token}",
                          "give groups dividing the experts, and per token at least one and enough for top-k")
    if model.experts_per_token and not model.num_experts:
        raise ConfigError("model.experts_per_token", "set without num_experts", "give num_experts, or drop it")
    if model.num_heads % model.num_kv_heads:
        raise ConfigError("model.num_kv_heads", f"{model.num_kv_heads} does not divide "
                          f"num_heads={model.num_heads}", "use a divisor of num_heads")
    check_hybrid(model)


MAMBA_FIELDS = ("mamba_heads", "mamba_head_dim", "mamba_state_size", "mamba_groups", "mamba_conv_kernel",
                "mamba_chunk_size")
DELTANET_FIELDS = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                   "linear_conv_kernel", "linear_chunk_size")
# What a hybrid model cannot have beside its pattern: memx prices none of these in one (field, what).
_NOT_IN_HYBRID = (("dense_layers", "dense first blocks"), ("kv_lora_rank", "latent attention"),
                  ("parallel_blocks", "parallel blocks"), ("linear_biases", "linear biases"),
                  ("post_norms", "sandwich norms"), ("sliding_window", "sliding-window attention"),
                  ("attention_chunk_size", "chunked attention"), ("mtp_layers", "multi-token prediction"))


def check_hybrid(model) -> None:
    """Refuse a pattern memx does not price: another length than the layers, characters other
    than M, G, *, - and E, experts without E layers (or E layers without experts), interleaved
    expert blocks, a hybrid model with any of :data:`_NOT_IN_HYBRID`, and Mamba or Gated DeltaNet
    layers without their sizes; an output gate on latent attention."""
    require_type(model.hybrid_pattern, str, "model.hybrid_pattern")
    if model.layer_kind not in ("", *HYBRID_LAYER_KINDS.values()):
        raise ConfigError("model.layer_kind", repr(model.layer_kind), "leave it out: hybrid_pattern sets it")
    for name in MAMBA_FIELDS + DELTANET_FIELDS:
        require_number(getattr(model, name), f"model.{name}", lo=0, hi=MAX_DIMENSION, integer=True)
    require_type(model.attention_output_gate, bool, "model.attention_output_gate")
    if model.attention_output_gate and model.kv_lora_rank:
        raise ConfigError("model.attention_output_gate", "set with latent attention, whose gate memx does not price",
                          "drop attention_output_gate, or kv_lora_rank")
    pattern = model.hybrid_pattern
    if not pattern:
        return
    if ("E" in pattern) != bool(model.num_experts):
        raise ConfigError("model.num_experts", f"{model.num_experts}, for a pattern with"
                          + "out" * ("E" not in pattern) + " expert layers (E)",
                          "give the E layers' experts, and experts only with E layers")
    other = "".join(sorted(set(pattern) - set(HYBRID_LAYER_KINDS)))
    if other or len(pattern) != model.num_layers:
        raise ConfigError("model.hybrid_pattern", f"{len(pattern)} characters" + f", {other!r} among them" * bool(other),
                          f"give num_layers={model.num_layers} characters of M (Mamba), G (Gated DeltaNet), "
                          "* (attention), - (MLP) and E (experts)")
    if model.moe_layer_step > 1:  # the pattern places the expert layers
        raise ConfigError("model.moe_layer_step", "set on a hybrid model", "drop it: E in hybrid_pattern places experts")
    for field, what in _NOT_IN_HYBRID:
        if getattr(model, field):
            raise ConfigError(f"model.{field}", f"set on a hybrid model: memx prices no {what} in one",
                              f"drop {field}, or hybrid_pattern")
    if "M" in pattern and not (all(getattr(model, name) for name in MAMBA_FIELDS)
                               and model.mamba_heads % model.mamba_groups == 0):
        raise ConfigError("model.mamba_heads", f"{model.mamba_heads} heads in {model.mamba_groups} groups",
                          "give the Mamba layers' heads (a multiple of mamba_groups) and non-zero sizes")
    if "G" in pattern and not (all(getattr(model, name) for name in DELTANET_FIELDS)
                               and model.linear_value_heads % model.linear_key_heads == 0):
        raise ConfigError("model.linear_value_heads", f"{model.linear_value_heads} value heads over "
                          f"{model.linear_key_heads} key heads", "give the Gated DeltaNet layers' key heads, value "
                          "heads (a multiple of them) and non-zero sizes")
