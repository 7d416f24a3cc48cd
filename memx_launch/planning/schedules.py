"""Pipeline schedules: how many micro-batches a stage holds and how long an iteration takes.

Synchronous 1F1B (Narayanan et al. 2021, PipeDream-Flush) and its interleaved variant with v
model chunks per device. No torch import.
"""

from __future__ import annotations

import functools

import numpy as np


def inflight_microbatches(stage, pp, num_microbatches, virtual_stages=1) -> np.ndarray:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at its peak, in whole
    stages' worth.

    1F1B: min(P - i, G). Interleaved with v model chunks a rank (Megatron-LM's schedule, torch's
    ``ScheduleInterleaved1F1B``): rank i runs (v-1) P + 2 (P-1-i) chunk forwards before its first
    backward and holds one more at its peak, each 1/v of its layers: P + (P-1-2i)/v micro-batches'
    worth, at most G. The first rank's is Narayanan et al.'s P (1 + (P-1)/(P v)); the later ranks
    hold nearly as much (measured under torch's schedule in tests/test_runtime.py).
    """
    stage = np.asarray(stage, dtype=np.float64)
    pp = np.asarray(pp, dtype=np.float64)
    g = np.asarray(num_microbatches, dtype=np.float64)
    v = np.asarray(virtual_stages, dtype=np.float64)
    chunks = np.minimum((v - 1.0) * pp + 2.0 * (pp - 1.0 - stage) + 1.0, v * g)
    return np.where(v > 1, chunks / v, np.minimum(pp - stage, g))


@functools.lru_cache(maxsize=4096)
def stage_inflight_microbatches(pp: int, num_microbatches: int, virtual_stages: int = 1) -> np.ndarray:
    """(P,) :func:`inflight_microbatches` of every stage of a pipeline, read-only: cached, as the
    search asks the same few pipelines for every group it scores."""
    inflight = inflight_microbatches(np.arange(pp), pp, num_microbatches, virtual_stages)
    inflight.flags.writeable = False
    return inflight


def iteration_time_1f1b(stage_times, transfer_times, num_microbatches, t_fix=0.0, t_dp=0.0):
    """1F1B iteration time (the paper's equation 3, with transfers per micro-batch); see
    :func:`pipeline_iteration_time` with ``v = 1``."""
    return pipeline_iteration_time(stage_times, transfer_times, num_microbatches, 1, t_fix, t_dp)


def iteration_time_interleaved(stage_times, transfer_times, num_microbatches, virtual_stages,
                               t_fix=0.0, t_dp=0.0, overlapped=True):
    """Interleaved 1F1B with ``v`` model chunks per device; see :func:`pipeline_iteration_time`.

    Not the paper's printed equation 4, which divides the steady-state term by v: interleaving
    shrinks only the bubble (Narayanan et al. 2021, section 2.2.2), every micro-batch still
    costs its whole stage compute. Its sends overlap the next chunk's compute: Megatron-LM's
    interleaved schedule posts them asynchronously (``--overlap-p2p-communication``, on by
    default there and forced off for plain 1F1B), as torch's ``ScheduleInterleaved1F1B`` does.
    ``overlapped``: False where an edge's sends block (``--no-overlap-p2p-comm``; a bridge between
    communication domains, whose host copies run on the host's thread), one value or (P,).
    """
    return pipeline_iteration_time(stage_times, transfer_times, num_microbatches, virtual_stages,
                                   t_fix, t_dp, overlapped)


def pipeline_iteration_time(stage_times, transfer_times, num_microbatches, virtual_stages=1,
                            t_fix=0.0, t_dp=0.0, overlapped=False):
    """Iteration time of a synchronous 1F1B pipeline, arrays whose last axis is the stage.

    ``stage_times[i]``: forward + backward of one micro-batch on stage i (all its chunks);
    ``transfer_times[i]``: one activation (or its gradient) from stage i to stage i+1; the
    last: from the last stage to the first (interleaving's wrap-around; 0 where unpriced).
    Each micro-batch pays the blocking sends of its stage: forward to the next stage and
    backward to the previous one, each link full duplex, v times with v chunks (Narayanan
    2021: point-to-point traffic grows v times). ``overlapped`` (one value or (P,)): the edges
    whose sends run while the stage computes its next chunk; a stage waits only for what its overlapped
    sends take beyond one chunk's compute, ``v max(0, x_{i-1} + x_i - t_i / v)`` in place of
    ``v (x_{i-1} + x_i)``, and for its blocking ones whole. With ``e_i = t_i + v (x_{i-1} + x_i)``:

        T = G max_i e_i + (sum_i e_i - max_i e_i) / v + t_fix + t_dp

    The first term is every micro-batch through the slowest stage; the second the fill and
    drain (the bubble), which interleaving divides by v: for equal stages the bubble
    fraction is (p-1)/(v G). With v = 1 this is the paper's equation 3,
    ``(G-1) max t + sum t + 2 sum x`` plus the per-micro-batch transfers of the bottleneck.
    """
    g = np.asarray(num_microbatches, dtype=np.float64)
    v = np.asarray(virtual_stages, dtype=np.float64)
    t = np.asarray(stage_times, dtype=np.float64)
    x = np.asarray(transfer_times, dtype=np.float64)
    chunks = np.expand_dims(v, -1)

    def with_previous(edges):  # a stage sends over its own edge and the one before it
        return edges + np.concatenate([edges[..., -1:], edges[..., :-1]], axis=-1)

    if not np.any(overlapped):  # plain 1F1B, most layouts scored: every send blocks
        e = t + chunks * with_previous(x)
    else:
        hidden_x, blocking_x = np.where(overlapped, x, 0.0), np.where(overlapped, 0.0, x)
        e = t + chunks * (np.maximum(with_previous(hidden_x) - t / chunks, 0.0) + with_previous(blocking_x))
    slowest = e.max(axis=-1)
    return g * slowest + (e.sum(axis=-1) - slowest) / v + t_fix + t_dp
