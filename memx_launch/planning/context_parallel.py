"""Context parallelism (Megatron's ``--context-parallel-size``, torchtitan's
``context_parallel_degree``): the ``cp`` TP groups of a DP replica each hold 1/cp of every
sequence of the micro-batch, two chunks from opposite ends so that causal attention's work
splits evenly (Megatron's load balancing: the sequence is cut into 2 x cp chunks).

Per rank, every part of a step sees seq/cp tokens (linears, norms, activations, logits,
pipeline sends; the number of micro-batches stays the global batch over DP x micro-batch),
except attention: the rank's queries attend to the whole sequence's keys, cp times the
attention of a seq/cp sequence. The keys and values go round a ring (Transformer Engine's
``p2p`` exchange): cp - 1 steps, each sending one chunk of K and V on while the attention of
the chunk in hand runs; the backward sends K and V again and their gradients beside them
(twice the bytes). A step waits for what its transfer takes beyond that chunk's attention.
A recompute that runs the layer's attention again (full; selective where it recomputes the
attention core) runs the ring again. The weights
are replicated over CP: gradients sync and sharded states spread over DP x CP ranks.

torch's ``context_parallel`` (torchtitan; ``cp_all_gather``) moves the same keys otherwise, as
``_templated_ring_attention`` and its backward run in torch 2.13 (the default rotate method,
all-gather, and ``convert_to_f32``): each pass (forward, recomputed forward, backward)
all-gathers every rank's K and V chunk at once and waits for them after the attention of its
own chunk; the backward then sends the dK and dV it accumulates on round the ring in fp32, one
hop a step, each waited for a step later, the last one after the loop with nothing left to hide
it. While a layer's attention runs, the gathered chunks, the rank's own copy it sent, and dK and
dV three times over (accumulated, sent on, received) are alive. torchtitan's LLaMA repeats K and
V to the query heads before the kernel (``repeat_kv``), so its chunks are the queries' width.

Either ring's buffers live while the layer's attention runs; its backward runs after the MLP's,
which has freed the MLP's tensors: the buffers add to the layer's working set what they exceed
those by.
"""

from __future__ import annotations

import numpy as np

from memx_launch.errors import ConfigError
from memx_launch.planning.activations import attention_recomputed, kv_repeated, mlp_bytes
from memx_launch.planning.costmodel import p2p_time

# The shortest per-rank sequence the search gives a CP degree: below it a ring step's
# attention is too short to hide the transfer of its keys and values (Megatron's guidance is
# CP for sequences of 8K and more; NeMo's 8K recipes use CP 2).
MIN_TOKENS_PER_RANK = 4096
MAX_DEGREE = 16


def search_degrees(seq_len: int) -> tuple[int, ...]:
    """The CP degrees the search tries on sequences of ``seq_len``: 1, and powers of two that
    split it into 2 x cp chunks of at least ``MIN_TOKENS_PER_RANK`` tokens per rank."""
    degrees, cp = [1], 2
    while cp <= MAX_DEGREE and seq_len % (2 * cp) == 0 and seq_len // cp >= MIN_TOKENS_PER_RANK:
        degrees.append(cp)
        cp *= 2
    return tuple(degrees)


def degrees_to_try(given: tuple[int, ...] | None, seqs, training) -> dict[int, tuple[int, ...]]:
    """Per sequence length, the CP degrees a search tries: ``given`` (each checked against the
    training's sequence) where 2 x cp divides the length, or None: those the length suits."""
    if given is None:
        return {s: search_degrees(s) if training.flash_attention else (1,) for s in seqs}
    for cp in given:
        check_degree(cp, training.seq_len, training.flash_attention)
    return {s: tuple(cp for cp in given if cp == 1 or s % (2 * cp) == 0) for s in seqs}


def check_degree(cp, seq_len: int, flash_attention: bool) -> None:
    """A CP degree the cost model can price: a positive integer, 2 x cp dividing the sequence,
    fused attention (Transformer Engine's CP attention is its fused kernel)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError("--cp", f"must be a positive integer, got {cp!r}", "e.g. --cp 2")
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ConfigError("--cp", f"cp={cp} needs a sequence length divisible by 2*cp={2 * cp}, got {seq_len}",
                          "load balancing cuts each sequence into 2*cp chunks; choose a divisor")
    if not flash_attention:
        raise ConfigError("--cp", f"cp={cp} needs fused attention", "drop --no-flash-attention, or use --cp 1")


def key_width(model, training) -> int:
    """Width of the keys (and of the values) the attention kernel receives: the KV heads', the
    query heads' where K and V are repeated to them (:func:`~memx_launch.planning.activations.kv_repeated`)."""
    return model.q_hidden_size if kv_repeated(model, training) else model.kv_hidden_size


