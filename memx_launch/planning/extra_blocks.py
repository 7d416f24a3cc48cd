"""Layers beside a model's repeated one: a mixture of experts' dense blocks, the first ones
(DeepSeek's ``first_k_dense_replace``), which the first stage holds, or those between its
expert blocks (Llama 4 Maverick's ``interleave_moe_layer_step``), wherever the split puts them;
a hybrid model's kinds of layers (Mamba, attention, MLP: :attr:`ModelSpec.layer_kinds`), whose
repeated layer is their mean, wherever the split puts them; and the multi-token prediction
modules' blocks, which the last stage runs after the head. A split counts the model's layers; a
stage's bytes and seconds are its layers at the repeated layer's cost plus :func:`beside_repeated`.
No torch import."""

from __future__ import annotations

import functools

import numpy as np

from memx_launch.planning.layer_split import chunk_layers
from memx_launch.specs.hybrid import HYBRID_LAYER_KINDS
from memx_launch.specs.model import ModelSpec


def first_stage_min_layers(model: ModelSpec, v: int) -> int:
    """Blocks the first stage must hold for every dense first block to be in its first chunk
    (Megatron builds the blocks in order, chunk by chunk), its other chunks a block each (the
    export puts them there: ``exporters.first_chunk_at_least``)."""
    return model.dense_layers + v - 1 if model.dense_layers else 0


def first_repeated_block(model: ModelSpec) -> int:
    """The index of the model's first block of its repeated kind, the one calibration measures (a
    profile times that block; the other kinds are priced beside it): a mixture's first expert
    block, after its dense first blocks or at the step where dense ones sit between its expert ones
    (block ``step - 1``); 0 for any other model."""
    return (model.dense_layers or model.moe_layer_step - 1) if model.num_experts else 0


def other_kinds(model: ModelSpec) -> list[ModelSpec]:
    """The shapes priced beside the repeated layer: a mixture of experts' dense block, or each of
    a hybrid model's kinds; none for a transformer of one kind of block."""
    if model.layer_kinds:
        return [kind for kind, _ in model.layer_kinds]
    return [model.dense_block] if model.dense_block_count else []


def split_places_kinds(model: ModelSpec) -> bool:
    """Whether the split decides which kind each stage's layers are (interleaved dense blocks, a
    hybrid model's pattern), not the model alone (dense first blocks on the first stage)."""
    return model.moe_layer_step > 1 or bool(model.layer_kinds)


@functools.lru_cache(maxsize=None)
def _running_counts(pattern: str, chars: str) -> tuple[np.ndarray, ...]:
    """For each of ``chars``, (L + 1,): how many of ``pattern``'s first i layers are of it. Kept:
    every scored split asks again."""
    return tuple(np.concatenate([[0], np.cumsum([c == char for c in pattern])]) for char in chars)


@functools.lru_cache(maxsize=None)
def _interleaved_pattern(num_layers: int, step: int) -> str:
    """Interleaved experts as a pattern: block ``i`` an expert one (E) where ``(i + 1) % step`` is 0, else dense (-)."""
    return "".join("-" if (i + 1) % step else "E" for i in range(num_layers))


def layers_of_kinds(pattern: str, chars: str, layers, v: int) -> list[np.ndarray]:
    """For each of ``chars``, (..., P) the layers of that character of ``pattern`` (one a layer, in
    model order) on each stage of ``layers`` (..., P) in ``v`` chunks: the chunks hold layers in
    model order, virtual-stage major (chunk k on stage k mod P)."""
    chunks = chunk_layers(layers, v)                   # (..., P, v)
    ordered = np.swapaxes(chunks, -1, -2)              # (..., v, P): model order once flattened
    flat = ordered.reshape(*ordered.shape[:-2], -1)
    end = np.cumsum(flat, axis=-1)
    # A row splitting more layers than the model has is infeasible: counted to its end.
    hi, lo = np.minimum(end, len(pattern)), np.minimum(end - flat, len(pattern))
    return [(running[hi] - running[lo]).reshape(ordered.shape).sum(axis=-2)
            for running in _running_counts(pattern, chars)]


