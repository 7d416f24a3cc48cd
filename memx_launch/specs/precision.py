"""What precision a cluster's devices can train in: bf16 needs NVIDIA Ampere or later."""

from __future__ import annotations

from dataclasses import replace

from memx_launch.errors import ConfigError
from memx_launch.specs.training import TrainingSpec


BF16_MIN_COMPUTE_CAPABILITY = 8.0  # NVIDIA Ampere: V100 (7.0) and T4 (7.5) have no bf16


def device_precision(cluster, training: TrainingSpec, dtype_given: bool) -> tuple[TrainingSpec, str]:
    """bf16 on a cluster (a ClusterSpec) with a device type that has none: planned in fp16 when bf16
    was only the default (the line returned says so), refused when it was asked for."""
    old = [d for d in cluster.device_types if d.vendor == "nvidia" and d.compute_capability is not None
           and d.compute_capability < BF16_MIN_COMPUTE_CAPABILITY]
    if training.dtype != "bf16" or not old:
        return training, ""
    names = ", ".join(f"{d.name} (compute capability {d.compute_capability:.1f})" for d in old)
    if dtype_given:
        raise ConfigError("--dtype", f"bf16, but there is no bf16 on {names}", "use --dtype fp16")
    return replace(training, dtype="fp16"), f"fp16, not the default bf16: no bf16 on {names}"


def param_dtype(training: TrainingSpec) -> str:
    """The dtype of the model's parameters as ``training`` prices them: fp32 (``weights_dtype``
    fp32, computed in 16 bits by autocast, or fp32 training), else the training's 16 bits."""
    return "fp32" if "fp32" in (training.weights_dtype, training.dtype) else training.dtype


def with_param_dtype(training: TrainingSpec, dtype: str) -> TrainingSpec:
    """``training`` for a model whose parameters are ``dtype``: fp32 (memx-run's default: autocast
    computes in the training dtype, the optimizer steps the fp32 weights) or the training's own 16
    bits (a checkpoint loaded in its dtype, Transformers' default: weights, gradients and Adam's
    moments in 16 bits, no fp32 copy)."""
    if dtype == "fp32":
        return training
    if dtype != training.dtype:
        raise ConfigError("--param-dtype", f"{dtype}, but the training runs in {training.dtype}",
                          f"use --dtype {dtype}, or --param-dtype fp32")
    return replace(training, weights_dtype="training", grad_dtype="training", optimizer_dtype="training_no_master")
