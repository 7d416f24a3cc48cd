"""Which blocks of a model attend within a window or chunk (sliding-window and chunked attention),
and their share: read by the cost model, the calibration's block shapes and memx's LLaMA builder."""

from __future__ import annotations


def local_attention_share(model) -> float:
    """Share of the blocks attending within a window or chunk (:func:`attends_locally`)."""
    if not (model.sliding_window or model.attention_chunk_size):
        return 0.0
    return (model.num_layers - model.full_attention_layers) / model.num_layers


def attends_locally(model, layer: int) -> bool:
    """Whether block ``layer`` (from 0) attends within its window or chunk: all but
    ``full_attention_layers`` of the blocks, the full ones evenly spaced as the families place
    them, where ``(layer + 1) % (num_layers // full_attention_layers)`` is 0 (Gemma 2 and GPT-OSS
    every other block from the second, Gemma 3 every sixth, Llama 4 every fourth)."""
    if not (model.sliding_window or model.attention_chunk_size):
        return False
    if not model.full_attention_layers:
        return True
    period = model.num_layers // model.full_attention_layers
    return (layer + 1) % period != 0 or (layer + 1) // period > model.full_attention_layers
