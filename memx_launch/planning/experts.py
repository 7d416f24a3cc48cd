"""Mixture-of-experts blocks as Megatron-Core runs them (``--num-experts``, the all-to-all token
dispatcher, grouped GEMMs): what a block's routed experts cost a rank in time and memory, and the
layouts they allow. No torch import.

With TP > 1 the block's tokens reach the MLP split over TP (sequence parallelism, which Megatron
requires with experts), so each rank routes its ``tokens / TP``. Each token goes to its top-k
experts; an expert-parallel rank holds ``E / EP`` of them and receives, routing being balanced
(as NVIDIA's published MoE benchmarks force it), ``k`` tokens per token it sends: its experts run
grouped GEMMs of ``tokens x k x EP / E`` rows each. Dispatch and combine are all-to-alls over the
EP ranks, forward and backward. With expert tensor parallelism (ETP > 1) each expert's MLP is
split over ETP ranks, which all-gather their dispatched tokens before it (ETP x the rows, 1/ETP
of the width: the same FLOPs) and reduce-scatter its output after; backward, the reverse.
"""

from __future__ import annotations

from math import comb, gcd

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning import quantization
from memx_launch.planning.matmuls import K_FILL, linear_seconds
from memx_launch.planning.peaks import has_tf32, linear_tflops
from memx_launch.planning.tp_links import tp_link_gbps
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# Latency of one all-to-all: NCCL's grouped sends to every peer at once, about its Simple
# protocol's base and one network hop (src/graph/tuning.cc: 8.4 and 9.6 us).
ALL_TO_ALL_LATENCY_S = 18e-6
# All-to-alls per block, forward and backward: dispatch and combine, and their gradients.
ALL_TO_ALLS = 4
# The ATen ops Megatron-Core's MoE layer dispatches beyond its block's attention and norms, as
# (per layer: router, dispatch, combine, permutes; per local expert: its linears and activation),
# forward and backward (counted in benchmarks/results/moe_host_ops.json), each an eager op's
# host time (host_time.EAGER_OP_HOST_S).
MOE_HOST_OPS = {"forward": (64, 12), "backward": (45, 20)}
# Of those forward ops, the ones issued before the host waits for the device: Megatron-Core's token
# dispatchers copy the token counts to the host and synchronise there, before the exchange (the same
# file, ``forward_before_wait``: the router and the first permutation, none per local expert).
MOE_FORWARD_OPS_BEFORE_WAIT = (46, 0)
# What a routed copy's activation keeps, in 2 bytes per element of the expert's width, by (fused,
# gated): fused (Megatron's weighted_bias_swiglu, AutoModel's WeightedSwiGLUFunction) only its
# input, the gate-and-up output (2 x the width; ungated 1); unfused (megatron-core 0.16.1's
# eager path, measured in benchmarks/results/moe_host_ops.json) that output for silu, silu(gate),
# the linear half plus its offset (a new tensor), and the product the routing weights multiply:
# 5 x the width (ungated: the activation's output and that product, 2).
ROUTED_ACTIVATION_KEPT = {True: {True: 4.0, False: 2.0}, False: {True: 10.0, False: 4.0}}
# Tensors of the expert's width that GPT-OSS's clamped GLU (``clamped_glu``) keeps beyond SwiGLU's, unfused:
# megatron-core's eager path the clamped gate (its compiled quick_gelu's input, where silu's is a view of the
# gate-and-up output), one; Transformers' ops the clamped gate, sigmoid(1.702 gate) and up + 1 (traced:
# tests/test_framework_memory.py), three.
CLAMPED_GLU_KEPT = {"megatron": 1.0, "transformers": 3.0}


