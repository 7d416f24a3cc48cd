"""HBM traffic of a block's element-wise ops: what eager PyTorch reads and writes.

Every element-wise op (rotary embedding, the MLP's activation, residual adds, norms, dropout,
the softmax of unfused attention) reads its inputs from and writes its output to device memory;
their time is these bytes over the memory bandwidth. Counted op by op, in units of the training
dtype ``d`` where the op works in it; ``tests/test_framework_memory.py`` traces the ops of
memx's own block to check the counts. No torch import.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memx_launch.planning import activation_ops, experts, gated_deltanet, mamba, quantization
from memx_launch.planning.activations import kv_repeated, selective_modules
from memx_launch.planning.loss import SOFTCAP_PASSES
from memx_launch.planning.matmuls import linear_shapes
from memx_launch.planning.model_states import rank_layer_params
from memx_launch.planning.plan import NONE, SELECTIVE
from memx_launch.specs.hybrid import mixer_projections
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# Bytes per element that eager PyTorch's element-wise ops read and write, in units of the
# training dtype (d), forward and backward; tests/test_framework_memory.py traces memx's own
# block to check them. Rotary embedding on q and k (x1 cos - x2 sin, x1 sin + x2 cos and the
# stack: 9d; backward 14d), SwiGLU on the MLP width (silu, product: 5d; their gradients: 9d),
# GELU (2d; 3d), a residual add (3d; the gradient sum where the stream forks: 3d), a fused
# norm kernel (2d; 4d).
ROPE_BYTES = (9.0, 14.0)
SWIGLU_BYTES = (5.0, 9.0)
# Megatron's fused SwiGLU kernel (``fused_activation``: ``bias_swiglu``, weighted by the routing in the
# experts): forward one read of the gate-and-up output and one write, backward one read of the gradient
# and of that output and one write of its gradient.
FUSED_SWIGLU_BYTES = (3.0, 5.0)
# megatron-core's eager expert activation (``fused_activation`` off, GPT-OSS's recipe) beyond SWIGLU_BYTES,
# per element of the routed width: the grouped fc1's output chunked into gate and up (the chunk's backward
# writes both halves' gradients into a new tensor) and the product with the fp32 routing weights, cast
# back to d (traced: 11d forward, 23d backward; tests/test_framework_memory.py).
EAGER_ROUTED_EXTRA_BYTES = (6.0, 14.0)
# Transformers' experts (``transformers_blocks``) chunk one gate-and-up output too: the chunk's backward writes
# both halves' gradients into a new tensor (traced on its default gate: tests/test_framework_memory.py).
TRANSFORMERS_CHUNK_BYTES = (0.0, 4.0)
# GPT-OSS's clamped GLU (``clamped_glu``) unfused beyond SwiGLU, per element of the routed width: (d forward,
# d backward, bytes backward: the clamps' 1-byte masks). megatron-core's eager path adds the two clamps (its
# quick_gelu is compiled, as silu's kernel moves); Transformers' ops the clamps, the gate's sigmoid(1.702 gate)
# as ops and up + 1 (traced on the same gate-and-up output as SwiGLU's: tests/test_framework_memory.py).
CLAMP_BYTES = (4.0, 7.0, 8.0)
CLAMPED_GLU_OPS_EXTRA_BYTES = (11.0, 26.0, 8.0)
# megatron-core's TEGroupedMLP adds each expert's down-projection bias (``expert_biases``) after the grouped GEMM,
# weighed by the routing, as eager ops (``_apply_bias``): bias x probability in fp32 (the probabilities' dtype),
# the add, the experts' cat and the cast back. Bytes per element of a routed copy's hidden width (forward,
# backward), by the training dtype's bytes (traced: tests/test_framework_memory.py).
EXPERT_BIAS_BYTES = {2: (28.0, 40.0), 4: (24.0, 32.0)}
RESIDUAL_BYTES = (3.0, 3.0)
FUSED_NORM_BYTES = (2.0, 4.0)
# K and V repeated to the query heads (``repeat_kv``): each copied, read at the KV width and
# written at the query width; the backward sums the gradient back (read at the query width,
# written at the KV width): (q + kv) x d per token for each of K and V, each way.
REPEAT_KV_BYTES = (2.0, 2.0)


def clamped_glu_extra_bytes(model: ModelSpec, training: TrainingSpec, routed) -> tuple:
    """Bytes GPT-OSS's clamped GLU moves beyond SwiGLU on ``routed`` elements of the experts' width,
    forward and backward: none fused (Megatron's compiled kernel reads and writes what SwiGLU's does)."""
    if not model.clamped_glu or training.fused_activation:
        return 0.0, 0.0
    forward, backward, masks = CLAMPED_GLU_OPS_EXTRA_BYTES if training.transformers_blocks else CLAMP_BYTES
    d = float(training.dtype_bytes)
    return routed * forward * d, routed * (backward * d + masks)


def dropout_bytes(dtype_bytes: int) -> tuple[float, float]:
    """Torch's dropout kernel reads its input and writes the output and a 1-byte mask; its
    backward reads the gradient and the mask and writes the input's gradient."""
    return 2.0 * dtype_bytes + 1.0, 2.0 * dtype_bytes + 1.0


