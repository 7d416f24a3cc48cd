"""What one transformer block keeps for its backward, and the transient bytes its backward adds:
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), adapted
to LLaMA blocks (GQA, SwiGLU, RMSNorm, fused attention) and to how frameworks run them. No torch
import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from memx_launch.planning import experts, gated_deltanet, latent_attention, mamba, op_checkpointing, quantization
from memx_launch.planning.backward_end import waiting_weights
from memx_launch.planning.mlp_activations import mlp_backward_units, mlp_units
from memx_launch.planning.plan import FULL, NONE, SELECTIVE
from memx_launch.planning.recompute_modules import dropped_by_module
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


@dataclass(frozen=True)
class LayerCost:
    """Costs of one transformer layer for one micro-batch (arrays, one entry per query)."""

    time_s: np.ndarray
    """Forward + backward seconds, recomputation included."""
    activation_bytes: np.ndarray
    """Bytes kept alive from the forward until the backward of this micro-batch."""
    working_bytes: np.ndarray
    """Extra transient bytes while this layer's backward runs (recomputed activations, grads)."""


# fp32 tensors of the hidden width a torch-op RMSNorm's backward holds above its kept state (measured on
# Transformers' LlamaRMSNorm and Gemma2RMSNorm, tests/test_framework_memory.py).
TORCH_NORM_BACKWARD_HELD = 4.0