def check(model: ModelSpec, training: TrainingSpec, ranks_per_stage=None) -> None:
    """What memx refuses of an expert-parallel run: experts on a dense model, a degree that does
    not divide the experts (nor ETP their width; given, EP x ETP a stage's TP x CP x DP ranks),
    and what it does not model with experts (LoRA, torchtitan's op-level recompute)."""
    ep, etp = training.expert_parallel, training.expert_tensor_parallel
    if not model.num_experts:
        for flag, degree in (("--expert-parallel", ep), ("--expert-tensor-parallel", etp)):
            if degree > 1:
                raise ConfigError(flag, f"{degree}, but {model.name} has no experts", f"drop {flag}")
        return
    if model.num_experts % ep:
        raise ConfigError("--expert-parallel", f"{ep} does not divide the model's {model.num_experts} experts",
                          "use a divisor of num_experts")
    if model.moe_ffn_hidden_size % etp:
        raise ConfigError("--expert-tensor-parallel", f"{etp} does not divide an expert's width "
                          f"{model.moe_ffn_hidden_size}", "use a divisor of the experts' MLP width")
    degrees = f"{ep} x --expert-tensor-parallel {etp}" if etp > 1 else str(ep)
    for ranks in () if ranks_per_stage is None else np.atleast_1d(ranks_per_stage):
        if int(ranks) % (ep * etp):
            raise ConfigError("--expert-parallel", f"{degrees} does not divide a stage's TP x CP x DP = {int(ranks)} "
                              "ranks", f"use {'degrees whose product divides' if etp > 1 else 'a divisor of'} every "
                              "stage's TP x CP x DP")
    unmodelled = [flag for flag, on in (("--lora-rank", training.lora_rank),
                                        ("--selective-recompute op", training.selective_recompute == "op")) if on]
    if unmodelled:
        raise ConfigError(unmodelled[0], f"not modelled for the experts of {model.name}",
                          "use full fine-tuning or Megatron's selective recompute")


def search_degrees(model: ModelSpec, world: int) -> tuple[int, ...]:
    """The expert-parallel degrees ``memx plan`` tries for a mixture of experts on ``world``
    devices: the powers of two dividing its experts, up to the world (none for a dense model)."""
    return _powers_of_two_dividing(model.num_experts, world) if model.num_experts else ()


def search_tensor_degrees(model: ModelSpec, cluster: ClusterSpec) -> tuple[int, ...]:
    """The expert-tensor-parallel degrees ``memx plan`` tries for a mixture of experts: the powers
    of two dividing an expert's width, up to the smallest node's devices (an ETP group gathers
    and scatters every dispatched token each way, as a TP group does: inside a node)."""
    if not model.num_experts:
        return ()
    return _powers_of_two_dividing(model.moe_ffn_hidden_size, min(sum(n for _, n in node.devices)
                                                                   for node in cluster.nodes))


def _powers_of_two_dividing(value: int, up_to: int) -> tuple[int, ...]:
    return tuple(d for d in (2 ** k for k in range(int(np.log2(up_to)) + 1)) if value % d == 0)


def divides(layout, training: TrainingSpec) -> bool:
    """Every stage's TP x CP x DP ranks split into whole expert-parallel (x expert-tensor-parallel) groups."""
    ranks = np.asarray(layout.stage_tp) * np.asarray(layout.dp_cp)
    return bool((ranks % (training.expert_parallel * training.expert_tensor_parallel) == 0).all())


def ep_link_gbps(cluster: ClusterSpec, device_type: str, ep: int) -> float:
    """What an all-to-all of an expert-parallel group of ``ep`` consecutive ranks of one type moves
    per second of what leaves a rank, (EP - 1) / EP of its bytes: the node's links (as a TP group's)
    where one node holds the group; beyond, the share to the other nodes goes over the rank's
    network link while the share to its node's peers goes over the node's links at once."""
    per_node = max(cluster.devices_per_node(device_type))  # an expert-parallel group's NVLink domain
    inside = tp_link_gbps(cluster, device_type, min(ep, per_node))
    if ep <= per_node:
        return inside
    slowest = max((per_node - 1) / inside, (ep - per_node) / cluster.inter_node_gbps)
    return (ep - 1) / slowest


