"""The optimizer step's peak on a stage: the step's activations freed, every gradient there, and
what the step allocates itself. torch's Adam and AdamW step a GPU's tensors ``foreach`` by
default, each operation over all of a rank's parameters at once, so the step's square root of the
second moment (``torch._foreach_sqrt`` in ``torch/optim/adam.py``) is a temporary as large as that
moment, alive beside the weights, gradients and optimizer states (``foreach_optimizer``). DTensor
parameters (tensor-parallel and fully sharded stages: memx-run's, FSDP2's) take it too: torch's
``distributed/tensor/__init__.py`` adds DTensor to the optimizers' foreach types, each local
shard's temporary as large as its moment. On the host (an emulated device's tensors) torch's
default is its for-loop, one parameter at a time: its square root and the division by the bias
correction, two temporaries as large as its moment, beside the previous parameter's denominator
(:func:`for_loop_temporary_bytes`). Fused kernels (Apex's and Transformer Engine's FusedAdam,
DeepSpeed's, torch's ``fused=True``) keep none. A stage that keeps few activations (recomputed in
full) or whose gradients come after its activations' peak (:mod:`lazy_gradients`) can peak here.
No torch import.
"""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import (TrainedParameters, autocast_copy_bytes, largest_block_matrix,
                                              output_layer_params, rank_layer_params)
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.training import TrainingSpec


def _torch_adam(training: TrainingSpec) -> bool:
    return training.foreach_optimizer and training.optimizer == "adam" and not training.optimizer_offload


def _moment_bytes(training: TrainingSpec, shards) -> np.ndarray:
    """Bytes of one moment per parameter of a rank's shard (over ``shards`` ranks where the
    optimizer states are sharded: a distributed optimizer, FSDP's shards)."""
    moment = np.asarray(training.precision_bytes("optimizer_dtype"), dtype=np.float64)
    if training.distributed_optimizer or training.fully_sharded:
        moment = moment / np.asarray(shards, dtype=np.float64)
    return moment


def step_temporary_bytes(training: TrainingSpec, trained: TrainedParameters, tp, shards,
                         emulated: bool) -> np.ndarray:
    """(P,) bytes per parameter that the optimizer step of each stage (TP degrees ``tp``)
    allocates beside its states: one moment of each parameter it updates where foreach Adam
    steps a GPU's tensors, plain or DTensor, else 0."""
    tp = np.asarray(tp, dtype=np.float64)
    if not _torch_adam(training) or emulated:
        return np.zeros(tp.shape)
    return _moment_bytes(training, shards) * trained.share + np.zeros(tp.shape)


def for_loop_temporary_bytes(model: ModelSpec, training: TrainingSpec, tp, end_tp, shards, pp: int,
                             emulated: bool) -> np.ndarray:
    """(P,) bytes torch's for-loop Adam allocates at its peak on each of ``pp`` stages (TP degrees
    ``tp``, the ends' ``end_tp``), on the host (an emulated device's tensors; 0 elsewhere): a
    parameter's square root and its division by the bias correction beside the previous parameter's
    denominator, which the loop's variable still holds. A block's largest matrix follows one as
    large (LLaMA's up after its gate, GPT's projection after its MLP input): 3 of its moments; the
    embedding, the first parameter, 2 of its; the output layer 2 of its beside the final norm's. As
    if its largest parameters trained where only part does (LoRA, frozen layers): an upper bound.
    Measured on memx's LLaMA: ``tests/test_optimizer_peak.py``."""
    if not _torch_adam(training) or not emulated:
        return np.zeros(pp)
    tp = np.broadcast_to(np.asarray(tp, dtype=np.float64), (pp,))
    elements = 3 * largest_block_matrix(model, training, tp)
    first, last = end_tp
    elements[0] = max(elements[0], 2 * model.word_embedding_params / first)
    elements[-1] = max(elements[-1], 2 * output_layer_params(model, pp) / last + model.norm_params)
    return elements * _moment_bytes(training, shards)


def step_block_bytes(model: ModelSpec, training: TrainingSpec, tp, state, temporary) -> np.ndarray:
    """(P,) one block's bytes at its stage's optimizer step: its states as the activations' peak
    counts them (``state``, every gradient there) less autocast's weight copies, freed with the
    step's autocast region, and the step's ``temporary`` bytes per parameter."""
    params = sum(rank_layer_params(model, training, tp))
    return state - autocast_copy_bytes(params, training) + params * temporary