def activation_bytes(model: ModelSpec, mbs, seq, tp, recompute, dtype_bytes: int = 2,
                     flash_attention=True, sequence_parallel: bool = False,
                     dropout: bool = False, fused_norm: bool = True,
                     attention_dropout: bool = False, sp_keeps_gathered_input: bool = False,
                     fused_softmax: bool = True, softmax_in_fp32: bool = False, quantized_bytes=None,
                     op_selective: bool = False, fused_activation: bool = False,
                     recompute_modules: tuple[str, ...] | None = None, expert_tp: int = 1,
                     autocast: bool = False, fused_gate_up: bool = True, fused_qkv: bool = True,
                     stream_bytes: float | None = None, repeat_kv: bool = False,
                     softcapped_scores: bool = False, transformers_share: float | None = None,
                     weight_grad_bytes: float = 0.0, fresh_grad_bytes: float = 0.0) -> LayerCost:
    """Stored and transient activation bytes of one LLaMA block (numpy-broadcast inputs).

    Stored tensors of one block (fraction of sbh bytes at 2 bytes/element, t = TP):
      two RMSNorm inputs and the two normed tensors fed to linears: 8 (replicated unless SP;
        with SP a framework whose linears keep the all-gathered input keeps those 4 whole);
        parallel blocks: one norm input and one normed tensor, 4
      Q + K + V saved by attention: 2q/h + 4kv/h, over t (q: the queries' width, h unless the
        model's heads are wider or narrower than h / a); K and V repeated to the query heads
        before the kernel (``repeat_kv``, torchtitan's LLaMA): 6q/h
      attention output (input of Wo): 2q/h over t (latent attention: its values' width); fused
        kernels add a fp32 logsumexp per head; an output gate (``attention_output_gate``) adds
        the core's output and the sigmoid of the gate its multiply keeps, 4q/h over t
      latent attention's down projections (whole on every TP rank), and what Transformers' keeps
        beyond them: :mod:`~memx_launch.planning.latent_attention`
      unfused attention: the softmax output, 2as/h over t (its backward needs only its output);
        softmax in fp32 (torch's softmax on an fp32 copy of 16-bit scores, Megatron's
        --attention-softmax-in-fp32): the fp32 probabilities and their 16-bit copy fed to AV, (4 + d)as/h
        (with attention dropout not the copy, the dropout's input);
        with attention dropout also its 1-byte mask and the dropped-out probabilities: 5as/h
        over t, the Korthikanti s^2 term (fused attention regenerates its mask: nothing kept);
        soft-capped scores (``softcapped_scores``) the tanh's output besides, 2as/h over t
      hidden dropout on: 1-byte masks after attention and after the MLP: 2 (replicated unless SP)
      unfused norms (torch ops, Hugging Face's LlamaRMSNorm): ``x.float()`` is kept by the pow
        and the multiply by the rsqrt, and the normalised tensor cast back to the training dtype
        by the weight multiply; the 16-bit input is not kept: 2(4 + d) bytes for the two norms
      Gemma's torch-op norms (``norm_weight_in_fp32``) keep their fp32 product: 4 + 4 bytes an element
      sandwich norms (``post_norms``, Gemma 2 and 3): the norms on the attention's and the MLP's
        outputs keep theirs too, two more norms' worth (replicated unless SP)
      query and key head norms (``qk_norm``): their inputs as the block's norms keep theirs,
        2(q + kv)/h over t fused (torch ops: (4 + d)(q + kv)/h, Gemma's (4 + 4)); kept under
        selective recompute, run again from the projections' outputs under the op-level policy
      a hybrid model's layer: one norm and one residual dropout, attention's or the MLP's
        tensors alone, or a Mamba or Gated DeltaNet layer's (:func:`~memx_launch.planning.mamba.kept_units`,
        :func:`~memx_launch.planning.gated_deltanet.kept_units`)
      SwiGLU: gate and up outputs, silu(gate) (not with a fused kernel), product: 8f/h over t (GELU: 4f/h;
        ReLU, ``relu_mlp``: 2f/h, its output is its backward's and the down projection's input);
        a mixture of experts: :func:`~memx_launch.planning.experts.kept_units` (as Transformers runs
        them with ``transformers_share``: their tensors at that multiple of ``dtype_bytes``)
      Transformers' blocks (``transformers_share`` given) with a fused q, k and v projection and
        rotary embedding (Phi-3, Falcon): the projection's whole output, which a saved view of v
        keeps alive beside the rotated q and k: 2(q + kv)/h over t more; a rotary embedding that
        concatenates each head's turned and passed parts (``rotary_concatenates``: partial
        rotary, Phi-3's) a query laid out by head, whose attention output is copied for the output
        projection: 2q/h; norms of torch ops that centre their input (``centred_norm_ops``:
        Cohere's) two fp32 copies of it, a scale and an fp32 result: 24/d over t each
      quantized linears (Transformer Engine's FP8 or FP4): the inputs they keep for the backward
        take ``quantized_bytes`` per element: the two normed tensors, the attention output and
        the MLP's down-projection input
      ``autocast`` (16-bit compute by torch.autocast over fp32 weights: DDP, memx-run): the
        residual stream stays fp32, so each norm keeps an fp32 input (torch ops: that input and
        an fp32 normalised tensor, 4 + 4), and every linear that reads a normed tensor keeps its
        own 16-bit cast of it (:func:`autocast_extra_casts`: more than one per norm with separate
        q, k and v or gate and up linears); full recompute keeps the fp32 block input, and the
        backward's residual gradients are fp32
      ``stream_bytes``: the hidden states a block receives and its residual adds keep are in
        these bytes instead (a whole stage behind a fully sharded one in memx-run: 16 bits under
        autocast), which the kept block input and the residual gradients take; the norms keep
        what they keep under autocast all the same, as CUDA's autocast runs them in fp32
        (``rms_norm`` and ``layer_norm`` are on its fp32 list: a 16-bit input is cast up)
    Selective recompute checkpoints the attention core (RoPE + attention, whose inputs Q, K, V
    it keeps) and silu(gate)*up: it drops the scores or logsumexp and silu(gate). In latent
    attention it is Megatron's ``mla_up_proj``: the up projections and RoPE run again from the
    kept latents, dropping Q, K and V. ``recompute_modules`` (Megatron's names) instead: each drops
    what it recomputes (:func:`~memx_launch.planning.recompute_modules.dropped_by_module`).
    ``op_selective``: selective is torchtitan's op-level policy instead (:mod:`op_checkpointing`).
    Full recompute keeps the block input only; its working set is one block recomputed.
    The backward's working set is the largest of its phases'. With sandwich norms (``post_norms``)
    the norm on the MLP's output runs first, beside all the block keeps (as torch ops with
    :data:`TORCH_NORM_BACKWARD_HELD` fp32 temporaries), and frees its own. The MLP's: the
    gradient of the block's output and the MLP's intermediate gradients (:func:`mlp_backward_units`),
    with the attention-core policy the MLP's activation it runs again; where gradients accumulate
    into ``.grad`` (torch's AccumulateGrad), at least the down projection's backward, which makes
    its weight's gradient (``weight_grad_bytes`` a weight, the GEMM's dtype: under autocast cast
    to the weight's after the node freed its input) beside ``.grad`` and its input's gradient
    before the activation's backward runs (a GELU MLP's largest moment), and the largest MLP linear's
    gradient once in the weights' dtype (``fresh_grad_bytes`` a weight; under autocast its fp32 cast,
    made after the linear's node freed its input and its 16-bit weight copy, which the 16-bit
    gradient's bytes equal: a moment beside the output's gradient alone, which binds at few tokens).
    The attention's, once the MLP's tensors are freed: the gradients of the block's input and output,
    that policy's recomputed core, and in unfused attention, beside the kept probabilities, the
    gradient of the probabilities: one more s x s tensor per head in the training dtype when a fused
    softmax (Megatron's) turns it into the scores' gradient in place; two with torch's softmax, whose
    backward writes a new tensor (its forward holds as many: scores, masked copy, probabilities).
    Under one autocast region a step, a later micro-batch's 16-bit weight gradients wait for their
    casts beside those phases (:func:`~memx_launch.planning.backward_end.waiting_weights`)."""
    mbs = np.asarray(mbs, dtype=np.float64)
    seq = np.asarray(seq, dtype=np.float64)
    tp = np.asarray(tp, dtype=np.float64)
    recompute = np.asarray(recompute)
    flash = np.asarray(flash_attention, dtype=bool)
    h, q, kv = model.hidden_size, model.q_hidden_size, model.kv_hidden_size
    a = model.num_heads if model.has_attention else 0
    f = model.ffn_hidden_size if model.has_mlp else 0
    scale = dtype_bytes / 2.0
    sbh = seq * mbs * h * scale
    # Each norm keeps what its backward reads: a fused kernel its input (d bytes; fp32 under
    # autocast), torch ops the fp32 copy and the result. Parallel blocks: one norm, whose output
    # both attention and MLP read; sandwich norms (post_norms): two more, on the attention's and
    # the MLP's outputs.
    residual = 4.0 if autocast else dtype_bytes
    normalised = 4.0 if model.norm_weight_in_fp32 or autocast else dtype_bytes  # the torch-op norm's kept product
    # Weightless torch-op norms (NanoChat's) keep their fp32 input alone: no weight multiply keeps the normalised one.
    kept_normalised = 0.0 if model.weightless_norms else normalised
    per_norm = 2.0 * residual / dtype_bytes if fused_norm else 2.0 * (4.0 + kept_normalised) / dtype_bytes
    if model.centred_norm_ops and transformers_share is not None:  # Cohere's: x - mean twice, all in fp32
        per_norm = 2.0 * 12.0 / dtype_bytes
    # Post-norms (on the attention's and the MLP's outputs) read a linear's 16-bit output under autocast:
    # a Llama-style torch-op norm casts its normalised tensor back to 16 bits and keeps that (4 + d).
    # Transformers' experts run in fp32 under autocast (experts.kept_units: their grouped GEMMs cast to the weights'
    # dtype), so the norm on a mixture's output reads an fp32 sum and keeps an fp32 normalised tensor.
    post_normalised = 4.0 if model.norm_weight_in_fp32 else dtype_bytes
    fp32_experts_out = autocast and transformers_share is not None and bool(model.num_experts) and model.has_mlp
    mlp_post_normalised = 4.0 if fp32_experts_out else post_normalised
    per_post_norm, per_mlp_post_norm = (per_norm if fused_norm or model.centred_norm_ops else
                                        2.0 * (4.0 + kept) / dtype_bytes
                                        for kept in (post_normalised, mlp_post_normalised))
    post_norms = (per_post_norm + per_mlp_post_norm) if model.post_norms else 0.0
    norms = per_norm * (model.norms_per_block - (2 if model.post_norms else 0)) + post_norms
    fp8_share = quantized_bytes / dtype_bytes if quantized_bytes else 1.0  # a linear's kept input
    extra_casts = autocast_extra_casts(model, fused_gate_up, fused_qkv) if autocast else 0
    normed_copies = model.pre_norms_per_block + extra_casts
    linear_inputs = 2.0 * normed_copies * fp8_share / (tp if sequence_parallel and not sp_keeps_gathered_input else 1.0)
    norm_split = tp if sequence_parallel else 1.0
    replicated = norms / norm_split + linear_inputs
    heads_qkv = (2.0 * q + 4.0 * (q if repeat_kv else kv)) / h / tp
    if model.kv_lora_rank and transformers_share is not None:
        heads_qkv = heads_qkv + latent_attention.transformers_value_view_units(model, tp, flash)
    latent = latent_attention.latent_units(model, fused_norm, dtype_bytes)
    qkv = heads_qkv + latent if model.kv_lora_rank else heads_qkv
    attn_out = 2.0 * fp8_share * model.value_hidden_size / h / tp
    if (transformers_share is not None and fused_qkv and not model.position_embeddings and not model.kv_lora_rank
            and not model.alibi_attention):
        # Transformers' fused q, k and v projection split into views (Phi-3, Falcon): the attention
        # saves v, a view that keeps the whole projection alive beside the rotated q and k (BLOOM's
        # ALiBi attention reshapes q, k and v into copies: the projection is freed).
        qkv = qkv + 2.0 * (q + kv) / h / tp
    if transformers_share is not None and model.clipped_qkv:  # in-place clamp_ keeps each unclamped output
        qkv = qkv + 2.0 * (q + 2.0 * kv) / h / tp
    if transformers_share is not None and model.rotary_concatenates:
        # The attention's output follows the concatenated query's layout, by head: copied for the output projection.
        attn_out = attn_out + 2.0 * q / h / tp
    if transformers_share is not None and model.kv_lora_rank:
        attn_out = attn_out + latent_attention.transformers_output_copy_units(model, tp, flash)
    if model.attention_output_gate and model.has_attention:  # its multiply keeps the core's output and sigmoid(gate)
        attn_out = attn_out + 4.0 * q / h / tp
    lse = np.where(flash, 4.0 * a / h / tp / scale, 0.0)  # fp32, one value per head and token
    # Bytes kept per score (in units of 2 bytes x scale): the softmax output, in fp32 plus its
    # 16-bit copy when torch's softmax upcasts (a fused kernel reads and writes 16 bits).
    fp32_probs = softmax_in_fp32 and not fused_softmax and dtype_bytes < 4
    # With attention dropout the 16-bit copy is the dropout's input, which keeps its mask alone: AV keeps the
    # dropped-out probabilities in its place (BLOOM's attention_dropout after its fp32 softmax's cast).
    probs = (4.0 + (0.0 if attention_dropout else dtype_bytes)) / dtype_bytes * 2.0 if fp32_probs else 2.0
    score_bytes = probs + (2.0 + 1.0 / scale if attention_dropout else 0.0)  # (+ mask, dropout out)
    score_bytes = score_bytes + (2.0 if softcapped_scores else 0.0)  # tanh's output, for its backward
    scores = np.where(flash, 0.0, score_bytes * a * seq / h / tp)
    if model.attention_sink_scale and model.has_attention and transformers_share is not None:
        # Granite SWA's sink: logsumexp keeps the raw scores and its d-byte result, out * sigmoid(lse - sink) the
        # unscaled output and the fp32 scale (and, under 16 bits, its cast to the output's dtype).
        per_head = (2.0 + 8.0 / dtype_bytes + (2.0 if dtype_bytes < 4 else 0.0)) * a / h / tp
        scores = np.where(flash, 0.0, scores + 2.0 * a * seq / h / tp + per_head)
        attn_out = attn_out + 2.0 * model.value_hidden_size / h / tp
    if dropout:  # 1-byte masks of the two residual dropouts, split over TP only with SP
        replicated = replicated + model.residual_adds / scale / (tp if sequence_parallel else 1.0)
    mlp_kept, mlp_elementwise = mlp_units(model, tp, fp8_share, fused_activation, expert_tp, bool(quantized_bytes),
                                          transformers_share, dtype_bytes)
    # Query and key head norms keep their inputs, as the block's norms do, but their input is a
    # linear's 16-bit output under autocast too (fused: the 16-bit q and k; torch ops: its fp32
    # copy and the 16-bit normalised tensor, Gemma's fp32 product).
    # Weightless query and key norms (``qk_norm_weightless``: Llama 4's, nanochat's) keep their fp32 input alone.
    qk_normalised = 0.0 if model.qk_norm_weightless else \
        4.0 if model.norm_weight_in_fp32 or (autocast and model.qk_norm_after_rope) else dtype_bytes
    per_qk_norm = 2.0 if fused_norm else 2.0 * (4.0 + qk_normalised) / dtype_bytes
    qk_norms = (q + kv) / h / tp * per_qk_norm if model.qk_norm else 0.0
    if (model.qk_norm and fused_norm and transformers_share is not None and fused_qkv and not model.position_embeddings
            and not model.kv_lora_rank and not model.alibi_attention):
        # Kernel norms on views of the fused projection (Persimmon's), counted above: their fp32 mean and scale alone.
        qk_norms = 8.0 * (a + model.num_kv_heads) / h / tp / scale
    if model.value_norm and model.has_attention:  # no weight: its input alone (fp32 as torch ops); its output is V
        qk_norms = qk_norms + kv / h / tp * (2.0 if fused_norm else 8.0 / dtype_bytes)
    if model.experts_beside_mlp_norms and model.num_experts and model.has_mlp:  # kept beside the MLP's units
        # Gemma 4's: norms on the MLP's and the experts' outputs; the experts' own norm and the router's (no weight)
        # on the stream, whose fp32 copy the block's norm keeps (the stream itself, fp32, unless 16-bit: a copy
        # each), the one's normalised tensor, the other's scaled by its weight (and the router linear's input,
        # unless autocast's cast of it is already counted, autocast_extra_casts).
        shared_input = 0.0 if fused_norm or residual == 4.0 else 8.0 / dtype_bytes
        own_norm = 0.0 if fused_norm else 2.0 * normalised / dtype_bytes
        router = 2.0 * residual / dtype_bytes + (0.0 if autocast else 2.0 * fp8_share)
        beside_mlp = (2.0 * per_post_norm + own_norm + router + 2.0 * shared_input) / norm_split
    else:
        beside_mlp = 0.0
    # Gemma 4's per-layer input (p wide), gated after the MLP: the gate's input (the stream, or its 16-bit cast),
    # GELU's input and output (the multiply keeps it, the per-layer input having gradients), that input (in the
    # stream's bytes: fp32 under autocast), their product (the projection's input) and the norm on its output.
    p = model.per_layer_input_size / h
    per_layer_input = 2.0 * residual / dtype_bytes * p
    per_layer = (2.0 * fp8_share * (1.0 + p) + 4.0 * p + per_layer_input + per_post_norm / norm_split) if p else 0.0
    # A hybrid model's Mamba or Gated DeltaNet layer: no selective module drops it.
    mixer = mamba.kept_units(model, tp, fp8_share) + gated_deltanet.kept_units(model, tp, fp8_share)
    none = replicated + qkv + qk_norms + attn_out + lse + scores + mlp_kept + mlp_elementwise + mixer + per_layer \
        + beside_mlp
    stream = residual if stream_bytes is None else stream_bytes
    block_input = 2.0 * stream / dtype_bytes / (tp if sequence_parallel else 1.0)  # what full recompute keeps
    selective, only_op = (op_checkpointing.kept_units(model, tp, block_input, sequence_parallel, flash, lse)
                          if op_selective else (replicated + qkv + qk_norms + attn_out + mlp_kept + mixer + per_layer
                                                + beside_mlp, 0.0))
    # Megatron's named modules (latent attention's default: mla_up_proj) instead of memx's selective.
    modules = recompute_modules if recompute_modules is not None else ("mla_up_proj",) if model.kv_lora_rank else None
    if modules is not None and not op_selective:
        dropped = dropped_by_module(model, tp, lse + scores, heads_qkv, 0.0 if quantized_bytes else linear_inputs,
                                    mlp_kept, mlp_elementwise, fp8_share, fused_activation)
        selective = none - sum(dropped[name] for name in modules)
    full = np.broadcast_to(block_input + per_layer_input, none.shape)  # the checkpoint keeps the per-layer input too
    stored = np.select([recompute == NONE, recompute == SELECTIVE], [none, selective], full)
    # Score gradients alive beside the kept scores in the backward, per score in units of the
    # training dtype: the fused kernel's in place (one), torch's softmax a new one (two); in fp32
    # the fp32 gradient in and out of the softmax (8 bytes) once AV's backward has freed the
    # 16-bit copy of the probabilities.
    score_grads = 1.0 if fused_softmax else ((8.0 - dtype_bytes) / dtype_bytes if fp32_probs else 2.0)
    stream_grad = 2.0 * stream / dtype_bytes
    # The attention's backward runs once the MLP's has freed the MLP's tensors.
    mlp_freed = mlp_kept + mlp_elementwise
    attention_phase = 2.0 * stream_grad + np.where(flash, 0.0, score_grads * 2.0 * a * seq / h / tp) - mlp_freed
    # One autocast region a step (a later micro-batch's backward): its 16-bit weight gradients wait for their casts.
    waiting_down = 0.0
    autocast16 = autocast and dtype_bytes < 4
    if weight_grad_bytes and not fresh_grad_bytes and autocast16 and model.has_mlp:
        beside_attention, beside_activation = waiting_weights(model, transformers_share is not None)
        attention_phase = attention_phase + beside_attention / tp * weight_grad_bytes / sbh
        waiting_down = beside_activation / tp * weight_grad_bytes / sbh
    # A parallel block under autocast casts the output's gradient to 16 bits for the attention and the MLP at
    # once: the attention's copy waits through the MLP's backward.
    waiting = 2.0 if model.parallel_blocks and autocast16 else 0.0
    mlp_phase = stream_grad + waiting + waiting_down + mlp_backward_units(model, tp, fused_activation,
                                                                          transformers_share, dtype_bytes=dtype_bytes)
    if transformers_share is not None and model.num_experts and model.has_mlp:
        # Transformers' experts' gate-and-up weights are one 3-D parameter, whose gradient the backward
        # makes whole (beside .grad from a step's second micro-batch on): the MLP's phase holds at least it.
        # (Llama 4's, ``experts_take_every_token``, as traced: experts.every_token_backward_units.)
        gate_up = experts.gate_up_params(model, expert_tp=expert_tp)
        if not model.experts_take_every_token:
            mlp_phase = np.maximum(mlp_phase, gate_up * transformers_share * dtype_bytes / sbh)
        else:
            every_token = experts.every_token_backward_units(model, tp, sbh, dtype_bytes, transformers_share,
                                                            fused_activation, fused_gate_up, autocast16)
            mlp_phase = np.maximum(mlp_phase, stream_grad + waiting + waiting_down + every_token)
    elif weight_grad_bytes and model.has_mlp and not model.num_experts:
        down = 2.0 * f / h / tp + f * h / tp * weight_grad_bytes / sbh  # its input's gradient, its weight's
        # Its output's gradient, where not the stream's: under autocast cast to 16 bits, after a norm on the
        # MLP's output (post_norms) that norm's input's.
        copy = 2.0 if autocast16 else 2.0 * model.post_norms
        mlp_phase = np.maximum(mlp_phase, stream_grad + waiting + copy + down)
    if fresh_grad_bytes and model.has_mlp and not model.num_experts:
        down_weight = f * h / tp
        mlp_phase = np.maximum(mlp_phase, stream_grad + waiting + down_weight * fresh_grad_bytes / sbh)
        if model.gated_mlp and fused_gate_up:
            # The fused gate-and-up weight's, once the MLP's tensors are freed, beside its input's gradient: under
            # autocast the down projection's 16-bit weight copy is freed too, else its output's gradient is alive.
            alive = 2.0 + (0.0 if autocast16 else 4.0 * f / h / tp) - mlp_freed
            fused = down_weight * (2.0 * fresh_grad_bytes - (dtype_bytes if autocast16 else 0.0)) / sbh
            mlp_phase = np.maximum(mlp_phase, stream_grad + waiting + alive + fused)
    # Sandwich norms: the one on the MLP's output runs its backward first, beside all the block keeps (as torch
    # ops with its temporaries), and frees what it kept before the MLP's backward runs.
    norm_phase = 0.0
    if model.post_norms:
        # (a torch-op norm whose normalised tensor is 16-bit frees that, not an fp32 one, before its input's fp32
        # gradient path peaks: 4 - d bytes more held)
        held = TORCH_NORM_BACKWARD_HELD * 8.0 + 2.0 * (4.0 - mlp_post_normalised)
        norm_phase = stream_grad + (0.0 if fused_norm else held / dtype_bytes) / norm_split
        mlp_phase = mlp_phase - per_mlp_post_norm / norm_split
    # Backward of one block: the largest phase's gradients, beside what it runs again. Full recompute (the
    # op-level policy, Megatron's modules: counted so) runs it before the block's backward; the attention-core
    # policy runs the MLP's activation again in the MLP's phase and the attention core in the attention's.
    phases = np.maximum(np.maximum(attention_phase, mlp_phase), norm_phase)
    if op_selective or modules is not None:
        selective_working = none - selective + only_op + phases
    else:
        selective_working = np.maximum(np.maximum(lse + scores + attention_phase, mlp_phase) + mlp_elementwise,
                                       norm_phase)
    working = (np.select([recompute == NONE, recompute == SELECTIVE], [phases, selective_working], none + phases)
               + mamba.working_units(model, tp, dtype_bytes) + gated_deltanet.working_units(model, tp, dtype_bytes))
    return LayerCost(time_s=np.zeros_like(sbh), activation_bytes=stored * sbh, working_bytes=working * sbh)


