"""The host's time to issue a layer's forward and backward on an accelerator. The device runs
behind the host, so no layer takes less (the cost model's layer time is the larger of the two; a
mixture's MoE layer, whose forward makes the host wait for the device, more:
:func:`issued_layer_seconds`), and ``memx estimate`` says which stages' layers the host, not the
device, sets. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning import experts
from memx_launch.planning.activations import selective_modules
from memx_launch.planning.matmuls import linear_module_params
from memx_launch.planning.plan import FULL, SELECTIVE
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec

# Host time to launch one kernel of a fused block's ~40 forward and backward (Megatron-LM with
# Transformer Engine): a small block is host bound. A host time per layer replaces the product.
KERNEL_LAUNCH_S = 5e-6
KERNELS_PER_LAYER = 40
FUSED_BLOCK_HOST_S = KERNELS_PER_LAYER * KERNEL_LAUNCH_S
# Host seconds of one op issued from eager PyTorch (module code, dispatcher, autograd, launch), as
# measured on a 2.45 GHz EPYC core: 14 us an op of Megatron-Core's MoE layer
# (benchmarks/results/moe_host_ops.json), about as much of its eager dense block (block_host_ops.json).
EAGER_OP_HOST_S = 14e-6
# The ATen ops (forward, backward) of Megatron-Core's eager dense block (its local spec: GPT's
# fused LayerNorm, biased linears, GELU, unfused attention with torch's masked softmax, no
# dropout), and what each option adds, counted in benchmarks/results/block_host_ops.json; the
# attention dropout and the fp32 softmax only without fused attention.
EAGER_BLOCK_OPS = {"base": (52, 94), "hidden_dropout": (8, 2), "attention_dropout": (4, 1),
                   "softmax_in_fp32": (2, -6), "rotary": (30, 22), "gated": (3, 3), "no_biases": (-4, -11),
                   "flash_attention": (-13, -26), "torch_norm": (16, 34)}
# The MLP's own ops by (gated, biased): a mixture of experts issues its MoE layer's instead.
EAGER_MLP_OPS = {(False, True): (13, 29), (False, False): (11, 23), (True, True): (16, 32), (True, False): (14, 26)}
# Host seconds DeepSpeed ZeRO-3's module hooks add to a block, (forward, backward), on the same kind
# of core: each linear module's fetch and release, and the rest of the block's hooks (its norms',
# attention's, MLP's and its own), timed under DeepSpeed 0.19.8 on blocks of 7 and 4 linear modules
# (benchmarks/results/deepspeed_zero3_host.json).
DEEPSPEED_HOOK_HOST_S = {"per_linear_module": (166e-6, 98e-6), "rest_of_block": (1352e-6, 1302e-6)}


def eager_block_ops(model: ModelSpec, training: TrainingSpec) -> tuple[int, int]:
    """(forward, backward) ATen ops an eager block issues, by the options that change them; a
    mixture's without its MLP (its MoE layer's ops are :func:`experts.host_ops`)."""
    added = ["hidden_dropout"] * bool(training.dropout) + ["torch_norm"] * (not training.fused_norm)
    if training.flash_attention:
        added.append("flash_attention")
    else:
        added += ["attention_dropout"] * bool(training.attention_dropout) \
            + ["softmax_in_fp32"] * bool(training.softmax_in_fp32 and training.dtype_bytes < 4)
    added += ["rotary"] * (not model.position_embeddings) + ["gated"] * model.gated_mlp \
        + ["no_biases"] * (not model.linear_biases)
    forward, backward = (sum(EAGER_BLOCK_OPS[name][i] for name in ["base", *added]) for i in (0, 1))
    if model.num_experts:
        mlp = EAGER_MLP_OPS[(model.gated_mlp, model.linear_biases)]
        forward, backward = forward - mlp[0], backward - mlp[1]
    return forward, backward


def fetch_hook_seconds(model: ModelSpec, training: TrainingSpec) -> tuple[float, float]:
    """(forward, backward) host seconds DeepSpeed ZeRO-3's module hooks add to a block, where a
    fully sharded run fetches its weights as it does (``max_live_params``): its linear modules'
    (:func:`~memx_launch.planning.matmuls.linear_module_params`) and the rest of the block's."""
    if not (training.fully_sharded and training.max_live_params):
        return 0.0, 0.0
    linears = len(linear_module_params(model, training, 1))
    per, rest = DEEPSPEED_HOOK_HOST_S["per_linear_module"], DEEPSPEED_HOOK_HOST_S["rest_of_block"]
    return rest[0] + linears * per[0], rest[1] + linears * per[1]


