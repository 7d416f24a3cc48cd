"""What each of Megatron's recompute modules (``--recompute-modules``, memx's selective level
with ``recompute_modules``) keeps no more of a block's activations. No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning import experts
from memx_launch.specs.model import ModelSpec


def dropped_by_module(model: ModelSpec, tp, attention_core, heads_qkv, normed, mlp_kept, mlp_input, input_share,
                      fused_activation: bool) -> dict:
    """What each of Megatron's recompute modules keeps no more, in
    :func:`~memx_launch.planning.activations.activation_bytes`' units:
    ``core_attn`` the softmax's statistics or probabilities, ``mla_up_proj`` latent attention's
    Q, K and V, ``layernorm`` the 16-bit normed tensors the linears keep (not quantized ones),
    ``moe_act`` the routed experts' down-projection inputs (and an unfused activation's tensors beyond its
    input: :func:`~memx_launch.planning.experts.unfused_activation_units`), ``mlp`` a dense MLP's kept tensors,
    ``moe`` everything a mixture of experts' MLP keeps, ``shared_experts`` its shared expert's."""
    experts_on = bool(model.num_experts)
    routed = (2.0 * input_share * model.experts_per_token * model.moe_ffn_hidden_size / model.hidden_size
              / np.asarray(tp, dtype=np.float64)) if experts_on else 0.0
    shared = sum(experts.shared_expert_units(model, tp, input_share, fused_activation, transformers_blocks=False)
                 ) if experts_on else 0.0
    return {"core_attn": attention_core, "mla_up_proj": heads_qkv if model.kv_lora_rank else 0.0, "layernorm": normed,
            "moe_act": routed + experts.unfused_activation_units(model, tp, fused_activation),
            "mlp": 0.0 if experts_on else mlp_kept + mlp_input,
            "moe": mlp_kept + mlp_input if experts_on else 0.0, "shared_experts": shared}