def recomputed_layers(layers, recompute_layers, every=None):
    """How many of a stage's ``layers`` recompute at its level: the first ``recompute_layers``
    (at most all), or every ``every``-th where it is given and positive (``full:everyN``)."""
    first = np.minimum(recompute_layers, layers)
    return first if every is None else np.where(every > 0, layers // np.maximum(every, 1), first)


def partial_recompute_working(work, none_work, none_activations, layers, recomputed, every=None):
    """The backward's working set on a stage where ``recomputed`` of its ``layers`` recompute in
    full and the rest keep theirs: the first ones (Megatron's block method, ``full:K``), or every
    ``every``-th (torchtitan's layer checkpointing, ``full:everyN``). Its backward runs the layers
    last to first: a kept one's beside everything in flight (``none_work``); the last recomputed
    one's (``work``, the full level's: its activations and its phases) once the kept layers after
    it freed that micro-batch's activations (``none_activations`` a layer): all the kept layers
    when the recomputed ones are the first, none when the last layer recomputes."""
    kept = layers - recomputed
    after = kept if every is None else np.where(every > 0, layers - every * recomputed, kept)
    later = np.where(kept > 0, np.maximum(none_work, work - after * none_activations), work)
    return np.where(recomputed > 0, later, none_work)


def mlp_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp) -> np.ndarray:
    """Bytes of one block's MLP tensors (kept, or recomputed), which its backward frees before the
    attention's backward runs: what buffers alive only while the attention runs can reuse."""
    quantized = training.quantized_linears
    fp8_share = quantization.element_bytes(training) / training.dtype_bytes if quantized else 1.0
    kept, down_input = mlp_units(model, np.asarray(tp, dtype=np.float64), fp8_share, training.fused_activation,
                                 training.expert_tensor_parallel, bool(quantized), experts.transformers_share(training),
                                 training.dtype_bytes)
    sbh = np.asarray(mbs, dtype=np.float64) * np.asarray(seq, dtype=np.float64) * model.hidden_size
    return (kept + down_input) * sbh * training.dtype_bytes / 2.0


