"""What autograd saves for a module's backward: the bytes a block keeps from its forward to its
backward, as a count of activations is held against (tests, benchmarks/hf_block_memory.py)."""

from __future__ import annotations

from typing import Callable


def saved_storage_bytes(forward: Callable[[], object], owned=(), skip_shapes=()) -> int:
    """Bytes of the storages autograd saves for the backward while ``forward()`` runs and still holds
    when it returns, each once, less those of ``owned`` tensors (inputs and parameters the caller
    holds anyway) and of saved tensors shaped as one of ``skip_shapes`` (autocast's weight casts).
    A tensor saved by a part of the graph the forward let go (a mixture's routing, computed and
    dropped) is freed and not counted: counted by address as it was saved, its storage's address
    could be taken again by a later one, and which one counted moved from run to run."""
    import weakref

    import torch

    saved = []

    def pack(t):
        if tuple(t.shape) not in skip_shapes:
            saved.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()  # held while counting: its graph holds what is saved
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (ref() for ref in saved)
            if t is not None}
    del out
    skip = {t.untyped_storage().data_ptr() for t in owned}
    return sum(n for ptr, n in held.items() if ptr not in skip)
