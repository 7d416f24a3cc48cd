"""What autograd saves for a module's backward: the bytes a block keeps from its forward to its
backward, as a count of activations is held against (tests, benchmarks/hf_block_memory.py)."""

from __future__ import annotations

from typing import Callable


def saved_storage_bytes(forward: Callable[[], object], owned=(), skip_shapes=()) -> int:
    """Bytes of the storages autograd saves for the backward while ``forward()`` runs, each once,
    less those of ``owned`` tensors (inputs and parameters the caller holds anyway) and of saved
    tensors shaped as one of ``skip_shapes`` (autocast's weight casts)."""
    import torch

    saved = {}

    def pack(t):
        if tuple(t.shape) not in skip_shapes:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    skip = {t.untyped_storage().data_ptr() for t in owned}
    return sum(n for ptr, n in saved.items() if ptr not in skip)
