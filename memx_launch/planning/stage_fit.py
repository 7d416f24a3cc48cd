"""What fits on a stage: the layers each stage can hold and the per-stage recompute hard rule,
from an :class:`~memx_launch.planning.scoring.Evaluator`'s memory lines. A stage's memory is the
highest of lines in its layers: its activations' peak, a later micro-batch's backward end where its
casts wait (:mod:`backward_end`; the split inputs' last item, None where none waits) and its
optimizer step's (the step line). No torch import.
"""

from __future__ import annotations

from functools import reduce

import numpy as np

from memx_launch.planning import costmodel as cm
from memx_launch.specs.hybrid import layers_per_block


def level_lines(inputs: tuple) -> tuple:
    """The (per-layer, fixed) bytes lines of one row of split inputs that the recompute level
    moves: the activations' peak and, where casts wait, a later micro-batch's backward end."""
    per_layer, fixed, *_, later = inputs
    return ((per_layer, fixed),) if later is None else ((per_layer, fixed), later)


def max_layers(evaluator, layout, inputs, steps) -> np.ndarray:
    """Layers each stage can hold on every one of its device types (``inputs``: the evaluator's
    ``replica_inputs`` at the levels in question, ``steps`` its step lines)."""
    return np.min([reduce(np.minimum, [np.floor((evaluator.usable(capacity) - fixed) / per_layer)
                                       for per_layer, fixed in (*level_lines(row), step)])
                   for row, step, capacity in zip(inputs, steps, layout.replica_capacity)], axis=0)


def lowest_fitting_levels(evaluator, layout, mbs, seq, v, levels, layers) -> np.ndarray:
    """Hard rule per stage: keep no recompute where it fits, else the lightest level that does."""
    best = levels.copy()
    for level in reversed(evaluator.allowed_levels):
        fits = True
        for row, capacity in zip(evaluator.uniform_inputs(layout, mbs, seq, v, level), layout.replica_capacity):
            for per_layer, fixed in level_lines(row):
                fits = fits & (layers * per_layer + fixed <= evaluator.usable(capacity))
        best = np.where(fits & (level < best), level, best)
    return best


def fewest_recomputed_layers(evaluator, layout, mbs, seq, v, levels, layers) -> np.ndarray:
    """Per stage, how many of its first layers must recompute fully for it to fit (on each of
    its device types; the activations' line and, where casts wait, a later backward's end's),
    where the hard rule chose full recompute (Megatron's block method);
    the others keep their level on every layer. A stage that fits nowhere keeps all its
    layers."""
    unit = layers_per_block(evaluator.model)  # whole blocks, as Megatron's block method recomputes them
    fewest = np.ones_like(layers, dtype=np.float64)
    inputs = []
    for k, capacity in enumerate(layout.replica_capacity):
        full_layer, full_fixed, *_, full_work, full_end = evaluator.uniform_inputs(layout, mbs, seq, v, cm.FULL)[k]
        none_layer, *_, none_work, none_end = evaluator.uniform_inputs(layout, mbs, seq, v, cm.NONE)[k]
        act = kept_layer_bytes(evaluator, layout, mbs, seq, v, k)
        # k full layers and n - k kept: k (full - none) + n none + fixed + the working set, at least
        # the kept layers' (activations.partial_recompute_working) <= usable.
        saved = np.maximum(none_layer - full_layer, 1.0)
        rest = layers * none_layer + full_fixed - full_work - evaluator.usable(capacity)
        fewest = np.maximum(fewest, np.ceil((rest + none_work) / saved))
        if full_end is not None:  # and a later backward's end, k full and n - k kept, where casts wait
            end_rest = layers * none_end[0] + full_end[1] - evaluator.usable(capacity)
            fewest = np.maximum(fewest, np.ceil(end_rest / np.maximum(none_end[0] - full_end[0], 1.0)))
        inputs.append((rest, saved, full_work, act))
    fewest = np.clip(np.ceil(fewest / unit) * unit, 1, layers)
    # A recomputed layer's working set beside what the fewer kept layers freed may not fit: all of them, then.
    for rest, saved, full_work, act in inputs:
        fewest = np.where(rest - fewest * saved + full_work - (layers - fewest) * act > 0, layers, fewest)
    return np.where(levels == cm.FULL, fewest.astype(np.int64), layers)


def kept_layer_bytes(evaluator, layout, mbs, seq, v, replica) -> np.ndarray:
    """(1, P) what one layer keeps of one micro-batch with no recompute, on the device types of
    row ``replica``: what a kept layer's backward frees before a recomputed one's runs."""
    tp, device, local = evaluator._level_free_inputs(layout, mbs, seq, v, replica)[:3]
    return evaluator.stage_layer_costs(layout, device, tp, local, seq, np.full((1, layout.pp), cm.NONE))[1]