def gate_up_params(model: ModelSpec, expert_parallel: int = 1, expert_tp: int = 1) -> float:
    """Parameters of a rank's routed experts' gate-and-up weights (the up projection alone in an
    ungated MLP), which Transformers keeps as one 3-D parameter (``transformers_blocks``)."""
    width = (2 if model.gated_mlp else 1) * model.moe_ffn_hidden_size
    return model.num_experts * width * model.hidden_size / (expert_parallel * expert_tp)


def copies_per_token(model: ModelSpec, training: TrainingSpec) -> int:
    """Experts each token runs through: its top-k, or all of them where Transformers' blocks run every
    token through every expert, scaled by its routing score (``experts_take_every_token``: Llama 4's)."""
    every = training.transformers_blocks and model.experts_take_every_token
    return model.num_experts if every else model.experts_per_token


def routed_tokens(model: ModelSpec, training: TrainingSpec, tokens, tp):
    """Token-expert pairs a rank's experts process per micro-batch: its ``tokens / TP`` times
    :func:`copies_per_token`."""
    return np.asarray(tokens, dtype=np.float64) / np.asarray(tp, dtype=np.float64) * copies_per_token(model, training)


def permutation_bytes(model: ModelSpec, training: TrainingSpec, tokens, tp, dtype_bytes: float) -> np.ndarray:
    """HBM bytes one block's token permutations move on a rank each way (forward, and again
    backward for their gradients): each token copied to its top-k experts and summed back
    (permute and unpermute: read one, write k, and the reverse), and with Megatron-Core's
    all-to-all dispatcher, where a rank holds several experts, the received copies sorted from
    rank order to expert order after the dispatch and back before the combine
    (``sort_chunks_by_idxs``: each copy read and written twice). The flex dispatcher's kernels
    deliver them grouped; Transformers' blocks gather each expert's tokens instead."""
    if not model.num_experts:
        return np.zeros(np.shape(tokens))
    k, h = model.experts_per_token, model.hidden_size
    sorted_again = (training.expert_dispatcher != "flex" and not training.transformers_blocks
                    and model.num_experts > training.expert_parallel)
    per_token = (2.0 * (k + 1) + 4.0 * k * sorted_again) * h * dtype_bytes
    return np.asarray(tokens, dtype=np.float64) / np.asarray(tp, dtype=np.float64) * per_token


def fp32_experts(training: TrainingSpec) -> bool:
    """Whether the routed experts run in fp32 in a 16-bit training: Transformers' (``transformers_blocks``)
    under autocast over fp32 weights, which cast their grouped GEMMs' input to the weights' dtype
    (:func:`kept_units`)."""
    return bool(training.transformers_blocks and training.autocast)


def transformers_share(training: TrainingSpec) -> float | None:
    """For blocks as Transformers writes them (``transformers_blocks``), the bytes of a mixture's
    expert tensors over the training dtype's (the weights' dtype, fp32 under autocast); None for
    Megatron-Core's blocks (:func:`kept_units`' ``transformers_share``)."""
    if not training.transformers_blocks:
        return None
    return 4.0 / training.dtype_bytes if fp32_experts(training) else 1.0


def grouped_gemm_rate(device: DeviceType, training: TrainingSpec) -> tuple[float, float]:
    """(sustained TFLOPS, bytes an element) of the routed experts' grouped GEMMs on ``device``: the
    block linears' (:func:`~memx_launch.planning.peaks.linear_tflops`), but fp32 where they run so
    (:func:`fp32_experts`), at the TF32 peak with ``tf32`` where the device has it."""
    if fp32_experts(training):
        tf32 = training.tf32 and has_tf32(device)
        return (device.effective_tflops / 2.0 if tf32 else device.effective_tflops_for("fp32")), 4.0
    return linear_tflops(device, training), quantization.element_bytes(training)