def default_block_host_parts(model: ModelSpec, training: TrainingSpec) -> tuple[float, float]:
    """(forward, backward) host seconds of a block where nothing measured it: an eager block's ops
    at an eager op's host time (``--eager-block``), else half a fused block's launches each, and
    DeepSpeed ZeRO-3's hooks where it fetches (:func:`fetch_hook_seconds`)."""
    if training.eager_block:
        forward, backward = (ops * EAGER_OP_HOST_S for ops in eager_block_ops(model, training))
    else:
        forward = backward = FUSED_BLOCK_HOST_S / 2.0
    hooks = fetch_hook_seconds(model, training)
    return forward + hooks[0], backward + hooks[1]


def default_block_host_seconds(model: ModelSpec, training: TrainingSpec) -> float:
    """A block's host time where nothing measured it (:func:`default_block_host_parts`)."""
    return sum(default_block_host_parts(model, training))


def block_host_seconds(device_type: DeviceType, model: ModelSpec, training: TrainingSpec) -> float:
    """A block's host time on ``device_type``: the run's flag, else the type's (cluster file or
    calibration), else :func:`default_block_host_seconds`."""
    ms = training.host_ms_per_layer or device_type.host_ms_per_layer
    return ms / 1e3 if ms else default_block_host_seconds(model, training)


def moe_forward_again(model: ModelSpec, training: TrainingSpec, recompute) -> np.ndarray:
    """Where a mixture's MoE layer runs its forward again: full recompute, or selective recompute
    of its ``moe`` module."""
    recompute = np.asarray(recompute)
    whole_moe = "moe" in selective_modules(model, training) and bool(model.num_experts)
    return (recompute == FULL) | ((recompute == SELECTIVE) & whole_moe)


def block_forward_share(model: ModelSpec, training: TrainingSpec) -> float:
    """Share of a block's host time its forward takes (:func:`default_block_host_parts`): an eager
    block's forward ops of all it issues, half of a fused block's, with ZeRO-3's forward hooks."""
    forward, backward = default_block_host_parts(model, training)
    return forward / (forward + backward)


def moe_op_seconds(model: ModelSpec, training: TrainingSpec, block_s) -> np.ndarray:
    """The host's seconds per eager op of a MoE layer, at the speed its block's ``block_s`` says
    the host issues at (:data:`EAGER_OP_HOST_S` where the block takes its default time)."""
    return EAGER_OP_HOST_S * block_s / default_block_host_seconds(model, training)


def layer_host_seconds(model: ModelSpec, training: TrainingSpec, block_s, recompute) -> np.ndarray:
    """Seconds the host takes to issue one layer at each ``recompute`` level, its block taking
    ``block_s`` (its forward's share again where the forward runs again: full or op-level
    recompute; half of a fused block's) and a mixture's MoE layer its own eager ops
    (:func:`experts.host_ops`), slower or faster as ``block_s`` is against
    :func:`default_block_host_seconds`."""
    recompute = np.asarray(recompute)
    op_level = (recompute == SELECTIVE) & (training.selective_recompute == "op")
    forward_share = block_forward_share(model, training)
    seconds = block_s * np.where((recompute == FULL) | op_level, 1.0 + forward_share, 1.0)
    if model.num_experts:
        again = moe_forward_again(model, training, recompute)
        seconds = seconds + experts.host_ops(model, training, again) * moe_op_seconds(model, training, block_s)
    return seconds


def issued_layer_seconds(model: ModelSpec, training: TrainingSpec, block_s, recompute, device_s,
                         moe_forward_device_s=0.0) -> np.ndarray:
    """A layer's seconds on an accelerator: no less than the host takes to issue it
    (:func:`layer_host_seconds`) nor the device to run it (``device_s``). A mixture's MoE layer
    makes its host wait in the forward until the device reaches the token dispatcher
    (:data:`experts.MOE_FORWARD_OPS_BEFORE_WAIT`), so no lead of the host crosses the wait: the
    forward takes the slower of the two, and no less than the device's run of what precedes the
    wait followed by the host's issue of what follows it (the exchange, the experts, the combine),
    which the device cannot start before; the backward, which does not wait, the slower of the two.
    The device's forward is a third of its time (one forward GEMM to two backward), of which the
    experts' forward and exchanges (``moe_forward_device_s``) follow the wait."""
    host_s = layer_host_seconds(model, training, block_s, recompute)
    if not model.num_experts:
        return np.maximum(device_s, host_s)
    op_s = moe_op_seconds(model, training, block_s)
    before_wait, after_wait = (ops * op_s for ops in experts.forward_host_ops(model, training))
    host_forward = block_forward_share(model, training) * block_s + before_wait + after_wait
    device_forward = device_s / 3.0
    device_before = device_forward - np.minimum(moe_forward_device_s, device_forward)
    forward = np.maximum(np.maximum(host_forward, device_forward), device_before + after_wait)
    return forward + np.maximum(host_s - host_forward, device_s - device_forward)
