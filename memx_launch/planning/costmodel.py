"""Analytical cost model: memory and time of transformer layers and pipeline stages.

No torch import: the search runs anywhere, on whole numpy arrays of configurations.

Everything per layer goes through :class:`LayerCostModel`, one call for arrays of (device
type, TP, micro-batch, sequence length, recompute level). The learned predictor wraps this
analytical model and scales its outputs by learned ratios: the search never changes with it.
Memory follows Korthikanti et al. 2022 (:mod:`activations`), adapted to LLaMA blocks.
Time counts FLOPs at each device's effective TFLOPS, element-wise traffic at its memory
bandwidth and tensor-parallel all-reduces at the TP group's link bandwidth.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from memx_launch.planning import experts, extra_blocks, gated_deltanet, host_time, mamba, op_checkpointing, quantization
from memx_launch.planning.activations import (LayerCost, activation_bytes, training_as_run,  # noqa: F401
                                             attention_recomputed, selective_modules, training_activation_bytes)
from memx_launch.planning.collectives import NVLINK, PCI, collective_seconds
from memx_launch.planning.elementwise import autocast_weight_cast_bytes, block_weight_cast_bytes, elementwise_traffic_bytes
from memx_launch.planning.loss import loss_hbm_bytes_per_logit
from memx_launch.planning.matmuls import (device_sms, fill_depth, forward_backward_seconds, gemm_seconds, latent_up_shapes,
                                          linear_seconds, linear_shapes, mlp_shapes, row_parallel_shapes)
from memx_launch.planning.model_states import (FULL_TRAINING, TrainedParameters, fine_tuning_flops,  # noqa: F401
                                               fully_sharded_working_bytes, fully_sharded_working_parts, last_stage_params,
                                               model_state_bytes_by_part, model_state_bytes_per_param, trained_parameters)
from memx_launch.planning.peaks import hbm_gbps, linear_tflops, training_tflops
from memx_launch.planning.plan import FULL, NONE, RECOMPUTE_LEVELS, SELECTIVE  # noqa: F401 (callers read cm.RECOMPUTE_LEVELS)
from memx_launch.planning.tp_links import tp_link_gbps, tp_over_pcie
from memx_launch.planning.tp_overlap import chunked_behind, sm_margin_seconds
from memx_launch.specs.cluster import ClusterSpec, DeviceType
from memx_launch.specs.efficiency import HOPPER_COMPUTE_CAPABILITY, default_efficiency, hopper_or_later
from memx_launch.specs.hybrid import deltanet_params, mamba_params
from memx_launch.specs.local_attention import local_attention_share
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

GIB = 2**30

# Latency of one collective step or point-to-point message (NCCL over NVLink or InfiniBand:
# a few microseconds of launch and protocol per hop), the alpha of the alpha-beta model.
LINK_LATENCY_S = 10e-6
# Speed of the fused attention kernel against the device's matmuls, by FlashAttention version.
# On A100 FlashAttention reaches 25-40% of peak and FlashAttention-2 50-73% (Dao 2023, abstract),
# where large matmuls sustain DEFAULT_EFFICIENCY (0.75): about 0.33 / 0.75 and 0.6 / 0.75 for the
# forward and backward together. FlashAttention-3 (Hopper only) is taken at FlashAttention-2's.
FLASH_ATTENTION_SPEED = {1: 0.45, 2: 0.8, 3: 0.8}
# On Hopper (compute capability 9.0) and later, each kernel's share of the peak, forward and 2.5x
# backward together at head dim 128 (Shah et al. 2024, FlashAttention-3, figures on H100 SXM5):
# FlashAttention-2, written for Ampere's mma instructions, about 35% (370 and 322 TFLOPS),
# FlashAttention 1 in proportion; FlashAttention-3, written for Hopper, about 60% (646 and 559).
HOPPER_ATTENTION_SHARE = {1: 0.35 * FLASH_ATTENTION_SPEED[1] / FLASH_ATTENTION_SPEED[2], 2: 0.35, 3: 0.6}


def fused_attention_speed(version: int, compute_capability: float | None) -> float:
    """Speed of the fused attention kernel against the device's matmuls: on Hopper its share of
    the peak against Hopper's default matmul share (the MPT table's long-sequence A100/H100 pairs,
    attention-bound, are predicted within 1-6% so)."""
    if hopper_or_later(compute_capability):
        return HOPPER_ATTENTION_SHARE[version] / default_efficiency("nvidia", HOPPER_COMPUTE_CAPABILITY)
    return FLASH_ATTENTION_SPEED[version]


class LayerCostModel(Protocol):
    """Per-layer costs for arrays of configurations; what the search calls."""

    device_names: tuple[str, ...]

    def layer_costs(self, device: np.ndarray, tp: np.ndarray, mbs: np.ndarray,
                    seq: np.ndarray, recompute: np.ndarray) -> LayerCost:
        """``device`` indexes ``device_names``; ``recompute`` is 0 none, 1 selective, 2 full."""
        ...


# --------------------------------------------------------------------------- memory


def communicators_per_rank(tp: int, pp: int, dp: int, world: int | None = None, cp: int = 1) -> int:
    """Communicators whose buffers a rank holds (``world``: tp x cp x pp x dp unless the stages'
    TP degrees differ). Torch gives every process group its own NCCL/RCCL communicator, even one
    whose ranks are another group's. Data parallelism alone syncs gradients on the world group
    (DDP, FSDP, ZeRO): one. With TP, CP or PP, Megatron-style frameworks make each group with
    ``new_group`` and run collectives on the world (barriers), TP, DP (x CP: the gradients) and
    PP groups, on the model-parallel group (TP x PP ranks: the gradient norm's all-reduce) and
    on the CP group (attention's ring), each where it has more than one member."""
    world = tp * cp * pp * dp if world is None else world
    if tp == pp == cp == 1:
        return int(world > 1)
    return int(world > 1) + sum(n > 1 for n in (tp, dp * cp, pp, tp * pp, cp))


# --------------------------------------------------------------------------- time


# Fused attention's backward recomputes the scores: five s x s matmuls against the forward's
# two, 2.5 x its FLOPs where the other matmuls take 2 x (Dao 2023, section 3.2).
FUSED_ATTENTION_BACKWARD = 2.5


def causal_attention_flops(model: ModelSpec, mbs, seq, tp) -> np.ndarray:
    """Forward FLOPs of one block's attention core on a rank: QK^T and AV, the causal half of 2bs^2
    x the queries' width and 2bs^2 x the values' (the same but in latent attention), over TP; with
    sliding windows, the blocks' mean of what they attend (:func:`attended_share`)."""
    mbs, seq = np.asarray(mbs, dtype=np.float64), np.asarray(seq, dtype=np.float64)
    width = model.q_hidden_size + model.value_hidden_size
    return mbs * seq * seq * width / np.asarray(tp, dtype=np.float64) * attended_share(model, seq)


def attended_share(model: ModelSpec, seq):
    """Share of the causal half of the s x s scores a block computes, averaged over the blocks: 1;
    for a block attending within a window of w keys (s w - w^2 / 2 of s^2 / 2) 2 w/s - (w/s)^2;
    for one attending within chunks of c tokens, n = s // c whole ones and r = s - n c left, each
    its own causal square, (n c^2 + r^2) / s^2."""
    if not (model.sliding_window or model.attention_chunk_size):
        return 1.0
    seq = np.asarray(seq, dtype=np.float64)
    if model.sliding_window:
        w = np.minimum(model.sliding_window, seq) / seq
        share = 2.0 * w - w * w
    else:
        c = float(model.attention_chunk_size)
        whole = np.floor(seq / c)
        share = (whole * c * c + (seq - whole * c) ** 2) / (seq * seq)
    local = local_attention_share(model)
    return 1.0 - local + local * share


def layer_forward_flops(model: ModelSpec, mbs, seq, tp) -> np.ndarray:
    """Forward FLOPs of one block: 2 per multiply-add of the matmuls, causal attention halved; a
    hybrid model's layer their mean over its layers (a Mamba or Gated DeltaNet layer: its weights' and its scan's)."""
    if model.layer_kinds:
        return sum(n * layer_forward_flops(kind, mbs, seq, tp) for kind, n in model.layer_kinds) / model.num_layers
    tokens = np.asarray(mbs, dtype=np.float64) * np.asarray(seq, dtype=np.float64)
    matmul = 2.0 * tokens * (model.attention_params + model.active_mlp_params + mamba_params(model) + deltanet_params(model))
    return (matmul / np.asarray(tp, dtype=np.float64) + causal_attention_flops(model, mbs, seq, tp)
            + mamba.scan_flops(model, tokens, tp) + gated_deltanet.scan_flops(model, tokens, tp))


def allreduce_time(nbytes, group_size, gbps, nodes=1, hop=NVLINK) -> np.ndarray:
    """All-reduce as NCCL runs it (ring or tree, the fastest protocol; :mod:`collectives`) over
    ``nodes`` nodes at bus bandwidth ``gbps``; ``hop``: NVLINK or PCI inside a node."""
    return collective_seconds("all_reduce", nbytes, group_size, gbps, nodes, hop)


def collective_time(nbytes, group_size, gbps, nodes=1, hop=NVLINK) -> np.ndarray:
    """Ring reduce-scatter or all-gather of a ``nbytes`` buffer: (n-1) steps of their hops'
    latency and (n-1)/n of the buffer at the bus bandwidth (:mod:`collectives`)."""
    return collective_seconds("all_gather", nbytes, group_size, gbps, nodes, hop)


def broadcast_time(nbytes, group_size, gbps, nodes=1, hop=NVLINK) -> np.ndarray:
    """Pipelined ring broadcast: (n-1) steps of latency, the whole buffer at the bus bandwidth."""
    return collective_seconds("broadcast", nbytes, group_size, gbps, nodes, hop)


def p2p_time(nbytes, gbps) -> np.ndarray:
    """One point-to-point message: latency plus the bytes over the link (none for inf)."""
    gbps = np.asarray(gbps, dtype=np.float64)
    return np.where(np.isinf(gbps), 0.0, LINK_LATENCY_S + np.asarray(nbytes) / (gbps * 1e9))


class AnalyticalCostModel:
    """Physics-only per-layer costs for the device types of a cluster."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec):
        self.model = model
        self.cluster = cluster
        self.training = training = training_as_run(model, training)
        self.device_types: tuple[DeviceType, ...] = tuple(cluster.device_types)
        self.device_names = tuple(d.name for d in self.device_types)
        self._tflops = np.array([training_tflops(d, training) for d in self.device_types])
        # The linear layers' GEMMs: each at its shape's share of the rate large training GEMMs sustain.
        self._best_flops = self._tflops * 1e12
        # Quantized block linears: the FP8 or FP4 rate, quantized operands (the 16-bit output counted
        # so too), the backward's GEMMs at their accumulation's cost.
        self._linear_flops = np.array([linear_tflops(d, training) for d in self.device_types]) * 1e12
        self._linear_bytes = quantization.element_bytes(training)
        self._backward_slowdown = np.array([quantization.backward_gemm_slowdown(d, training) for d in self.device_types])
        sixteen_bit = np.array([d.effective_tflops for d in self.device_types]) * 1e12  # a tile's fill, in time
        self._linear_fill, self._fill = fill_depth(self._linear_flops, sixteen_bit), fill_depth(self._best_flops, sixteen_bit)
        # A mixture's routed experts: Transformers' run in fp32 under autocast over fp32 weights (experts.py).
        rates = [experts.grouped_gemm_rate(d, training) for d in self.device_types]
        self._expert_flops = np.array([r for r, _ in rates]) * 1e12
        self._expert_fill, self._expert_bytes = fill_depth(self._expert_flops, sixteen_bit), rates[0][1]
        # Emulated devices are CPU processes whatever vendor they stand in for (the vendor picks
        # their communication domain): no tiles nor waves, no kernel launches.
        stand_in = cluster.is_emulated
        self._sms = device_sms(self.device_types, stand_in)
        self._hbm = np.array([hbm_gbps(d, stand_in) for d in self.device_types])
        self._flash = np.array([d.flash_attention and training.flash_attention for d in self.device_types])
        self._attention_speed = np.array([fused_attention_speed(training.flash_attention_version,
                                                                d.compute_capability) for d in self.device_types])
        # Accelerators run behind the host's launches and talk through NCCL/RCCL; CPU stand-ins
        # (emulation, profiling on a CPU) run their ops inline, timed without either.
        accelerator = np.array([d.vendor != "cpu" and not stand_in for d in self.device_types])
        host_s = np.array([host_time.block_host_seconds(d, model, training) for d in self.device_types])
        self._launch_s, self._accelerator = np.where(accelerator, host_s, 0.0), accelerator
        self._head_cache: dict = {}
        # Priced beside the repeated layer (extra_blocks.other_kinds): a mixture's dense block, or a
        # hybrid model's kinds, whose mean its layer is.
        self.other_kinds = [AnalyticalCostModel(kind, cluster, training) for kind in extra_blocks.other_kinds(model)]
        slow = cluster.emulation.slowdown_of if cluster.emulation else (lambda _name: 1.0)
        self._slowdown = np.array([slow(d.name) for d in self.device_types])
        self._tp_gbps = np.array([[tp_link_gbps(cluster, d.name, t) for t in TP_DEGREES]
                                  for d in self.device_types]) * cluster.link_efficiency
        # A mixture of experts' exchanges, by its dispatcher: over the node's links, the network beyond.
        self._exchange_seconds_per_byte = np.array([
            experts.exchange_seconds_per_byte(model, training, cluster, d.name) for d in self.device_types]) \
            if model.num_experts else None
        # Expert tensor parallelism's gathers and reduce-scatters: over an ETP group's links, as a TP group's.
        etp = training.expert_tensor_parallel
        self._expert_tp_gbps = np.array([tp_link_gbps(cluster, d.name, etp) for d in self.device_types]) \
            * cluster.link_efficiency
        self._expert_tp_hop = np.array([PCI if tp_over_pcie(cluster, d.name, etp) else NVLINK
                                        for d in self.device_types])
        # The hop between a TP group's ranks: NVLink, or PCIe through the host.
        self._tp_hop = np.array([[PCI if tp_over_pcie(cluster, d.name, t) else NVLINK for t in TP_DEGREES]
                                 for d in self.device_types])

    def layer_costs(self, device, tp, mbs, seq, recompute, host: bool = True) -> LayerCost:
        """One layer's costs per query; ``host``: no layer runs faster than the host issues it
        (False: the device's time alone)."""
        if self.model.layer_kinds:  # a hybrid model's mean layer; the backward's working set of its largest
            costs = [(n / self.model.num_layers, kind.layer_costs(device, tp, mbs, seq, recompute, host))
                     for (_, n), kind in zip(self.model.layer_kinds, self.other_kinds)]
            mean = [sum(share * getattr(c, part) for share, c in costs) for part in ("time_s", "activation_bytes")]
            return LayerCost(*mean, np.max([c.working_bytes for _, c in costs], axis=0))
        device = np.asarray(device, dtype=np.int64)
        tp = np.asarray(tp, dtype=np.float64)
        recompute = np.asarray(recompute)
        tr = self.training
        recompute = np.where(recompute == SELECTIVE, FULL, recompute) if tr.selective_recompute == "block" else recompute
        op_level = (recompute == SELECTIVE) & (tr.selective_recompute == "op")
        act = training_activation_bytes(self.model, tr, mbs, seq, tp, recompute, self._flash[device], self._linear_bytes)
        mbs_a, seq_a = np.asarray(mbs, dtype=np.float64), np.asarray(seq, dtype=np.float64)
        # The linear layers: each GEMM forward and backward at its shape's rate (matmuls.py), again where recomputed.
        tokens = mbs_a * seq_a
        shapes = linear_shapes(self.model, tr, tp)
        gemm = (self._linear_flops[device], self._hbm[device] * 1e9, self._sms[device], self._linear_bytes,
                self._linear_fill[device])
        linear_forward_s, linear_backward_s = linear_seconds(tokens, shapes, *gemm)
        expert_forward_s = exchange_s = 0.0
        if self.model.num_experts:  # the routed experts' grouped GEMMs
            expert_forward_s, expert_backward_s = experts.expert_seconds(
                self.model, tr, tokens, tp, self._expert_flops[device], *gemm[1:3], self._expert_bytes,
                self._expert_fill[device])
            linear_forward_s, linear_backward_s = linear_forward_s + expert_forward_s, linear_backward_s + expert_backward_s
        linear_s = linear_forward_s + self._backward_slowdown[device] * linear_backward_s
        # Op-level selective recompute runs every other projection again (op_checkpointing.py).
        op_again_s = sum(gemm_seconds(tokens, n, k, *gemm) for n, k in op_checkpointing.recomputed_projections(
            self.model, tp)) if op_level.any() else 0.0
        # Megatron's selective level by module: latent attention's up projections (mla_up_proj, its
        # default), a dense MLP's GEMMs (mlp), the attention core (core_attn, memx's default).
        modules = selective_modules(self.model, tr)
        selective_linear_s = 0.0
        if "mla_up_proj" in modules and self.model.kv_lora_rank:
            selective_linear_s = sum(gemm_seconds(tokens, n, k, *gemm) for n, k in latent_up_shapes(self.model, tp))
        # A dense MLP (mlp), or a mixture's shared expert (shared_experts, moe) and its experts (moe).
        dense_mlp = "mlp" in modules if not self.model.num_experts else bool({"shared_experts", "moe"} & set(modules))
        if dense_mlp:
            selective_linear_s = selective_linear_s + sum(gemm_seconds(tokens, n, k, *gemm)
                                                          for n, k in mlp_shapes(self.model, tr, tp))
        whole_moe = "moe" in modules and bool(self.model.num_experts)
        selective_linear_s = selective_linear_s + (expert_forward_s if whole_moe else 0.0)
        # torch's non-reentrant checkpoint stops a full recompute at the input of the block's last linear.
        last_s = gemm_seconds(tokens, *shapes[-1], *gemm) if self._early_stop else 0.0
        linear_again_s = np.select([recompute == FULL, op_level, recompute == SELECTIVE],
                                   [linear_forward_s - last_s, op_again_s, selective_linear_s], 0.0)
        linear_s = linear_s + linear_again_s
        # The attention core (QK^T and AV, causal half): what full recompute, and a selective one of it, run again.
        attn_core_flops = causal_attention_flops(self.model, mbs_a, seq_a, tp)
        again = attention_recomputed(recompute, self.model, tr, self._flash[device])
        recompute_flops = np.where(again, attn_core_flops, 0.0)
        # Unfused attention computes the whole s x s square (no causal skipping); its scores'
        # traffic is in the element-wise bytes.
        unfused = ~self._flash[device]
        attn_core_flops = np.where(unfused, 2.0, 1.0) * attn_core_flops
        # Fused attention's backward recomputes the scores (FUSED_ATTENTION_BACKWARD x the forward).
        flash_backward_flops = np.where(unfused, 0.0, (FUSED_ATTENTION_BACKWARD - 2.0) * attn_core_flops)
        # The fused kernel's FLOPs (forward, backward, a recomputed forward) run at its own speed.
        kernel_flops = np.where(unfused, 0.0, (3.0 + again) * attn_core_flops + flash_backward_flops)
        kernel_slowdown = 1.0 / self._attention_speed[device] - 1.0
        # A Mamba or Gated DeltaNet layer's chunked scan (forward, backward, again where recomputed) runs at
        # the fused kernels' speed; fine-tuning's weight-gradient GEMMs and adapters' FLOPs at the sustained rate.
        scan_flops = (mamba.step_scan_flops(self.model, tokens, tp, recompute == FULL)
                      + gated_deltanet.step_scan_flops(self.model, tokens, tp, recompute == FULL))
        compute_s = linear_s + (3.0 * attn_core_flops + flash_backward_flops + recompute_flops
                                + kernel_slowdown * kernel_flops + scan_flops / self._attention_speed[device]
                                + fine_tuning_flops(self.model, tr, mbs_a, seq_a, tp)) / (self._tflops[device] * 1e12)
        traffic = elementwise_traffic_bytes(self.model, tr, mbs, seq, tp, recompute, self._flash[device]) \
            + block_weight_cast_bytes(self.model, tr, tp, linear_again_s / linear_forward_s)
        memory_s = traffic / (self._hbm[device] * 1e9)
        hidden_bytes = mbs_a * seq_a * self.model.hidden_size * self.training.dtype_bytes
        allreduces = self.tp_allreduces(recompute)
        comm_s = allreduces * self.tp_allreduce_time(hidden_bytes, device, tp)
        if tr.async_tp:
            # torch's AsyncTP micro-pipelines the first forward's gathers and scatters behind its GEMMs; the
            # backward's and a recompute's stay whole (its authors measured about 20% on the forward and 8%
            # end to end on Llama 3 70B).
            forward = comm_s * self._forward_tp_allreduces / allreduces
            comm_s = comm_s - forward + chunked_behind(forward, linear_forward_s * self._slowdown[device], tp)
        expert_tp_s = 0.0
        if self.model.num_experts:  # dispatch and combine; a fully recomputed forward runs its two again
            moe_again = host_time.moe_forward_again(self.model, tr, recompute)
            exchange_s = experts.exchange_seconds(self.model, tr, tokens, tp, self._exchange_seconds_per_byte[device]) \
                * (1.0 + 0.5 * moe_again)
            if tr.overlap_expert_comm:  # behind another micro-batch's compute
                exchange_s = np.maximum(exchange_s - (compute_s + memory_s) * self._slowdown[device], 0.0)
            comm_s = comm_s + exchange_s
            expert_tp_s = self.expert_tp_seconds(tokens, tp, device) * (1.0 + 0.5 * moe_again)
        if tr.tp_comm_overlap:  # Megatron's userbuffers: every pass's collectives behind its linear GEMMs
            comm_s = chunked_behind(comm_s, linear_s * self._slowdown[device], tp)
            # on fewer SMs behind the forward reduce-scatters (row-parallel GEMMs), again where fully recomputed
            reduce_scattered = sum(gemm_seconds(tokens, n, k, *gemm) for n, k in row_parallel_shapes(self.model, tr, tp))
            compute_s = compute_s + np.where(tp > 1, (1.0 + (recompute == FULL)) * sm_margin_seconds(
                reduce_scattered, self._sms[device]), 0.0)
        comm_s = comm_s + expert_tp_s  # the experts' own gathers: no userbuffers, nothing overlaps them
        device_s = (compute_s + memory_s) * self._slowdown[device] + comm_s
        # A MoE layer's experts and exchanges forward: what its host issues after waiting for the device.
        moe_forward_s = expert_forward_s * self._slowdown[device] + exchange_s / 2.0
        time_s = host_time.issued_layer_seconds(self.model, tr, self._launch_s[device], recompute, device_s,
                                                moe_forward_s) if host else device_s
        return LayerCost(time_s=time_s, activation_bytes=act.activation_bytes, working_bytes=act.working_bytes)

    def layer_host_seconds(self, device, recompute) -> np.ndarray:
        """The host's time to issue one layer on each queried type (:mod:`host_time`; none on CPU
        stand-ins, which run their ops inline): no layer takes less."""
        return host_time.layer_host_seconds(self.model, self.training, self._launch_s[np.asarray(device)], recompute)

    def attention_seconds(self, device, tp, mbs, seq) -> tuple[np.ndarray, np.ndarray]:
        """The fused attention kernel's forward and backward seconds on one micro-batch of
        ``seq`` tokens (causal; the backward recomputes the scores); the device's emulation
        slowdown included. Context parallelism prices its ring with it."""
        device = np.asarray(device, dtype=np.int64)
        flops = causal_attention_flops(self.model, mbs, seq, tp)
        forward = flops / (self._attention_speed[device] * self._tflops[device] * 1e12) * self._slowdown[device]
        return forward, FUSED_ATTENTION_BACKWARD * forward

    def _head_projection_time(self, device, tp, mbs, seq) -> np.ndarray:
        """The LM head's GEMMs forward and backward, and each multi-token prediction module's head
        and 2h x h projection; kept per scalar query (the search asks the same stage ends again
        and again)."""
        scalar = all(np.ndim(x) == 0 for x in (device, tp, mbs, seq))
        key = (int(device), float(tp), float(mbs), float(seq)) if scalar else None
        if key in self._head_cache:
            return self._head_cache[key]
        tokens = np.asarray(mbs, dtype=np.float64) * np.asarray(seq, dtype=np.float64)
        h, mtp = self.model.hidden_size, self.model.mtp_layers
        rate = (self._best_flops[device], self._hbm[device] * 1e9, self._sms[device], self.training.dtype_bytes,
                self._fill[device])
        seconds = (1 + mtp) * forward_backward_seconds(tokens, [(self.model.output_vocab / tp, h)], *rate)
        if mtp:
            seconds = seconds + mtp * forward_backward_seconds(tokens, [(h / tp, 2.0 * h)], *rate)
        if scalar:
            self._head_cache[key] = seconds
        return seconds

    def _tp_column(self, tp) -> np.ndarray:
        return np.clip(np.round(np.log2(np.asarray(tp, dtype=np.float64))), 0, len(TP_DEGREES) - 1).astype(np.int64)

    def tp_gbps(self, device, tp) -> np.ndarray:
        """Bandwidth TP groups of ``tp`` devices of each queried type reach (link x link_efficiency)."""
        return self._tp_gbps[np.asarray(device), self._tp_column(tp)]

    def tp_allreduces(self, recompute) -> np.ndarray:
        """All-reduces of a block's hidden states over TP per micro-batch: two of its output forward,
        two of the column-parallel linears' input gradients backward (one more with separate gate
        and up linears, two more with separate q, k and v), two more when the full block is
        recomputed (one fewer, half with SP, where torch's checkpoint stops before the last);
        op-level recompute gathers the SP inputs again (half an all-reduce each) or without SP
        runs the forward ones again.
        Parallel blocks sum attention's and the MLP's before one each way (one shared input), as a
        hybrid model's layer (attention, MLP or Mamba) has one each way."""
        tr, recompute = self.training, np.asarray(recompute)
        op_level = (recompute == SELECTIVE) & (tr.selective_recompute == "op")
        again = np.select([recompute == FULL, op_level], [1.0, 0.5 if tr.sequence_parallel else 1.0], 0.0)
        forward = self._forward_tp_allreduces
        m, block = self.model, forward == 2.0  # a block's separate column-parallel linears reduce apart
        separate = (block and m.gated_mlp and not tr.fused_gate_up) + 2.0 * (block and not m.kv_lora_rank
                                                                             and not tr.fused_qkv)
        stopped = np.where(recompute == FULL, 0.5 if tr.sequence_parallel else 1.0, 0.0) * self._early_stop
        return forward * (2.0 + again) + separate - stopped

    @property
    def _early_stop(self) -> bool:
        """Whether a full recompute stops before the block's last linear and the TP collective after
        it (``checkpoint_early_stop``; a mixture's last ops are its experts' combine, not counted so)."""
        return bool(self.training.checkpoint_early_stop) and not self.model.num_experts

    @property
    def _forward_tp_allreduces(self) -> float:
        """Of :meth:`tp_allreduces`, the first forward's: attention's and MLP's; parallel blocks' or a layer's one."""
        return 1.0 if self.model.parallel_blocks or self.model.layer_kind else 2.0

    def expert_tp_seconds(self, tokens, tp, device) -> np.ndarray:
        """A block's expert-tensor-parallel collectives on each queried rank: forward the gather of
        its routed tokens and the reduce-scatter of the experts' output over the ETP group's links,
        backward the two again (0 at ETP 1)."""
        etp = self.training.expert_tensor_parallel
        if etp == 1:
            return 0.0
        nbytes = experts.expert_tp_bytes(self.model, self.training, tokens, tp)
        link = (etp, self._expert_tp_gbps[np.asarray(device)], 1, self._expert_tp_hop[np.asarray(device)])
        return 2.0 * sum(collective_seconds(op, nbytes, *link) for op in ("all_gather", "reduce_scatter"))

    def tp_allreduce_time(self, nbytes, device, tp) -> np.ndarray:
        """One all-reduce over a TP group of each queried type (its link and hop; collectives.py).
        CPU stand-ins run gloo inline: bandwidth only."""
        device = np.asarray(device)
        hop = self._tp_hop[device, self._tp_column(tp)]
        timed = allreduce_time(nbytes, tp, self.tp_gbps(device, tp), 1, hop)
        tp = np.asarray(tp, dtype=np.float64)
        bandwidth_only = 2.0 * (tp - 1) / np.maximum(tp, 1) * nbytes / (self.tp_gbps(device, tp) * 1e9)
        return np.where(self._accelerator[device], timed, np.where(tp > 1, bandwidth_only, 0.0))

    # ---- non-layer parts, analytical for every cost model
    def embedding_time(self, device, tp, mbs, seq) -> np.ndarray:
        """Embedding lookup forward and backward: memory bound, one pass over b*s*h."""
        nbytes = 4.0 * np.asarray(mbs) * np.asarray(seq) * self.model.hidden_size * self.training.dtype_bytes
        return nbytes / (self._hbm[np.asarray(device)] * 1e9) * self._slowdown[np.asarray(device)]

    def head_time(self, device, tp, mbs, seq) -> np.ndarray:
        """Output projection and loss, forward and backward: the projection's FLOPs over TP and
        the cross entropy's passes over the logits the rank holds, at HBM speed
        (:func:`~memx_launch.planning.loss.loss_hbm_bytes_per_logit`).
        Without a vocab-parallel loss the logits are first all-gathered over TP and every rank
        runs the loss on the whole vocabulary. Each multi-token prediction module runs a head and
        loss of its own, after its embedding lookup and its 2h x h projection (its block is the
        evaluator's)."""
        tp, device = np.asarray(tp, dtype=np.float64), np.asarray(device)
        logits = np.asarray(mbs) * np.asarray(seq) * self.model.output_vocab
        held = logits / tp if self.training.vocab_parallel_loss else logits
        per_logit = loss_hbm_bytes_per_logit(self.model, self.training, tp)
        heads = 1 + self.model.mtp_layers
        projection = self._head_projection_time(device, tp, mbs, seq)
        head_casts = autocast_weight_cast_bytes(self.model.output_vocab * self.model.hidden_size / tp, self.training)
        compute = (projection + (heads * per_logit * held + head_casts) / (self._hbm[device] * 1e9)) * self._slowdown[device]
        if self.model.mtp_layers:  # each module's embedding lookup
            compute = compute + self.model.mtp_layers * self.embedding_time(device, tp, mbs, seq)
        if self.training.vocab_parallel_loss:
            return compute
        gathered = heads * logits * self.training.dtype_bytes
        hop = self._tp_hop[device, self._tp_column(tp)]
        return compute + collective_time(gathered, tp, self.tp_gbps(device, tp), 1, hop)


TP_DEGREES = (1, 2, 4, 8, 16)
