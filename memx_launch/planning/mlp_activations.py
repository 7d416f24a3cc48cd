"""What one block's MLP keeps for its backward and what that backward holds at once, in
:func:`~memx_launch.planning.activations.activation_bytes`' units (bytes per token and hidden
element at 2 bytes an element): a dense MLP's, or a mixture's (:mod:`~memx_launch.planning.experts`)."""

from __future__ import annotations

import numpy as np

from memx_launch.planning import activation_ops, experts
from memx_launch.specs.model import ModelSpec


def mlp_units(model: ModelSpec, tp, fp8_share, fused_activation: bool, expert_tp: int, quantized: bool,
              transformers_share: float | None, dtype_bytes: int) -> tuple:
    """(what the MLP's activation keeps, the down projection's kept input) of one block, in
    :func:`~memx_launch.planning.activations.activation_bytes`' units: SwiGLU's gate and up outputs, silu(gate) unless fused, and
    their product; GELU's input and output (as torch ops, :mod:`activation_ops`: its tanh form five
    tensors, measured on Transformers' ``gelu_new``; xIELU more); ReLU's output, also the down projection's
    input unless quantized; a mixture of experts' (:func:`~memx_launch.planning.experts.kept_units`)."""
    if model.num_experts:
        return experts.kept_units(model, tp, fp8_share, fused_activation, expert_tp, transformers_share,
                                 dtype_bytes=dtype_bytes)
    f, h = model.ffn_hidden_size if model.has_mlp else 0, model.hidden_size
    if model.gated_mlp:
        return (4.0 if fused_activation else 6.0) * f / h / tp, 2.0 * fp8_share * f / h / tp
    relu_output_is_fc2_input = model.relu_mlp and not quantized
    kept = 0.0 if relu_output_is_fc2_input else activation_ops.kept_units(model, fused_activation, dtype_bytes)
    return kept * f / h / tp, 2.0 * fp8_share * f / h / tp


def mlp_backward_units(model: ModelSpec, tp, fused_activation: bool = False,
                       transformers_share: float | None = None, *, dtype_bytes: int) -> np.ndarray:
    """What a dense MLP's backward holds at once beyond what the MLP keeps, in
    :func:`~memx_launch.planning.activations.activation_bytes`' units: its intermediate gradients, less the down projection's input,
    freed once that projection's backward has run. SwiGLU: the product's gradient and from it
    gate's (or silu's) and up's, while gate, silu(gate) and up are still kept: two f-wide tensors
    more (a fused activation the same: its [2f] input's gradient beside its input); GELU: one (its
    output is freed; as torch ops, :mod:`activation_ops`, its tanh form two, squared ReLU three);
    ReLU: two (its output stays for its own backward). A mixture's experts: not counted (an expert
    loop holds one expert's tokens, a grouped GEMM all of them), but Transformers' grouped GEMMs
    (``transformers_share``): per
    routed copy the larger of its gate-and-up output's gradient and what the backward of the
    routing weights' multiply holds first, beside everything the MLP keeps: the copy's h-wide
    gradient, its product with the weights and its product with the experts' output (summed
    into the weights' gradient after), three h-wide tensors, which bind where an expert's
    gate-and-up output is narrower than 3h (Qwen3-MoE's, DeepSeek's fine-grained experts); with
    a gated shared expert (Qwen2-MoE's) its output's gradient besides, which the gate's multiply
    made first (measured on Mixtral's, Qwen2-MoE's and Qwen3-MoE's layers, exactly at 1,024
    tokens: tests/test_transformers_blocks.py)."""
    tp = np.asarray(tp, dtype=np.float64)
    if model.num_experts and transformers_share is not None:
        width = (2.0 if model.gated_mlp else 1.0) * model.moe_ffn_hidden_size
        routed = 2.0 * transformers_share * model.experts_per_token * max(width / model.hidden_size, 3.0)
        return (routed + 2.0 * model.shared_expert_gate) / tp
    if not model.has_mlp or model.num_experts:
        return np.zeros_like(tp)
    tensors = 2.0 if model.gated_mlp or model.relu_mlp else activation_ops.backward_tensors(model, fused_activation,
                                                                                            dtype_bytes)
    return 2.0 * tensors * model.ffn_hidden_size / model.hidden_size / tp