def unfused_norm_extra_bytes(dtype_bytes: int) -> tuple[float, float]:
    """HBM bytes per element one RMSNorm moves as torch ops beyond a fused kernel, forward and
    backward: what eager PyTorch's ops read and write (``tests/test_framework_memory.py`` traces
    them). The fused kernel reads its input and writes its output (2d), and its backward reads
    the gradient and the input and writes the input's gradient (about 4d).

    Forward: ``x.float()`` (d + 4), ``pow(2)`` (8), ``mean`` (4), the multiply by the rsqrt (8),
    the cast back (4 + d), the weight multiply (2d). Backward: the weight multiply's two
    gradients and the weight's row sum (6d), the cast (d + 4), the rsqrt multiply's gradient and
    its row sum (24), the mean's gradient, expanded and divided (8), pow's (28: ``x ** 1`` and two
    multiplies), the sum of the two paths into the fp32 copy (12), the first cast (4 + d). In
    fp32 the casts do not exist.
    """
    casts = 2.0 * dtype_bytes + 8.0 if dtype_bytes < 4 else 0.0
    return 20.0 + casts, 72.0 + 2.0 * dtype_bytes + casts


# Bytes per attention score of unfused attention, in units of the training dtype, forward and
# backward: QK^T written, the softmax read and written, AV reading it (4d); AV's backward writing
# the probabilities' gradient and reading the probabilities, the softmax backward reading both
# and writing the scores' gradient, read by both matmuls' backward (7d). Torch's softmax adds
# the clone of the scores' view and the out-of-place mask fill (4d) and the fill's backward (2d).
# Attention dropout adds :func:`dropout_bytes` per score.
SCORE_BYTES = {True: (4.0, 7.0), False: (8.0, 9.0)}
# Extra HBM bytes per attention score when torch's softmax runs on an fp32 copy of 16-bit scores:
# the casts up and back, forward (2 + 4, 4 + 2) and backward (the same), and the mask fill, softmax
# and their backward passes over 4-byte instead of 2-byte elements (about 6 x 2).
SOFTMAX_FP32_EXTRA_BYTES = 36.0


class QuantizedCasts(NamedTuple):
    """Elements a block of quantized linears quantizes per micro-batch (:func:`quantized_cast_elements`)."""

    forward: float
    """Cast by a linear forward: the attention output, a mixture's dispatched tokens."""
    backward: float
    """Cast by a linear backward: every linear's output gradient."""
    producer_outputs: float
    """The norms' and the MLP activation's outputs, which a kernel fused with the linear after it
    (Transformer Engine's LayerNormLinear and LayerNormMLP) writes quantized itself, or under a
    whole-tensor amax writes in 16 bits while finding the amax (``FUSED_NORM_AMAX``,
    ``FUSED_ACTIVATION_AMAX``), a cast following; standalone linears cast them as any input."""
    activation_input_grad: float
    """Of ``backward``, the activation's input gradient, whose amax its backward kernel finds
    (``FUSED_DACT_AMAX``)."""