def expert_seconds(model: ModelSpec, training: TrainingSpec, tokens, tp, best_flops, hbm_bytes_per_s, sms,
                   dtype_bytes, fill_k=K_FILL) -> tuple:
    """(forward, backward) seconds of one block's routed experts on a rank: its ``E / EP``
    experts' grouped GEMMs (gate and up fused, then down), each of ``tokens x k x EP / E`` rows,
    or with ETP its gathered ``ETP x`` those rows at ``1 / ETP`` of the width."""
    ep, etp = training.expert_parallel, training.expert_tensor_parallel
    rows = routed_tokens(model, training, tokens, tp) * ep / model.num_experts * etp
    f, h = float(model.moe_ffn_hidden_size) / etp, float(model.hidden_size)
    shapes = [((2.0 if model.gated_mlp else 1.0) * f, h), (h, f)]
    forward, backward = linear_seconds(rows, shapes, best_flops, hbm_bytes_per_s, sms, dtype_bytes, fill_k)
    experts_here = model.num_experts / ep
    return experts_here * forward, experts_here * backward


def exchange_seconds(model: ModelSpec, training: TrainingSpec, tokens, tp, seconds_per_byte) -> np.ndarray:
    """One block's dispatch and combine, forward and backward: four exchanges of a rank's tokens'
    hidden states at ``seconds_per_byte`` (:func:`exchange_seconds_per_byte`), each after its latency."""
    if training.expert_parallel == 1:
        return np.zeros(np.shape(tokens))
    nbytes = np.asarray(tokens, dtype=np.float64) / np.asarray(tp, dtype=np.float64) * model.hidden_size \
        * training.dtype_bytes
    return ALL_TO_ALLS * (ALL_TO_ALL_LATENCY_S + nbytes * np.asarray(seconds_per_byte))


def forward_host_ops(model: ModelSpec, training: TrainingSpec) -> tuple[float, float]:
    """The ops a rank's MoE layer issues from the host in its forward, before the host waits for
    the device (:data:`MOE_FORWARD_OPS_BEFORE_WAIT`) and after: each of its ``num_experts / EP``
    local experts runs its own linears, so the host's work grows with them where the device's
    does not."""
    local = model.num_experts / training.expert_parallel
    (per_layer, per_expert), (before, before_per_expert) = MOE_HOST_OPS["forward"], MOE_FORWARD_OPS_BEFORE_WAIT
    return before + before_per_expert * local, per_layer - before + (per_expert - before_per_expert) * local


def host_ops(model: ModelSpec, training: TrainingSpec, forward_again=False) -> np.ndarray:
    """The ops a rank's MoE layer issues from the host, forward (:func:`forward_host_ops`) and
    backward, its forward again where ``forward_again`` (recomputed)."""
    per_layer, per_expert = MOE_HOST_OPS["backward"]
    backward = per_layer + per_expert * model.num_experts / training.expert_parallel
    return sum(forward_host_ops(model, training)) * (1.0 + np.asarray(forward_again, dtype=np.float64)) + backward


def expert_tp_bytes(model: ModelSpec, training: TrainingSpec, tokens, tp) -> np.ndarray:
    """Bytes one of a block's expert-tensor-parallel collectives gathers on a rank (the all-gather
    of the dispatched tokens before the experts, the reduce-scatter of their output after, and
    the two again backward): its routed copies, ETP ranks' worth."""
    etp = training.expert_tensor_parallel
    return routed_tokens(model, training, tokens, tp) * etp * model.hidden_size * training.dtype_bytes


