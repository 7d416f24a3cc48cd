"""The optimizer step's time on one rank: Adam reading and writing the model state at HBM speed,
or, with ``optimizer_offload``, the trained share's gradients and weights crossing PCIe and the
host running Adam. No torch import."""

from __future__ import annotations

import numpy as np

from memx_launch.planning.model_states import FULL_TRAINING, TrainedParameters, model_state_bytes_per_param
from memx_launch.planning.peaks import hbm_gbps
from memx_launch.specs.bridge import HOST_COPY_GBPS
from memx_launch.specs.cluster import DeviceType
from memx_launch.specs.training import TrainingSpec

# Host Adam (DeepSpeed's CPU-Adam) for one GPU's share of the host: about 0.22 s per billion
# parameters, the order Ren et al. 2021 (ZeRO-Offload) report for CPU-Adam; not measured here.
HOST_ADAM_S_PER_PARAM = 0.22e-9


def optimizer_step_time(params_on_rank, training: TrainingSpec, device: DeviceType, dp=1) -> np.ndarray:
    """Adam step: reads and writes the model state once at HBM speed."""
    return optimizer_step_seconds(params_on_rank, training, hbm_gbps(device), dp)


def optimizer_step_seconds(params_on_rank, training: TrainingSpec, hbm, dp=1,
                           trained: TrainedParameters = FULL_TRAINING, host_gbps: float = HOST_COPY_GBPS) -> np.ndarray:
    """:func:`optimizer_step_time` at ``hbm`` GB/s, broadcast against ``params_on_rank`` (many
    stages and device types in one call). With ``optimizer_offload`` the rank's share of the
    trained parameters (over DP when the optimizer is sharded) sends its gradients to the host
    and takes its updated weights back at ``host_gbps`` (PCIe), and the host runs Adam
    (:data:`HOST_ADAM_S_PER_PARAM`); not overlapped with the backward."""
    params = np.asarray(params_on_rank, dtype=np.float64)
    if training.optimizer_offload:
        sharded = training.distributed_optimizer or training.fully_sharded
        updated = params * trained.share / (np.asarray(dp, dtype=np.float64) if sharded else 1.0)
        moved = updated * (training.precision_bytes("grad_dtype") + training.precision_bytes("weights_dtype"))
        return moved / (host_gbps * 1e9) + updated * HOST_ADAM_S_PER_PARAM
    state = params * trained.share * model_state_bytes_per_param(training, dp)  # the trained ones' state
    return 2.0 * state / (np.asarray(hbm, dtype=np.float64) * 1e9)