def interleaved_dense_counts(model: ModelSpec, layers, v: int) -> np.ndarray:
    """(..., P) dense blocks among each stage's ``layers`` (..., P) where they sit between the
    expert ones (``moe_layer_step``): block ``i`` is an expert one where ``(i + 1) % step`` is 0."""
    return layers_of_kinds(_interleaved_pattern(model.num_layers, model.moe_layer_step), "-", layers, v)[0]


def kind_counts(model: ModelSpec, pp: int, layers=None, v: int = 1) -> list[np.ndarray]:
    """Each of :func:`other_kinds`' layers on each stage: a mixture's dense first blocks (P,) on
    the first stage, or (..., P) the interleaved ones or a hybrid model's kinds the split ``layers``
    (..., P) in ``v`` chunks gives each stage. Before the split is known (``layers`` None) those
    count 0 here: the repeated layer's cost (:func:`mean_block`, a hybrid model's mean) prices them."""
    if model.layer_kinds:
        if layers is None:
            return [np.zeros(pp) for _ in model.layer_kinds]
        chars = "".join(char for char in HYBRID_LAYER_KINDS if char in model.hybrid_pattern)  # layer_kinds' order
        return [n.astype(np.float64) for n in layers_of_kinds(model.hybrid_pattern, chars, layers, v)]
    if not model.dense_block_count:
        return []
    if model.moe_layer_step > 1 and layers is not None:
        return [interleaved_dense_counts(model, layers, v).astype(np.float64)]
    dense = np.zeros(pp)
    dense[0] = model.dense_layers
    return [dense]


def stage_block_counts(model: ModelSpec, layers, v: int = 1) -> tuple[list[np.ndarray], np.ndarray]:
    """(each other kind's, repeated) layers of each stage of ``layers`` (..., P) in ``v`` chunks
    (:func:`kind_counts`), every other layer the repeated one, with the last stage's multi-token
    prediction blocks."""
    counts = kind_counts(model, np.shape(layers)[-1], layers, v)
    repeated = layers - sum(counts)
    repeated[..., -1] += model.mtp_layers
    return counts, repeated


def mean_block(model: ModelSpec, repeated_cost, kind_costs):
    """A block's cost on average over a model whose dense blocks sit between its expert ones: what
    a split weighs each block at before it knows which of a stage's blocks are dense."""
    if model.moe_layer_step == 1:
        return repeated_cost
    share = model.dense_block_count / model.num_layers
    return repeated_cost + share * (np.asarray(kind_costs[0]) - repeated_cost)


def beside_repeated(model: ModelSpec, repeated_cost, kind_costs, counts):
    """What a stage's layers cost beyond ``layers x repeated_cost``: each other kind's ``counts``
    (..., P) at its cost's difference (``kind_costs``, one a kind), and on the last stage the
    multi-token prediction blocks. Per-layer costs broadcast to (..., P): bytes or seconds. 0 for
    a model without either."""
    if not (counts or model.mtp_layers):
        return 0.0
    repeated = np.asarray(repeated_cost, dtype=np.float64)
    out = np.zeros(np.broadcast_shapes(repeated.shape, *(np.shape(n) for n in counts)))
    for cost, n in zip(kind_costs, counts):
        out += n * (np.asarray(cost, dtype=np.float64) - repeated)
    out[..., -1] += model.mtp_layers * repeated[..., -1]
    return out


def mtp_input_bytes(model: ModelSpec, training, inflight, mbs, seq):
    """Bytes the multi-token prediction modules keep beside their blocks on the last stage, per
    micro-batch in flight: each module's embedding lookup (h) and the two normed inputs its
    projection reads (2h)."""
    if not model.mtp_layers:
        return 0.0
    return model.mtp_layers * inflight * mbs * seq * 3.0 * model.hidden_size * training.dtype_bytes