def training_activation_bytes(model: ModelSpec, training: TrainingSpec, mbs, seq, tp, recompute,
                              flash_attention=True, linear_bytes=None, stream_bytes: float | None = None) -> LayerCost:
    """:func:`activation_bytes` of one block as ``training`` runs it on a device whose attention
    is fused where ``flash_attention`` and whose quantized linears keep ``linear_bytes`` an element
    (a soft-capped attention, a LayerNorm: as :func:`training_as_run` runs them)."""
    tr = training_as_run(model, training)
    flash_attention = np.logical_and(flash_attention, tr.flash_attention)
    return activation_bytes(model, mbs, seq, tp, recompute, tr.dtype_bytes, flash_attention, tr.sequence_parallel,
                            tr.dropout, tr.fused_norm, tr.attention_dropout, tr.sp_keeps_gathered_input,
                            tr.fused_softmax, tr.softmax_in_fp32, tr.quantized_linears and linear_bytes,
                            tr.selective_recompute == "op", tr.fused_activation, tr.recompute_modules,
                            tr.expert_tensor_parallel, tr.autocast, tr.fused_gate_up, tr.fused_qkv, stream_bytes,
                            kv_repeated(model, tr), model.attention_softcapping, experts.transformers_share(tr),
                            tr.dtype_bytes if tr.grad_accumulation_pass else 0.0, fresh_gradient_bytes(tr))


