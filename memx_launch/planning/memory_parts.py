"""What a stage's predicted peak holds, by part: what to hold against
``torch.cuda.memory_allocated`` and ``memory_reserved`` (``memx estimate``'s table and JSON).
No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning import activation_offload, costmodel as cm, extra_blocks, schedules
from memx_launch.planning.activations import partial_recompute_working, recomputed_layers
from memx_launch.planning.group_result import GroupResult
from memx_launch.planning.layouts import first_and_last
from memx_launch.planning.lazy_gradients import gradient_relief, lazy_gradient_bytes, stage_relief
from memx_launch.planning.loss import logits_bytes
from memx_launch.planning.model_states import (autocast_copy_bytes, ends_split, held_gradient_share,
                                               stage_state_bytes_by_part, weight_copy_bytes)
from memx_launch.planning.pipeline_buffers import pipeline_buffer_bytes

# In the order reports list them. ``optimizer_step`` and ``backward_end``: what the optimizer step's peak
# (planning/optimizer_peak.py) or a later micro-batch's backward end (planning/backward_end.py) holds above
# the activations' peak, where the stage's peak is that moment; 0 elsewhere.
MEMORY_PARTS = ("parameters", "gradients", "optimizer_states", "optimizer_step", "backward_end", "activations",
                "logits_loss", "pipeline_buffers", "communicator_buffers", "fixed_overhead")
LATER_MOMENTS = ("optimizer_step", "backward_end")


def stage_memory_parts(evaluator, result: GroupResult, row: int = 0) -> list[dict[str, float]]:
    """Per stage, the bytes of ``result.memory[row]`` by part (:data:`MEMORY_PARTS`), on the
    device type it is on; they add up to it (to float rounding). The terms are the
    ``evaluator``'s (a :class:`~memx_launch.planning.scoring.Evaluator`) split inputs, told apart:
    parameters (with what a fully sharded run gathers, FP8 and autocast weight copies),
    gradients (with its unsharded ones, less those created after the peak), optimizer states
    (fp32 master + moments), what the optimizer step adds, activations (kept layers in flight,
    the embedding output, the backward's working set), the last stage's logits, the pipeline
    engine's kept outputs, communicator buffers and the fixed per-process overhead."""
    ev = evaluator
    layout, mbs, seq, v = result.layout, result.mbs, result.seq, result.v
    m, tr = ev.model, ev.training
    pp, dp = layout.pp, layout.dp
    seq_rank, local = seq // layout.cp, layout.local_micro_batch(mbs)
    first_mbs, last_mbs = first_and_last(local, pp)
    tp, shards = layout.tp_degrees, ev.shard_links.state_shards(layout)
    last = ends_split(layout, tr)[1]
    levels, layers = result.levels[row:row + 1], result.layers[row:row + 1]
    g = tr.global_batch_size // (dp * mbs)
    inflight = schedules.stage_inflight_microbatches(pp, g, v)
    lazy = lazy_gradient_bytes(m, tr, tp, ev.trained, pp, g, v)
    weights, grads, optim = stage_state_bytes_by_part(m, tr, layout, layers, ev.trained, v,
                                                      held_gradient_share(tr, pp, g, v), shards)
    gathered, unsharded_grad = cm.fully_sharded_working_parts(m, tr, tp, shards, pp)
    copies_kept, copies_working = weight_copy_bytes(m, tr, tp, pp)
    head_copies = np.eye(pp)[-1] * autocast_copy_bytes(cm.last_stage_params(m, pp) / last, tr)
    embedding_out = ev._edge_activations(inflight, first_mbs, last_mbs, seq_rank)
    logits = np.zeros(pp)
    logits[-1] = logits_bytes(m, last_mbs, seq_rank, last, tr)
    pipeline = pipeline_buffer_bytes(m, tr, local, seq_rank, tp, inflight, g, v)
    replica = np.zeros(pp, dtype=np.int64) if result.memory_replica is None else result.memory_replica[row]
    by_replica = []
    kinds, counts = extra_blocks.other_kinds(m), extra_blocks.kind_counts(m, pp, layers[0], v)
    copies = layers[0] * copies_kept + extra_blocks.beside_repeated(
        m, np.broadcast_to(copies_kept, pp), [weight_copy_bytes(kind, tr, tp, pp)[0] for kind in kinds], counts)
    for k, device in enumerate(layout.replica_device):
        def block_activations(at):  # at levels ``at``: (per block, beside the repeated blocks, working set)
            _, act, work = (x[0] for x in ev.stage_layer_costs(layout, device, tp, local, seq, at))
            kind_acts = [ev.stage_layer_costs(layout, device, tp, local, seq, at, table)[1][0]
                         for table in ev.table.kinds]
            return act, inflight * extra_blocks.beside_repeated(m, act, kind_acts, counts), work
        act, beside, work = block_activations(levels)
        kept = layers[0] * inflight * act + beside
        relief = stage_relief(m, lazy, act, layers[0], counts)
        if result.recompute_layers is not None:  # r layers at the level (the first, or every N-th), the rest at none
            act_none, beside_none, work_none = block_activations(np.full((1, pp), cm.NONE))
            every = None if result.recompute_every is None else result.recompute_every[row]
            r = recomputed_layers(layers[0], result.recompute_layers[row], every)
            kept = (r * act + (layers[0] - r) * act_none) * inflight + np.where(r > 0, beside, beside_none)
            work = partial_recompute_working(work, work_none, act_none, layers[0], r, every)
            relief = np.where(r > 0, stage_relief(m, lazy, act, r, counts)
                              + (layers[0] - r) * gradient_relief(lazy, act_none),
                              stage_relief(m, lazy, act_none, layers[0], counts))
        by_replica.append({
            "parameters": weights + gathered + copies + copies_working + head_copies,
            "gradients": grads + unsharded_grad - relief,
            "optimizer_states": optim, "optimizer_step": np.zeros(pp), "backward_end": np.zeros(pp),
            "activations": kept + embedding_out + work * (layers[0] > 0)
            - activation_offload.offloaded_bytes(tr.activation_offload_layers, inflight * act, act),
            "logits_loss": logits, "pipeline_buffers": pipeline,
            "communicator_buffers": np.broadcast_to(layout.communicators * ev.communicator_bytes[device], pp),
            "fixed_overhead": ev.overhead[device]})
    parts = [{name: float(np.broadcast_to(by_replica[k][name], pp)[i]) for name in MEMORY_PARTS}
             for i, k in enumerate(replica)]
    return with_later_moments(ev, result, row, parts)


def with_later_moments(evaluator, result: GroupResult, row: int, parts: list[dict[str, float]]) -> list[dict]:
    """``parts`` with how far each stage's peak (``result.memory``) rises above the sum of its
    other parts, the activations' peak: ``optimizer_step`` where the peak is the optimizer step's
    (the ``evaluator``'s step line, on the stage's device type), else ``backward_end`` (a later
    micro-batch's backward end); 0 where the activations' peak is the stage's."""
    layout, layers = result.layout, result.layers[row]
    replica = np.zeros(layout.pp, dtype=np.int64) if result.memory_replica is None else result.memory_replica[row]
    steps = {}
    for i, (stage, k) in enumerate(zip(parts, replica)):
        if k not in steps:
            step_layer, step_fixed = evaluator.step_line(layout, result.mbs, result.seq, result.v, int(k), layers[None])
            steps[k] = np.broadcast_to(layers * step_layer + step_fixed, (1, layout.pp))[0]
        others = sum(value for name, value in stage.items() if name not in LATER_MOMENTS)
        peak = float(result.memory[row][i])
        above = peak - others if peak - others > 1e-9 * peak else 0.0  # not the float rounding of the same sum
        at_step = float(steps[k][i]) >= peak - 1e-9 * peak
        stage["optimizer_step"], stage["backward_end"] = (above, 0.0) if at_step else (0.0, above)
    return parts