def kv_chunk_bytes(model, training, mbs: int, seq_len: int, tp, cp: int):
    """Bytes of one ring transfer: the keys and values of one rank's seq/cp tokens, its TP
    share of their heads (:func:`key_width`)."""
    return 2.0 * mbs * (seq_len // cp) * key_width(model, training) / np.asarray(tp, dtype=np.float64) \
        * training.dtype_bytes


# HBM bytes torch's ring moves itself, beside the attention kernels and the collectives, on the
# rank that moves the most (the last of the group), per element of its queries and of its keys
# (values as many), traced in tests/test_torch_context_parallel.py: a pass's (first step, each
# later step) x (queries, keys). The forward casts each step's output and log-sum-exp to fp32 and
# merges them into the running ones; the backward adds each step's dQ, dK and dV into fp32
# accumulators and concatenates K and V for the gather and dK and dV for each hop.
RING_FORWARD_BYTES = ((12.0, 0.0), (38.5, 8.0))
RING_BACKWARD_BYTES = ((26.0, 60.0), (10.0, 50.0))


def ring_merge_bytes(model, training, mbs: int, seq_len: int, tp, cp: int, again):
    """HBM bytes torch's ring (``cp_all_gather``) moves itself in one layer's micro-batch: its
    forward pass's, again where the recompute runs the attention (``again``), and its
    backward's (:data:`RING_FORWARD_BYTES`, :data:`RING_BACKWARD_BYTES`). Transformer Engine's
    ring, which corrects its output with kernels of its own not traced here, is left at none."""
    if not training.cp_all_gather:
        return np.zeros(np.shape(again))
    tokens = mbs * (seq_len // cp) / np.asarray(tp, dtype=np.float64)
    queries = tokens * model.q_hidden_size
    keys = tokens * key_width(model, training)

    def pass_bytes(table):
        (first_q, first_k), (step_q, step_k) = table
        return queries * (first_q + step_q * (cp - 1)) + keys * (first_k + step_k * (cp - 1))
    again = np.asarray(again, dtype=np.float64)
    return pass_bytes(RING_FORWARD_BYTES) * (1.0 + again) + pass_bytes(RING_BACKWARD_BYTES)


def gradient_chunk_share(training) -> float:
    """Bytes of one chunk of dK and dV as the ring sends them, per byte of K and V: torch's
    ``context_parallel`` accumulates and sends them in fp32, Transformer Engine in the training dtype."""
    return 4.0 / training.dtype_bytes if training.cp_all_gather else 1.0


def ring_buffer_bytes(chunk_bytes, cp: int, training):
    """The ring's buffers alive while a layer's attention runs its backward: Transformer Engine's
    K and V in flight both ways and their gradients both ways; torch's the gathered chunks of the
    whole group, the rank's own copy sent, and dK and dV accumulated, sent on and received."""
    if training.cp_all_gather:
        return (cp + 1.0 + 3.0 * gradient_chunk_share(training)) * chunk_bytes
    return 4.0 * chunk_bytes


def ring_working_bytes(model, training, mbs: int, seq_len: int, tp, cp: int):
    """What the ring adds to a layer's backward working set: its buffers beyond the MLP's
    tensors, which the layer's backward has freed before the attention's runs."""
    buffers = ring_buffer_bytes(kv_chunk_bytes(model, training, mbs, seq_len, tp, cp), cp, training)
    return np.maximum(buffers - mlp_bytes(model, training, mbs, seq_len // cp, tp), 0.0)


def ring_layer_costs(model, training, mbs: int, seq_len: int, tp, cp: int, attention, ring_gbps, hbm_gbps,
                     levels) -> tuple:
    """(seconds, working bytes) context parallelism adds to one layer's micro-batch at ``levels``
    beyond a seq/cp sequence: :func:`layer_seconds` of its ring over hops of ``ring_gbps``
    (``attention``: the fused kernel's forward and backward seconds on one seq/cp chunk), the
    ring's own traffic (:func:`ring_merge_bytes`) at the device's ``hbm_gbps``, and
    :func:`ring_working_bytes`. The attention runs again where the recompute runs it (CP needs
    the fused kernel)."""
    chunk = kv_chunk_bytes(model, training, mbs, seq_len, tp, cp)
    transfer, gradients = (p2p_time(chunk * share, ring_gbps) for share in (1.0, gradient_chunk_share(training)))
    again = attention_recomputed(levels, model, training)
    seconds = (layer_seconds(*attention, transfer, gradients, cp, again, training.cp_all_gather)
               + ring_merge_bytes(model, training, mbs, seq_len, tp, cp, again) / (np.asarray(hbm_gbps) * 1e9))
    return seconds, ring_working_bytes(model, training, mbs, seq_len, tp, cp)


def layer_seconds(attention_forward, attention_backward, transfer_s, gradient_s, cp: int, again,
                  all_gather: bool = False):
    """What context parallelism adds to one layer's micro-batch beyond a seq/cp sequence: the
    attention of the other cp - 1 chunks of keys (``attention_*``: the seconds on one seq/cp
    chunk, every step's work), and what the transfers take beyond the attention they hide behind
    (``transfer_s``: one chunk of K and V over a ring hop, ``gradient_s``: one of dK and dV),
    forward, again where the layer's recompute runs its attention (``again``, from
    :func:`~memx_launch.planning.activations.attention_recomputed`), and backward. Transformer
    Engine's ring: every step's chunk behind that step's attention, K, V and their gradients in
    the backward. torch's (``all_gather``): the gather of the other chunks (cp - 1 hops) behind
    the first step's attention in each pass; dK and dV one hop a step behind the next step's,
    the last exposed."""
    again = np.asarray(again, dtype=np.float64)
    others = cp - 1.0
    compute = others * (attention_forward * (1.0 + again) + attention_backward)
    if all_gather:
        gather = others * transfer_s
        exposed = (np.maximum(gather - attention_forward, 0.0) * (1.0 + again)
                   + np.maximum(gather - attention_backward, 0.0)
                   + others * np.maximum(gradient_s - attention_backward, 0.0) + gradient_s)
    else:
        exposed = others * (np.maximum(transfer_s - attention_forward, 0.0) * (1.0 + again)
                            + np.maximum(transfer_s + gradient_s - attention_backward, 0.0))
    return compute + exposed