def fresh_gradient_bytes(training: TrainingSpec) -> float:
    """Bytes a weight's fresh gradient takes in the backward once in the weights' dtype, where
    gradients accumulate into ``.grad``: fp32 weights' 4 (an fp32 GEMM's output, or under
    autocast with a region per forward its cast back); 0 under one autocast region a step, whose
    casts wait for a later backward's end (:mod:`backward_end`), or where the GEMMs read 16-bit weights
    (a fully sharded stage's gathered ones: the GEMM's gradient, counted at the down projection)."""
    fp32_gradients = training.dtype_bytes == 4 or (training.autocast and not training.autocast_per_step)
    return 4.0 if training.grad_accumulation_pass and fp32_gradients else 0.0


def training_as_run(model: ModelSpec, training: TrainingSpec) -> TrainingSpec:
    """``training`` as ``model``'s blocks run. A soft-capped attention (Gemma 2's) unfused, as
    Transformers' eager attention runs it (SDPA has no soft cap, and Transformers picks eager for
    Gemma 2): torch's softmax in fp32 on the 16-bit scores and K and V repeated to the query heads;
    so too attention with sinks in Transformers' blocks (GPT-OSS's: SDPA has none; its fp32 sinks
    joined to the scores make the softmax fp32). So too BLOOM's and MPT's ALiBi attention in Transformers' blocks
    (``alibi_attention``: scores plus the bias, torch's softmax in fp32 cast back, AV; K and V not repeated).
    A LayerNorm as torch's kernel (``nn.LayerNorm``: its input kept, with a mean and a scale a
    token) whatever ``fused_norm`` says, which tells RMSNorms' torch ops (Hugging Face's) apart."""
    if model.layer_norm and not training.fused_norm:
        training = dataclasses.replace(training, fused_norm=True)
    eager = model.attention_softcapping or (training.transformers_blocks and (model.attention_sinks
                                                                             or model.alibi_attention))
    if not eager:
        return training
    return dataclasses.replace(training, flash_attention=False, fused_softmax=False, softmax_in_fp32=True,
                               repeat_kv=training.repeat_kv if model.alibi_attention else True)  # BLOOM's: none