def exchange_seconds_per_byte(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                              device_type: str) -> float:
    """Seconds one exchange takes per byte of a rank's tokens, by the training's dispatcher, at the
    cluster's link figures (``link_efficiency`` applied). The all-to-all sends every routed copy,
    (EP - 1) / EP of them leaving the rank (:func:`ep_link_gbps`); the flex dispatcher
    (DeepEP, HybridEP) a token once to each other rank of its NVLink domain holding one of its
    experts, and, beyond the domain, once to each other node holding one over the rank's network
    link (that node forwards it inside), the two at once."""
    ep, efficiency = training.expert_parallel, cluster.link_efficiency
    if training.expert_dispatcher != "flex":
        return model.experts_per_token * (ep - 1) / ep / (ep_link_gbps(cluster, device_type, ep) * efficiency * 1e9)
    per_node = max(cluster.devices_per_node(device_type))
    inside, nodes = min(ep, per_node), max(ep // per_node, 1)
    seconds = (inside - 1) * hit_share(model, training, ep) / (tp_link_gbps(cluster, device_type, inside)
                                                               * efficiency * 1e9)
    if nodes > 1:
        seconds = max(seconds, (nodes - 1) * hit_share(model, training, nodes)
                      / (cluster.inter_node_gbps * efficiency * 1e9))
    return seconds


def hit_share(model: ModelSpec, training: TrainingSpec, units: int) -> float:
    """Chance that a given one of ``units`` equal shares of the experts (EP ranks, or their nodes)
    holds one of a token's, routed as ``training.expert_routing`` routes; ``units`` times it is
    the units a token reaches."""
    missed = _consecutive_missed_share if training.expert_routing == "consecutive" else _missed_share
    return 1.0 - missed(model, units)


def _consecutive_missed_share(model: ModelSpec, units: int) -> float:
    """:func:`_missed_share` where token t goes to experts t*k to t*k + k - 1 (modulo the experts):
    each unit is as often among a token's as any other, so a given one misses it with the chance
    one less the units a token reaches on average (over the period of t*k modulo the experts)."""
    experts, k = model.num_experts, model.experts_per_token
    per_unit = experts // units
    starts = range(0, experts * k // gcd(experts, k), k)
    reached = sum(len({(s + j) % experts // per_unit for j in range(k)}) for s in starts) / len(starts)
    return 1.0 - reached / units


def _missed_share(model: ModelSpec, units: int) -> float:
    """Chance that none of a token's top-k experts is on a given one of ``units`` equal shares of
    the experts (its EP ranks, or their nodes), routing balanced: the k drawn among the experts of
    the groups a token may use (DeepSeek's group-limited routing: ``expert_groups_per_token`` of
    ``expert_groups``), else among all of them."""
    experts, k = model.num_experts, model.experts_per_token
    groups, chosen = (model.expert_groups, model.expert_groups_per_token) if model.expert_groups else (1, 1)
    per_group = experts // groups
    pool = chosen * per_group
    if groups >= units:  # a unit holds groups / units groups, of which j are chosen
        held = groups // units
        return sum(comb(held, j) * comb(groups - held, chosen - j) / comb(groups, chosen)
                   * comb(pool - j * per_group, k) / comb(pool, k) for j in range(min(held, chosen) + 1))
    picked = chosen / groups  # a group spans several units: the unit's group is chosen or not
    return 1.0 - picked + picked * comb(pool - experts // units, k) / comb(pool, k)


def shared_expert_units(model: ModelSpec, tp, input_share, fused_activation: bool, *,
                        transformers_blocks: bool) -> tuple:
    """(kept, down-projection input) of a shared expert per token in :func:`kept_units`' units: a
    dense MLP of its width (gate and up outputs, silu(gate) unless fused; the product), and with a
    gate (``shared_expert_gate``, Qwen2-MoE's) its output, which the gate's sigmoid multiplies; unfused, the
    experts' clamped GLU's more tensors, as its framework runs it (MiniMax-M3's shared MLP runs it too:
    modeling_minimax_m3_vl.py:185-190)."""
    tp = np.asarray(tp, dtype=np.float64)
    shared = model.shared_expert_ffn_hidden_size / model.hidden_size / tp
    gated_output = 2.0 * model.shared_expert_gate / tp
    clamps = CLAMPED_GLU_KEPT["transformers" if transformers_blocks else "megatron"]
    clamped = 0.0 if fused_activation or not model.gated_mlp else 2.0 * clamps * model.clamped_glu
    return ((4.0 if fused_activation else 6.0) if model.gated_mlp else 2.0) * shared + gated_output \
        + clamped * shared, 2.0 * input_share * shared


def unfused_activation_units(model: ModelSpec, tp, fused_activation: bool):
    """Per token, what megatron-core's unfused expert activation keeps beyond its input (silu(gate), up plus
    its offset, the product; GPT-OSS's clamped gate), in :func:`kept_units`' unit: what Megatron's ``moe_act``
    recompute (a checkpoint of the activation alone, which keeps its input) drops with the down-projection's."""
    if fused_activation or not model.num_experts:
        return 0.0
    gated = bool(model.gated_mlp)
    inside = ROUTED_ACTIVATION_KEPT[False][gated] - ROUTED_ACTIVATION_KEPT[True][gated] \
        + 2.0 * CLAMPED_GLU_KEPT["megatron"] * model.clamped_glu
    return model.experts_per_token * inside * model.moe_ffn_hidden_size / model.hidden_size / np.asarray(tp, float)


def every_token_backward_units(model: ModelSpec, tp, sbh, dtype_bytes: float, transformers_share: float,
                               fused_activation: bool, fused_gate_up: bool, autocast16: bool):
    """What the backward of Llama 4's experts (``experts_take_every_token``: every token through every one
    of the ``E`` experts, :func:`kept_units`) holds beyond the output's gradient, in :func:`kept_units`'
    units (``sbh``: the bytes of one such unit for the micro-batch, to price weights): the largest of three
    moments, each once the shared expert's backward (run first: its nodes are the newest) has freed what it
    kept (and, under 16-bit autocast, ``autocast16``, its gate and up linears' casts of its input), beside
    its input's gradient (in the norm output's dtype, ``transformers_share``). The down projection's bmm
    backward: the routed output's gradient, which ``reshape(E, -1, h).sum(0)``'s backward makes whole
    (E x h), the product's gradient (E x f) and the down projection's weight gradient (E x f x h), in the
    training dtype. The gate-and-up projection's, once silu(gate) and the product are freed: its weight
    gradient (E x 2f x h; under autocast beside the down projection's 16-bit one, waiting as below) and its
    input's gradient (E x h), which binds at few tokens. The routing scores' multiply's backward, once the
    experts' kept tensors are freed: the scaled copy's gradient and its products with the score and with the
    repeated token, three E x h tensors in the norm output's dtype, and under autocast the experts' 16-bit
    weight gradients, whose cast node runs after every other (planning/backward_end.py). Traced on
    Transformers' Llama4TextMoe, fp32 and bf16 autocast (benchmarks/hf_block_memory.py)."""
    h, f, e = model.hidden_size, model.moe_ffn_hidden_size, model.num_experts
    tp = np.asarray(tp, dtype=np.float64)
    shared_kept, shared_down = shared_expert_units(model, tp, 1.0, fused_activation, transformers_blocks=True)
    casts = (2.0 if model.gated_mlp and not fused_gate_up else 1.0) if autocast16 else 0.0
    shared = 2.0 * transformers_share / tp - shared_kept - shared_down - 2.0 * casts
    weights = e * 3.0 * f * h / tp * dtype_bytes / sbh  # gate-and-up and down
    down = 2.0 * e * (h + f) / h / tp + weights / 3.0
    if autocast16:  # its input's 16-bit gradient cast to the multiply's dtype, all the weight gradients waiting
        gate_up = 2.0 * e * (transformers_share * h - 4.0 * f) / h / tp + weights
    else:  # its input's gradient, made before AccumulateGrad takes its weight's
        gate_up = 2.0 * e * (h - 2.0 * f) / h / tp + weights * 2.0 / 3.0
    scores = 2.0 * e * (3.0 * transformers_share * h + 4.0 / dtype_bytes) / h / tp \
        - 2.0 * e * (h + 4.0 * f) / h / tp + (weights if autocast16 else 0.0)
    return shared + np.maximum(np.maximum(down, gate_up), scores)


def kept_units(model: ModelSpec, tp, input_share, fused_activation: bool, etp: int = 1,
               transformers_share: float | None = None, *, dtype_bytes: float) -> tuple:
    """(kept, down-projection input) of a block's MLP of experts per token, in the unit of
    :func:`~memx_launch.planning.activations.activation_bytes` (2 bytes per hidden element):
    the router's fp32 logits, and per routed copy the dispatched token (the gate-and-up input,
    at ``input_share`` of 2 bytes; gathered from ``etp`` ranks with expert tensor parallelism)
    and what its activation keeps (:data:`ROUTED_ACTIVATION_KEPT`, :data:`CLAMPED_GLU_KEPT`); the down
    projection's input apart; and a shared expert's dense MLP. The routing weights multiply the activation's output
    inside the experts (Megatron-Core's ``activation_func_with_probs``, NeMo AutoModel's weighted
    SwiGLU), so the combine keeps nothing. Over TP: each rank routes its share of the tokens.

    ``transformers_share``: the experts as Transformers runs them (``transformers_blocks``:
    ``integrations/moe.py``'s grouped GEMMs, its default), their tensors at that multiple of the
    training dtype's bytes. Per routed copy: the sorted token, the gate-and-up output, silu(gate)
    (ungated: the activation's input), the product the down projection reads, and that
    projection's output, which the routing weights multiply after it. Its grouped GEMMs are not
    autocast-enabled: it casts their input to the weights' dtype, so under autocast over fp32
    weights every one of them is fp32 (measured on Mixtral's block, tests/test_framework_memory.py).

    Llama 4's (``experts_take_every_token``, ``dtype_bytes`` the training's) run every token through all ``E``
    experts instead (modeling_llama4.py's ``Llama4TextMoe``): the router keeps its fp32 sigmoid scores, their
    transposed copy in the training dtype and its top-k indices (int64); per expert a token keeps its repeated
    copy (the norm's output: fp32 under autocast, ``transformers_share``), that copy times its score (the bmm's
    input), the gate-and-up output, silu(gate) and the product the down projection reads, all in the training
    dtype (``torch.bmm`` autocasts); the experts' summed output is kept by nothing."""
    h, f, k = model.hidden_size, model.moe_ffn_hidden_size, model.experts_per_token
    tp = np.asarray(tp, dtype=np.float64)
    shared_kept, shared_down = shared_expert_units(model, tp, input_share, fused_activation,
                                                   transformers_blocks=transformers_share is not None)
    if transformers_share is not None and model.experts_take_every_token:
        e, gate_up = model.num_experts, (2.0 if model.gated_mlp else 1.0) * f
        router = 2.0 * ((4.0 + dtype_bytes) * e + 8.0 * k) / dtype_bytes / h
        routed_kept = (router + 2.0 * e * ((transformers_share + 1.0) * h + gate_up + f * model.gated_mlp) / h) / tp
        return routed_kept + shared_kept, 2.0 * e * f / h / tp + shared_down
    if transformers_share is not None:
        activation = (3.0 + model.clamped_glu * CLAMPED_GLU_KEPT["transformers"] if model.gated_mlp else 1.0) * f
        routed_kept = (4.0 * model.num_experts / h + 2.0 * transformers_share * k * (2.0 * h + activation) / h) / tp
        return routed_kept + shared_kept, 2.0 * transformers_share * k * f / h / tp + shared_down
    unfused_clamps = 2.0 * CLAMPED_GLU_KEPT["megatron"] if model.clamped_glu and not fused_activation else 0.0
    up = (ROUTED_ACTIVATION_KEPT[bool(fused_activation)][bool(model.gated_mlp)] + unfused_clamps) * f / h
    routed_kept = (4.0 * model.num_experts / h + k * (2.0 * input_share * etp + up)) / tp
    return routed_kept + shared_kept, 2.0 * input_share * k * f / h / tp + shared_down