def quantized_cast_elements(model: ModelSpec, tokens, hidden, tp) -> QuantizedCasts:
    """What a block of quantized linears quantizes (:class:`QuantizedCasts`); each cast reads the
    16-bit tensor and writes it quantized along both axes (:func:`quantized_cast_bytes`).
    ``hidden``: tokens x h, over TP with sequence parallelism."""
    mixer = mixer_projections(model)
    if mixer:  # the output projection's input; the input projection's output gradient
        return QuantizedCasts(tokens * mixer[1] / tp, tokens * mixer[0] / tp + 2.0 * hidden, 0.0, 0.0)
    q, kv, f = model.q_hidden_size, model.kv_hidden_size, model.active_ffn_hidden_size
    up = (2.0 if model.gated_mlp else 1.0) * f
    routed = tokens * model.experts_per_token * model.hidden_size / tp  # experts' inputs, and outputs' gradients
    return QuantizedCasts(tokens * q / tp + routed, tokens * (q + 2.0 * kv + up) / tp + 2.0 * hidden + routed,
                          model.pre_norms_per_block * hidden + tokens * f / tp, tokens * up / tp)


def quantized_cast_bytes(model: ModelSpec, training: TrainingSpec, tokens, hidden, tp) -> tuple:
    """(forward, backward) HBM bytes a block's quantized linears' casts move per micro-batch
    (:func:`quantized_cast_elements` at :func:`~memx_launch.planning.quantization.cast_bytes`):
    fused with their producers (Transformer Engine's layers) the producers' outputs cost nothing
    more under delayed scaling, MXFP8 and blockwise FP8, and a cast after an amax found as they
    were written under a whole-tensor amax; an eager block's standalone linears (``te.Linear``,
    torchao's ``Float8Linear``) cast them as any input. Linears without a weight cache
    (torchao's: no ``fp8_weight_cache``, no ``fp8_params``) cast each weight at each GEMM, forward
    and for the backward's input gradient; Transformer Engine's cache casts it once a step, not
    counted."""
    full, found = quantization.cast_bytes(training), quantization.cast_bytes(training, amax_found=True)
    casts = quantized_cast_elements(model, tokens, hidden, tp)
    forward, backward = casts.forward * full, casts.backward * full
    if training.eager_block:
        forward = forward + casts.producer_outputs * full
    elif training.quantized_linears in quantization.WHOLE_TENSOR_AMAX:
        forward = forward + casts.producer_outputs * found
        backward = backward - casts.activation_input_grad * (full - found)
    if not (training.fp8_weight_cache or training.fp8_params):
        weights = sum(n * k for n, k in linear_shapes(model, training, tp)) * quantization.cast_bytes(training, axes=1)
        forward, backward = forward + weights, backward + weights
    return forward, backward


def autocast_weight_cast_bytes(weights, training: TrainingSpec, forward_again=0.0) -> np.ndarray:
    """HBM bytes torch.autocast's casts of ``weights`` fp32 weights move in one micro-batch's
    forward and backward: each linear casts its weight to the training dtype at every forward
    (autocast's cache lives as long as its region, one forward), reading 4 bytes and writing d, and
    again in a recomputed forward (``forward_again``: the share of the forward's linear work that
    runs again); the backward casts the trained weights' 16-bit gradients back to fp32 (d in, 4
    out). A region over the step (``autocast_per_step``) casts the weights once a step instead
    (:func:`step_weight_cast_seconds`). Zero without autocast. Traced on memx's block under CPU
    autocast (tests/test_elementwise_casts.py)."""
    if not training.autocast:
        return np.zeros(np.broadcast_shapes(np.shape(weights), np.shape(forward_again)))
    forward = (1.0 + np.asarray(forward_again)) * (0.0 if training.autocast_per_step else 1.0)  # (again)
    casts = forward + (1.0 - training.frozen_fraction)  # and the backward's
    return np.asarray(weights, dtype=np.float64) * (4.0 + training.dtype_bytes) * casts