def autocast_extra_casts(model: ModelSpec, fused_gate_up: bool, fused_qkv: bool) -> int:
    """Under autocast, the 16-bit casts of normed tensors a block's linears keep beyond one per
    norm: each linear casts its own input. The attention's q, k and v projections read it as
    three linears unless fused (latent attention's two down projections), the MLP's gate and up
    as two unless fused (GELU's fc1, a mixture's router: one, and its shared expert's gate and up
    and the gate of that expert's output beside it)."""
    attention = ((2 if model.kv_lora_rank else 1 if fused_qkv else 3)
                 + (model.attention_output_gate and model.output_gate_linear)) if model.has_attention else 0
    gate_up = 2 if model.gated_mlp and not fused_gate_up else 1
    shared = (gate_up if model.shared_expert_ffn_hidden_size else 0) + model.shared_expert_gate
    mlp = ((1 + shared) if model.num_experts else gate_up) if model.has_mlp else 0
    return max(attention + mlp - model.pre_norms_per_block, 0)


def selective_modules(model: ModelSpec, training) -> tuple[str, ...]:
    """What the selective level runs again, in Megatron's module names: the training's
    ``recompute_modules``, else latent attention's up projections, else the attention core
    (memx's selective, which also drops the MLP's activation: ``activation_bytes``)."""
    if training.recompute_modules is not None:
        return training.recompute_modules
    return ("mla_up_proj",) if model.kv_lora_rank else ("core_attn",)


def kv_repeated(model: ModelSpec, training) -> bool:
    """K and V reach the attention kernel repeated to the query heads: the training repeats them
    (``repeat_kv``, torchtitan's LLaMA) and the model has fewer KV heads than query heads
    (torchtitan's ``repeat_kv`` returns its input when they are as many; latent attention has
    its own keys and values per head)."""
    return bool(training.repeat_kv and not model.kv_lora_rank and model.num_kv_heads < model.num_heads)


def attention_recomputed(recompute, model: ModelSpec, training, flash=True) -> np.ndarray:
    """Where a layer's recompute runs its attention core again: full recompute, and a selective
    level that recomputes it (Megatron's ``core_attn``; torchtitan's op-level policy keeps the
    fused kernel's output, so it runs only unfused attention again)."""
    recompute = np.asarray(recompute)
    selective = (~np.asarray(flash, dtype=bool) if training.selective_recompute == "op"
                 else "core_attn" in selective_modules(model, training))
    return (recompute == FULL) | ((recompute == SELECTIVE) & selective)
