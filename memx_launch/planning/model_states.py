"""Model states in memory: weights, gradients and optimizer states per parameter on one rank,
by how the training setup shards them and which parameters it trains (fine-tuning: frozen
weights, LoRA adapters), what a fully sharded run gathers per layer, and what FP8 linears keep.

Read through :mod:`~memx_launch.planning.costmodel` (``cm.model_state_bytes_per_param``). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memx_launch.planning import experts, quantization
from memx_launch.planning.extra_blocks import other_kinds, stage_block_counts
from memx_launch.planning.matmuls import linear_module_params, linear_shapes
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


@dataclass(frozen=True)
class TrainedParameters:
    """Which parameters the optimizer trains, per parameter of the model: ``base`` the trained
    share of its own weights, ``adapters`` the LoRA parameters added per model parameter."""

    base: float = 1.0
    adapters: float = 0.0

    @property
    def share(self) -> float:
        """Parameters with gradients and optimizer states, per model parameter."""
        return self.base + self.adapters


FULL_TRAINING = TrainedParameters()


def trained_parameters(model: ModelSpec, training: TrainingSpec) -> TrainedParameters:
    """The base share (1 - ``frozen_fraction``) and the adapters of ``lora_rank``. The adapters
    are counted per block parameter and spread over every parameter (an embedding or head
    carries the block's share: at rank 16 on LLaMA-2-7B its 0.6%)."""
    return TrainedParameters(1.0 - training.frozen_fraction,
                             training.lora_rank * lora_width(model) / model.layer_params)


def lora_width(model: ModelSpec) -> int:
    """Inputs + outputs of every linear of one block (Wq, Wk, Wv, Wo and the MLP's): a LoRA
    adapter of rank r holds r x this many parameters."""
    h, q, kv, f = model.hidden_size, model.q_hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    mlp = (2 if model.gated_mlp else 1) * (h + f) + (f + h)
    return (h + q) + 2 * (h + kv) + (q + h) + mlp


def fine_tuning_flops(model: ModelSpec, training: TrainingSpec, mbs, seq, tp) -> np.ndarray:
    """FLOPs fine-tuning adds to one block's forward + backward (negative: it saves them): the
    frozen share of the weights takes no weight-gradient GEMM (one forward's matmul FLOPs), and
    LoRA adapters run their forward (2 per multiply-add, over TP) and twice that backward."""
    tokens = np.asarray(mbs, dtype=np.float64) * np.asarray(seq, dtype=np.float64) / np.asarray(tp, dtype=np.float64)
    adapters = 2.0 * tokens * training.lora_rank * lora_width(model)
    return 3.0 * adapters - training.frozen_fraction * 2.0 * tokens * (model.attention_params + model.active_mlp_params)


def model_state_bytes_per_param(training: TrainingSpec, dp, trained: TrainedParameters = FULL_TRAINING,
                                pp: int = 1, gradient_share: float = 1.0) -> np.ndarray:
    """Bytes of weights + gradients + master weights + optimizer moments per parameter on one rank.

    Megatron mixed precision with Adam: bf16 weight 2 + fp32 main grad 4 + fp32 master 4 and
    moments 8 = 18; the distributed optimizer shards the 12 over DP (Megatron's
    ``theoretical_memory_usage.py``: 6 + 12/DP). ZeRO-1 keeps bf16 grads (4 + 12/DP), ZeRO-2
    shards them too (2 + 14/DP); full sharding divides everything by DP. fp32 weights
    (autocast, FSDP2's fp32 shards) are their own master: fp32 training is 4 + 4 + 8 = 16, and
    20 under torch's DDP, whose buckets copy the gradients (``ddp_bucket_copy``). A fully sharded
    stage of ``pp`` may hold gathered weights and unsharded gradients besides, the latter for
    ``gradient_share`` of its parameters at once (:func:`held_gathered_bytes`). By part:
    :func:`model_state_bytes_by_part`.
    """
    if training.fully_sharded:  # the whole divided once: the parts' quotients would round apart
        sharded = sum(_unsharded_state_bytes(training, trained)) / np.asarray(dp, dtype=np.float64)
        return sharded + sum(held_gathered_bytes(training, dp, trained, pp, gradient_share))
    return sum(model_state_bytes_by_part(training, dp, trained))


def model_state_bytes_by_part(training: TrainingSpec, dp, trained: TrainedParameters = FULL_TRAINING,
                              pp: int = 1, gradient_share: float = 1.0) -> tuple:
    """(weights, gradients, optimizer states) bytes per parameter on one rank, the parts of
    :func:`model_state_bytes_per_param`; optimizer states are the fp32 master copy of 16-bit
    weights and the moments (none on the GPU with ``optimizer_offload``)."""
    dp = np.asarray(dp, dtype=np.float64)
    weight, grad, optim = _unsharded_state_bytes(training, trained)
    if training.fully_sharded:
        gathered, unsharded = held_gathered_bytes(training, dp, trained, pp, gradient_share)
        return weight / dp + gathered, grad / dp + unsharded, optim / dp
    if training.distributed_optimizer:
        optim = optim / dp
    if training.sharded_gradients:
        grad = grad / dp
    elif training.ddp_bucket_copy:  # DDP's buckets hold a second copy once there are replicas
        grad = grad * np.where(dp > 1, 2.0, 1.0)
    return weight, grad, optim


def _unsharded_state_bytes(training: TrainingSpec, trained: TrainedParameters) -> tuple[float, float, float]:
    """Weights, gradients, master weights + moments per parameter before any sharding: every
    weight (frozen ones too) and the adapters; gradients and optimizer states of the trained."""
    weight = float(training.precision_bytes("weights_dtype"))
    grad = float(training.precision_bytes("grad_dtype"))
    state = float(training.precision_bytes("optimizer_dtype"))
    master = {"training_moments": 4.0, "training_no_master": 0.0}.get(training.optimizer_dtype, state) \
        if weight < 4 else 0.0
    moments = (2.0 if training.optimizer == "adam" else 1.0) * state  # Adam m and v; SGD momentum
    optim = 0.0 if training.optimizer_offload else master + moments
    return weight * (1.0 + trained.adapters), grad * trained.share, optim * trained.share


def keeps_gathered(training: TrainingSpec, pp: int) -> bool:
    """Whether a fully sharded stage of ``pp`` holds its weights gathered and its gradients
    unsharded from the step's first micro-batch to its last (``hold_gathered``)."""
    hold = training.hold_gathered
    return bool(training.fully_sharded and (hold == "always" or (hold == "pipelined" and pp > 1)))


def holds_weights(training: TrainingSpec, pp: int) -> bool:
    """Whether a fully sharded stage of ``pp`` keeps its gathered weights from a micro-batch's
    forward to its backward at least (``hold_gathered`` weights, or through the step)."""
    return bool(training.fully_sharded and training.hold_gathered == "weights") or keeps_gathered(training, pp)


def held_gathered_bytes(training: TrainingSpec, dp, trained: TrainedParameters = FULL_TRAINING,
                        pp: int = 1, gradient_share: float = 1.0) -> tuple:
    """(gathered weight, unsharded gradient) bytes per parameter a fully sharded stage holds
    besides its shards: its weights where it holds them (:func:`holds_weights`; all are gathered
    at the end of a micro-batch's forward, the peak), its gradients too where it keeps them
    through the step (:func:`keeps_gathered`), for parameters sharded over ``dp`` ranks (none
    where that is one rank: nothing to gather).
    torch's pipelining runs every micro-batch's backward with FSDP2's resharding and gradient
    sync off (``PipelineStage.backward_maybe_with_nosync``), so each gradient accumulates
    unsharded, upcast to the reduction's dtype (``FSDPParam.to_accumulated_grad_if_needed``),
    and the weights stay gathered (torchtitan, NeMo AutoModel and memx-run do not reshard them
    after the forward either under PP). ``gradient_share``: of the parameters, those whose
    unsharded gradients are alive at once (:func:`held_gradient_share`)."""
    if not holds_weights(training, pp):
        return 0.0, 0.0
    several = np.asarray(dp, dtype=np.float64) > 1
    gradients = reduced_gradient_bytes(training) * trained.share * gradient_share if keeps_gathered(training, pp) \
        else 0.0
    return (np.where(several, compute_weight_bytes(training) * (1.0 + trained.adapters), 0.0),
            np.where(several, gradients, 0.0))


def held_gradient_share(training: TrainingSpec, pp: int, g: int, v: int) -> float:
    """Share of a rank's parameters whose unsharded gradients a stage that keeps them through the
    step (:func:`keeps_gathered`) holds at once, its ``v`` chunks about equal: torch's pipelining
    reduces a chunk's gradients right after its last backward (``_add_reduce_grad``), and its
    interleaved 1F1B of one round (``g`` < 2 x ``pp`` micro-batches) runs each chunk's backwards
    one chunk after another, so one chunk's are alive at a time; with more rounds every chunk's
    backwards span the step (tests/test_hold_gathered.py holds this against torch's schedule)."""
    return 1.0 / v if keeps_gathered(training, pp) and v > 1 and g < 2 * pp else 1.0


def reduced_gradient_bytes(training: TrainingSpec) -> int:
    """Bytes per gradient the DP reduction moves, and a held stage accumulates its unsharded
    gradients in: the gradients' dtype, or fp32 where 16-bit gradients are cast for it
    (DeepSpeed's ``fp32_allreduce``; FSDP2's ``reduce_dtype``)."""
    return 4 if training.fp32_allreduce else training.precision_bytes("grad_dtype")


def fully_sharded_working_bytes(model: ModelSpec, training: TrainingSpec, tp, dp_cp, pp: int = 1) -> float:
    """FSDP: one layer's weights gathered in the compute dtype while the next is prefetched (DeepSpeed
    ZeRO-3, ``max_live_params``: its budget of gathered parameters, and the linear whose fetch crosses
    it, and with ZeRO++'s hpZ the stage's second shard over ``hpz_partition_size`` ranks), and one
    layer's unsharded gradient before its reduce-scatter. A stage that holds
    its gathered weights (:func:`holds_weights`, counted in its model states) gathers nothing
    more; one that keeps its gradients through the step (:func:`keeps_gathered`) has a layer's
    fresh gradient wait in the weights' dtype to be added, where they accumulate in another."""
    return sum(fully_sharded_working_parts(model, training, tp, dp_cp, pp))


def fully_sharded_working_parts(model: ModelSpec, training: TrainingSpec, tp, dp_cp, pp: int = 1) -> tuple:
    """(gathered weights, unsharded gradient) bytes of :func:`fully_sharded_working_bytes`."""
    if not training.fully_sharded:
        return 0.0, 0.0
    layer = sum(fully_sharded_layer_params(model, training, tp, dp_cp))
    if keeps_gathered(training, pp):
        fresh = compute_weight_bytes(training)
        return 0.0, layer * (fresh if fresh != reduced_gradient_bytes(training) else 0.0)
    if holds_weights(training, pp):
        gathered = 0.0
    elif training.max_live_params:  # DeepSpeed's budget, overshot by the linear that crosses it; at most the stage
        largest = np.max(np.broadcast_arrays(*linear_module_params(model, training, tp)), axis=0)
        stage = layer * model.num_layers / pp
        secondary = stage / training.hpz_partition_size if training.hpz_partition_size > 1 else 0.0  # ZeRO++'s hpZ
        gathered = (np.minimum(training.max_live_params + largest, stage) + secondary) * compute_weight_bytes(training)
    else:  # one layer gathered while the next is prefetched
        gathered = layer * (2.0 * compute_weight_bytes(training))
    return gathered, layer * training.precision_bytes("grad_dtype")


def fully_sharded_layer_params(model: ModelSpec, training: TrainingSpec, tp, dp_cp) -> tuple:
    """(dense, routed-expert) parameters of one block a fully sharded rank gathers (FSDP2 with
    expert parallelism, as torchtitan and NeMo AutoModel run it): its dense ones, sharded over
    DP x CP, and its local experts, sharded over their expert data parallel group; none of them
    where that group is the rank alone (experts spread one EP group over the stage are whole)."""
    dense, expert = rank_layer_params(model, training, tp)
    if not model.num_experts:
        return dense, 0.0
    return dense, np.where(expert_data_parallel(training, tp, dp_cp) > 1, expert, 0.0)


def compute_weight_bytes(training: TrainingSpec) -> float:
    """Bytes per block weight as the linears read it, and as a fully sharded run gathers it: the
    FP8 recipe's with ``fp8_params``, else the training dtype's."""
    return quantization.element_bytes(training) if training.fp8_params else training.dtype_bytes


# Transformer Engine's delayed scaling keeps an amax history of this length (its default) for
# each FP8 tensor of a linear (its input, weight and output gradient), in fp32.
FP8_AMAX_HISTORY = 1024


def quantized_state_bytes(model: ModelSpec, training: TrainingSpec, tp, pp: int = 1) -> tuple:
    """(kept per block, working) bytes quantized linears add on one rank: the quantized copies of
    each linear weight along both axes for the forward and the backward (2 x the recipe's bytes per
    block parameter, over TP) and, with delayed scaling, the amax histories. A fully sharded run
    quantizes the gathered layer's weights only: its copies are working memory, one layer at a
    time. With ``fp8_params`` the FP8 weight is the weight (counted as the 16-bit one it
    replaces) and only its other copy is added; a fully sharded run gathers it in FP8 and
    transposes it. A stage that holds its gathered weights (:func:`holds_weights`) keeps every
    layer's copies, unless the linears cast their weight at each GEMM (no ``fp8_weight_cache``:
    torchao's), whose copies are working memory wherever the weights are."""
    if training.quantized_linears is None:
        return 0.0, 0.0
    layer = sum(rank_layer_params(model, training, tp))
    q = quantization.element_bytes(training)
    if training.fp8_params:
        copies = layer * (q if training.fully_sharded else 2.0 * q - training.dtype_bytes)
    else:
        copies = 2.0 * q * layer
    linears = len(linear_shapes(model, training, 1))
    amax = 3 * linears * FP8_AMAX_HISTORY * 4.0 if training.fp8 == "delayed" else 0.0
    working = (training.fully_sharded and not holds_weights(training, pp)) or not training.fp8_weight_cache
    return (amax, copies) if working else (copies + amax, 0.0)


def autocast_copy_bytes(params, training: TrainingSpec):
    """Bytes of torch.autocast's 16-bit copies of ``params`` fp32 weights on a rank. Each linear
    casts its weight and keeps the copy for its backward (autocast's cache holds it for the
    region besides: memx-run's spans the step's micro-batches), so a copy of every weight the
    linears read is alive from the forward to the backward's start: d bytes a parameter
    (measured on calibration's probe, tests/test_framework_memory.py). Zero without autocast, or
    where quantized linears cast to their own format (:func:`quantized_state_bytes`). A run
    that recomputes whole blocks with autocast around the forward only keeps none of theirs:
    counted all the same."""
    params = np.asarray(params, dtype=np.float64)
    if not training.autocast or training.quantized_linears is not None:
        return 0.0 * params
    return params * training.dtype_bytes


def weight_copy_bytes(model: ModelSpec, training: TrainingSpec, tp, pp: int = 1) -> tuple:
    """(kept per block, working) bytes of the copies one block's linears compute with beside its
    weights on a rank: quantized linears' (:func:`quantized_state_bytes`), autocast's 16-bit
    ones (:func:`autocast_copy_bytes`)."""
    kept, working = quantized_state_bytes(model, training, tp, pp)
    return kept + autocast_copy_bytes(sum(rank_layer_params(model, training, tp)), training), working


def last_stage_params(model: ModelSpec, pp: int) -> int:
    """Final norm and output layer, and the multi-token prediction modules' parameters beside their
    blocks; with tied embeddings or multi-token prediction and PP > 1 the last stage keeps its
    own copy of the word embeddings (Megatron syncs their gradients with the first stage)."""
    tied_copy = model.word_embedding_params if model.last_stage_reads_embedding and pp > 1 else 0
    mtp_beside_blocks = model.mtp_params - model.mtp_layers * model.layer_params if model.mtp_layers else 0
    return model.head_params + tied_copy + mtp_beside_blocks


def output_layer_params(model: ModelSpec, pp: int) -> int:
    """The last stage's largest parameter at its end: the output layer's weight, or the copy of the
    word embeddings it keeps (:func:`last_stage_params`)."""
    tied_copy = model.word_embedding_params if model.last_stage_reads_embedding and pp > 1 else 0
    return max(model.head_params - model.norm_params, tied_copy)


def largest_block_matrix(model: ModelSpec, training: TrainingSpec, tp) -> np.ndarray:
    """Elements of one block's largest parameter on a rank: its largest linear module's
    (:func:`~memx_launch.planning.matmuls.linear_module_params`: q, k and v fused or apart, gate and
    up likewise), or its routed experts' (Transformers': their gate-and-up weights, one 3-D
    parameter of the rank's experts, :func:`~memx_launch.planning.experts.gate_up_params`; else one
    expert's gate or up); a hybrid model's largest layer's."""
    if model.layer_kinds:
        return np.max([largest_block_matrix(kind, training, tp) for kind, _ in model.layer_kinds], axis=0)
    tp = np.asarray(tp, dtype=np.float64)
    largest = np.max(np.broadcast_arrays(tp * 0.0, *linear_module_params(model, training, tp)), axis=0)
    if not model.num_experts:
        return largest
    ep, etp = training.expert_parallel, training.expert_tensor_parallel
    expert = experts.gate_up_params(model, ep, etp) if training.transformers_blocks \
        else model.moe_ffn_hidden_size * model.hidden_size / etp
    return np.maximum(largest, expert)


def rank_layer_params(model: ModelSpec, training: TrainingSpec, tp) -> tuple:
    """(dense, routed-expert) parameters of one block on a rank: the dense ones over TP (but latent
    attention's down projections, whole on every rank), the routed experts over the
    expert-parallel ranks, each split over the expert-tensor-parallel ones (``expert_parallel``,
    ``expert_tensor_parallel``); a hybrid model's layer: the mean of its layers'."""
    if model.layer_kinds:
        parts = [(n, rank_layer_params(kind, training, tp)) for kind, n in model.layer_kinds]
        return tuple(sum(n * part[i] for n, part in parts) / model.num_layers for i in (0, 1))
    whole = model.latent_attention_params
    dense = (model.layer_params - model.expert_params - whole) / np.asarray(tp, dtype=np.float64) + whole
    return dense, model.expert_params / (training.expert_parallel * training.expert_tensor_parallel)


def expert_data_parallel(training: TrainingSpec, tp, dp_cp):
    """Ranks a routed expert's gradients and optimizer states are sharded over: a stage's
    TP x CP x DP ranks (``dp_cp``: with hybrid sharding a shard group's N x CP) over the
    expert-parallel and expert-tensor-parallel degrees (Megatron's expert data parallel group, or
    its share within one optimizer instance)."""
    return (np.asarray(tp, dtype=np.float64) * np.asarray(dp_cp, dtype=np.float64)
            / (training.expert_parallel * training.expert_tensor_parallel))


def layer_state_bytes(model: ModelSpec, training: TrainingSpec, tp, dp_cp, trained: TrainedParameters = FULL_TRAINING,
                      pp: int = 1, gradient_share: float = 1.0):
    """Model-state bytes of one block on a rank of one of ``pp`` stages: its dense parameters
    sharded over DP x CP, its routed experts' over the expert data parallel ranks."""
    dense, expert = rank_layer_params(model, training, tp)
    nbytes = dense * model_state_bytes_per_param(training, dp_cp, trained, pp, gradient_share)
    if not model.num_experts:
        return nbytes
    return nbytes + expert * model_state_bytes_per_param(training, expert_data_parallel(training, tp, dp_cp),
                                                         trained, pp, gradient_share)


def ends_split(layout, training: TrainingSpec) -> tuple[int, int]:
    """The TP degrees the embedding (first stage) and the head (last stage) are split by: their
    stages' with a vocab-parallel embedding, else 1 (whole on every TP rank: memx-run's)."""
    return layout.end_tp if training.vocab_parallel_embedding else (1, 1)


def parameters_per_rank(model: ModelSpec, training: TrainingSpec, layout, layers: np.ndarray, v: int = 1) -> np.ndarray:
    """(C, P) parameters a rank of each stage holds: its blocks in ``v`` chunks each, each kind's
    (over TP, routed experts over EP; :func:`~memx_launch.planning.extra_blocks.stage_block_counts`),
    the embedding on the first stage, the head on the last."""
    first, last = ends_split(layout, training)
    params = _stage_block_params(model, training, layout, layers, v, sum)
    params[:, 0] += model.embedding_params / first
    params[:, -1] += last_stage_params(model, layout.pp) / last
    return params


def expert_parameters_per_rank(model: ModelSpec, training: TrainingSpec, layout, layers: np.ndarray,
                               v: int = 1) -> np.ndarray:
    """The routed experts' share of :func:`parameters_per_rank`."""
    return _stage_block_params(model, training, layout, layers, v, lambda parts: parts[1])


def _stage_block_params(model: ModelSpec, training: TrainingSpec, layout, layers, v: int, part) -> np.ndarray:
    """``part`` of :func:`rank_layer_params` summed over each stage's blocks, each kind's."""
    tp = layout.tp_degrees
    counts, repeated = stage_block_counts(model, layers, v)
    params = repeated * part(rank_layer_params(model, training, tp))
    for kind, n in zip(other_kinds(model), counts):
        params = params + n * part(rank_layer_params(kind, training, tp))
    return params


def stage_state_bytes_by_part(model: ModelSpec, training: TrainingSpec, layout, layers: np.ndarray,
                              trained: TrainedParameters = FULL_TRAINING, v: int = 1, gradient_share: float = 1.0,
                              shards=None) -> tuple:
    """(weights, gradients, optimizer states) bytes of each stage's rank (row 0 of ``layers``, in
    ``v`` chunks each): its parameters at :func:`model_state_bytes_by_part` over DP x CP (``shards``,
    a shard group's ranks, with hybrid sharding), the routed experts' over their expert data parallel
    share of those ranks."""
    params = parameters_per_rank(model, training, layout, layers, v)[0]
    shards = layout.dp_cp if shards is None else shards
    dense = model_state_bytes_by_part(training, shards, trained, layout.pp, gradient_share)
    if not model.num_experts:
        return tuple(params * d for d in dense)
    tp = layout.tp_degrees
    experts = expert_parameters_per_rank(model, training, layout, layers, v)[0]
    routed = model_state_bytes_by_part(training, expert_data_parallel(training, tp, shards), trained, layout.pp,
                                       gradient_share)
    return tuple((params - experts) * d + experts * e for d, e in zip(dense, routed))
