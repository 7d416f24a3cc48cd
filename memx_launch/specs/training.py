"""How it is trained: TrainingSpec (batch, sequence, precision, optimizer and state sharding).
"""

from __future__ import annotations

from dataclasses import dataclass


from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number
from memx_launch.specs.model import MAX_DIMENSION


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class TrainingSpec:
    global_batch_size: int = 512
    seq_len: int = 4096
    dtype: str = "bf16"
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (Megatron's distributed optimizer, ZeRO-1)."""
    fully_sharded: bool = False
    """Shard weights, gradients and optimizer state over data-parallel ranks (FSDP, ZeRO-3)."""

    def __post_init__(self):
        require_number(self.global_batch_size, "--global-batch-size", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        require_number(self.seq_len, "--seq-len", lo=0, lo_open=True, hi=MAX_DIMENSION, integer=True)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("--dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", f"unknown optimizer {self.optimizer!r}",
                              f"use one of {', '.join(OPTIMIZERS)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
