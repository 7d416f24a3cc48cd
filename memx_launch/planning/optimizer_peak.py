"""The optimizer step's peak on a stage: the step's activations freed, every gradient there, and
what the step allocates itself. torch's Adam and AdamW step a GPU's plain tensors ``foreach`` by
default, each operation over all of a rank's parameters at once, so the step's square root of the
second moment (``torch._foreach_sqrt`` in ``torch/optim/adam.py``) is a temporary as large as that
moment, alive beside the weights, gradients and optimizer states (``foreach_optimizer``). Fused
kernels (Apex's and Transformer Engine's FusedAdam, DeepSpeed's, torch's ``fused=True``) keep
none; torch's for-loop, its default on DTensor parameters (tensor-parallel and fully sharded
stages: memx-run's, torchtitan's) and on the host (an emulated device's), one parameter's at a
time, left out. A stage that keeps few activations (recomputed in full) or whose gradients come
after its activations' peak (:mod:`lazy_gradients`) can peak here. No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import TrainedParameters, autocast_copy_bytes, rank_layer_params
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def step_temporary_bytes(training: TrainingSpec, trained: TrainedParameters, tp, shards,
                         emulated: bool) -> np.ndarray:
    """(P,) bytes per parameter that the optimizer step of each stage (TP degrees ``tp``)
    allocates beside its states: one moment of each parameter it updates (over ``shards`` ranks
    with a distributed optimizer) where foreach Adam steps plain tensors, else 0."""
    tp = np.asarray(tp)
    if not training.foreach_optimizer or training.optimizer != "adam" or training.optimizer_offload \
            or training.fully_sharded or emulated:
        return np.zeros(tp.shape)
    moment = training.precision_bytes("optimizer_dtype") * trained.share
    if training.distributed_optimizer:
        moment = moment / np.asarray(shards, dtype=np.float64)
    return np.where(tp == 1, moment, 0.0)


def step_block_bytes(model: ModelSpec, training: TrainingSpec, tp, state, temporary) -> np.ndarray:
    """(P,) one block's bytes at its stage's optimizer step: its states as the activations' peak
    counts them (``state``, every gradient there) less autocast's weight copies, freed with the
    step's autocast region, and the step's ``temporary`` bytes per parameter."""
    params = sum(rank_layer_params(model, training, tp))
    return state - autocast_copy_bytes(params, training) + params * temporary