def step_weight_cast_seconds(params_on_rank, training: TrainingSpec, hbm_gbps, g: int) -> np.ndarray:
    """Seconds per micro-batch of autocast's casts of a rank's fp32 weights where its region spans
    the step (``autocast_per_step``, memx-run): once a step, 4 bytes read and d written a weight at
    ``hbm_gbps``, spread over the step's ``g`` micro-batches (the embedding's, whose lookup casts
    nothing, counted too); zero otherwise."""
    if not (training.autocast and training.autocast_per_step):
        return np.zeros(np.shape(params_on_rank))
    moved = np.asarray(params_on_rank, dtype=np.float64) * (4.0 + training.dtype_bytes)
    return moved / g / (np.asarray(hbm_gbps, dtype=np.float64) * 1e9)


def block_weight_cast_bytes(model: ModelSpec, training: TrainingSpec, tp, forward_again=0.0) -> np.ndarray:
    """:func:`autocast_weight_cast_bytes` of one block's weights on a rank (its dense ones over
    TP, its routed experts' over EP)."""
    dense, experts = rank_layer_params(model, training, tp)
    return autocast_weight_cast_bytes(dense + experts, training, forward_again)


def elementwise_traffic_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, recompute,
                              flash_attention=True) -> np.ndarray:
    """HBM bytes the element-wise ops of one block move for one micro-batch: forward, backward
    and the forward that recomputation runs again (everything under full recompute and under
    the op-level selective policy; rotary embedding, the MLP's activation and the scores under
    the attention-core one; K and V repeated to the query heads with them). Matmuls and the fused
    attention kernel are timed by their FLOPs instead.

    Per token, over TP where the tensors are split: residual adds and norms on the hidden size
    (over TP only with sequence parallelism), the query and key head norms (``qk_norm``), hidden
    dropout's masks and products, rotary embedding on q and k (LLaMA-style models), the MLP's
    activation on its width (eager ops, or Megatron's fused kernel; unfused experts also chunk
    their gate-and-up output, megatron-core's weigh it by the routing; GPT-OSS's clamped GLU
    unfused its clamps and ops, :func:`clamped_glu_extra_bytes`); without flash
    attention, per score of the rank's heads: :data:`SCORE_BYTES`, the fp32 softmax's extra
    passes, attention dropout and a soft cap (:data:`~memx_launch.planning.loss.SOFTCAP_PASSES`); with quantized
    linears their casts (:func:`quantized_cast_bytes`); a hybrid model's layer one residual add and one norm, and a Mamba or Gated DeltaNet layer's
    kernels (:func:`~memx_launch.planning.mamba.traffic_bytes`,
    :func:`~memx_launch.planning.gated_deltanet.traffic_bytes`); an attention output gate's.
    """
    d = float(training.dtype_bytes)
    tp = np.asarray(tp, dtype=np.float64)
    recompute = np.asarray(recompute)
    tokens = np.asarray(mbs, dtype=np.float64) * np.asarray(seq, dtype=np.float64)
    h, kv, f = model.hidden_size, model.kv_hidden_size, model.active_ffn_hidden_size
    hidden = tokens * h / (tp if training.sequence_parallel else 1.0)
    permuted = experts.permutation_bytes(model, training, tokens, tp, d)
    # megatron-core's eager bias of the experts' down projections on every routed copy, where the experts are its
    # (--setup megatron, and no setup: memx's defaults price its eager experts); others': not priced
    biased = model.expert_biases and training.setup in (None, "megatron")
    expert_bias = [tokens * model.experts_per_token * model.hidden_size / tp * b
                   for b in EXPERT_BIAS_BYTES[training.dtype_bytes]] if biased else (0.0, 0.0)
    if training.fused_norm:
        norm = (FUSED_NORM_BYTES[0] * d, FUSED_NORM_BYTES[1] * d)
    else:
        extra = unfused_norm_extra_bytes(training.dtype_bytes)
        norm = (FUSED_NORM_BYTES[0] * d + extra[0], FUSED_NORM_BYTES[1] * d + extra[1])
    dropout = dropout_bytes(training.dtype_bytes) if training.dropout else (0.0, 0.0)
    glu = FUSED_SWIGLU_BYTES if training.fused_activation else SWIGLU_BYTES
    mlp = glu if model.gated_mlp else activation_ops.hbm_bytes(model, training.fused_activation, training.dtype_bytes)
    # Elements of the experts' width over every routed copy, and what their unfused gate moves beyond SwiGLU's.
    routed = tokens * experts.copies_per_token(model, training) * model.moe_ffn_hidden_size / tp if model.num_experts \
        else 0.0
    gate_extra = (0.0, 0.0) if training.fused_activation else TRANSFORMERS_CHUNK_BYTES \
        if training.transformers_blocks else EAGER_ROUTED_EXTRA_BYTES
    clamped = clamped_glu_extra_bytes(model, training, routed)
    # LLaMA-style (gated MLP) models rotate q and k in every block; GPT-style ones add learned
    # positions once, at the embedding.
    rope = ROPE_BYTES if model.gated_mlp else (0.0, 0.0)
    repeat = REPEAT_KV_BYTES if kv_repeated(model, training) else (0.0, 0.0)
    heads = model.num_heads if model.has_attention else 0
    scores = np.where(flash_attention, 0.0, np.asarray(mbs, dtype=np.float64) * heads / tp
                      * np.asarray(seq, dtype=np.float64) ** 2)
    score = [SCORE_BYTES[training.fused_softmax][i] * d for i in (0, 1)]
    if training.softmax_in_fp32 and not training.fused_softmax and training.dtype_bytes < 4:
        score = [b + SOFTMAX_FP32_EXTRA_BYTES / 2 for b in score]
    if training.attention_dropout:
        score = [b + extra for b, extra in zip(score, dropout_bytes(training.dtype_bytes))]
    if model.attention_softcapping:
        score = [b + passes * d for b, passes in zip(score, SOFTCAP_PASSES)]

    cast = quantized_cast_bytes(model, training, tokens, hidden, tp) if training.quantized_linears else (0.0, 0.0)
    norms = float(model.norms_per_block)  # parallel blocks one, sandwich norms four
    # A hybrid model's Mamba or Gated DeltaNet layer (never recomputed selectively); an attention
    # output gate's sigmoid and multiply (forward 5 passes over q's width, backward 8).
    mixer = [a + b for a, b in zip(mamba.traffic_bytes(model, tokens, tp, d),
                                   gated_deltanet.traffic_bytes(model, tokens, tp, d))]
    if model.attention_output_gate and model.has_attention:
        mixer = [m + tokens * model.q_hidden_size / tp * passes * d for m, passes in zip(mixer, (5.0, 8.0))]
    qk_normed = tokens * (model.q_hidden_size + kv) / tp if model.qk_norm else 0.0  # query and key head norms

    def passes(i):  # 0: forward, 1: backward
        """(the residual adds, norms, dropouts and FP8 casts; what selective recompute runs again:
        rotary embedding, the MLP's activation, the scores)."""
        blockwide = hidden * (model.residual_adds * (RESIDUAL_BYTES[i] * d + dropout[i]) + norms * norm[i]) \
            + cast[i] + permuted + expert_bias[i] + qk_normed * norm[i] + mixer[i]
        core = (tokens * (model.q_hidden_size + kv) / tp * (rope[i] + repeat[i]) * d,
                (tokens * f / tp * mlp[i] + routed * gate_extra[i]) * d + clamped[i], scores * score[i])
        return blockwide, core

    (block_forward, core_forward), (block_backward, core_backward) = passes(0), passes(1)
    forward = block_forward + sum(core_forward)
    if training.selective_recompute == "op":
        selective_again = forward
    elif training.recompute_modules is None and not model.kv_lora_rank:
        selective_again = sum(core_forward)
    else:  # Megatron's modules, each its passes: rotary embedding and scores, norms, activation
        rotary, activation, scored = core_forward
        modules = selective_modules(model, training)
        selective_again = (("core_attn" in modules) * (rotary + scored) + ("mla_up_proj" in modules) * rotary
                           + ("layernorm" in modules) * hidden * model.pre_norms_per_block * norm[0]
                           + bool({"moe_act", "mlp", "moe"} & set(modules)) * activation
                           + ("moe" in modules) * (permuted + expert_bias[0]))
    core_backward = sum(core_backward)
    again = np.select([recompute == NONE, recompute == SELECTIVE], [0.0 * forward, selective_again], forward)
    return forward + block_backward + core_backward + again
