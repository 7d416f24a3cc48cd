"""How a fully sharded stage is cut into FSDP2 units, and the precision they gather and reduce in.

A unit per block, then the stage's rest. torch's pipeline schedules keep a stage's weights gathered
and its gradients unsharded from its first backward to the step's end, so the forward keeps them
too (one gather a step, as torchtitan under PP): the cost model's hold_gathered "always".
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from memx_launch.runtime.precision import TORCH_DTYPES


def fsdp_mixed_precision(dtype: str):
    """FSDP2's policy for a run in ``dtype``: 16-bit training gathers the weights in 16 bits and
    reduces the gradients in fp32 (the plan's compute weight and grad dtype); fp32 casts nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[dtype], reduce_dtype=torch.float32)


def shard_stage(module: torch.nn.Module, mesh, dtype: str) -> None:
    """Shards ``module`` (a stage) over ``mesh``: each of its blocks, then the rest. The stage's own
    unit casts the hidden state it receives to the compute dtype, as FSDP2 casts a unit's floating
    inputs, and nothing else: a mixture's router sums are fp32 counts of up to millions of tokens,
    which 16 bits would round."""
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_mixed_precision(dtype)
    for block in _blocks(module):
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=False,
                mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
    if policy.param_dtype is not None:
        module.register_forward_pre_hook(functools.partial(_cast_hidden_state, policy.param_dtype))


def _cast_hidden_state(dtype: torch.dtype, _module, args: tuple):
    hidden = args[0] if args else None
    if isinstance(hidden, torch.Tensor) and torch.is_floating_point(hidden):
        return (hidden.to(dtype), *args[1:])
    return None


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a stage module: memx's LlamaStage's ``layers``, a drop-in model's
    StageModule's ``blocks``."""
    blocks = getattr(module, "layers", None)
    if blocks is None:
        blocks = module.blocks
    return list(blocks.values())
