"""Bytes eager PyTorch's ops move, traced op by op under a dispatch mode: what the cost model's
element-wise traffic, casts and gradient passes are held against."""

from __future__ import annotations

# Views and allocations move no bytes.
MOVES_NOTHING = {"aten::_unsafe_view", "aten::empty_like"}


def byte_counter(counted=None, storage: bool = False):
    """A dispatch mode that adds up, in its ``total``, the bytes of every op's tensor arguments and
    outputs (what it reads and writes), of the ops ``counted(func, args, out)`` keeps (all by
    default), views and allocations aside: ``with byte_counter() as traffic: ...``. With
    ``storage``, a tensor counts at most its storage's bytes: an expanded view reads what it expands."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class ByteCounter(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func._schema.name not in MOVES_NOTHING and (
                    counted is None or counted(func, args, out)):
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                self.total += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) if storage
                                  else t.numel() * t.element_size() for t in tensors)
            return out
    return ByteCounter()
