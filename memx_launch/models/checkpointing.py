"""Op-level selective activation checkpointing, torchtitan's policy (``selective_ac_option =
"op"``; planning/op_checkpointing.py models what it keeps): a block runs under
``torch.utils.checkpoint`` and keeps the fused attention kernel's outputs, sequence
parallelism's reduce-scatters and every other matmul's output; the backward runs the rest again.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# torchtitan's save list; the CPU kernel of scaled_dot_product_attention stands in for the
# CUDA ones where memx runs on CPU.
SAVED_OPS = {torch.ops.aten.mm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _op_level_contexts():
    """One block call's policy: matmuls counted from 1 in the forward (and again in the
    recompute), the even ones recomputed."""
    count: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            count[mode] += 1
            if count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def op_level_checkpoint(function: Callable, *args):
    """``function(*args)`` under the op-level policy."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_op_level_contexts)
