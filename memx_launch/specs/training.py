"""How it is trained: TrainingSpec (batch, sequence, precision, optimizer and state sharding).
"""

from __future__ import annotations

from dataclasses import dataclass


from memx_launch.errors import ConfigError


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
        if not isinstance(self.global_batch_size, int) or self.global_batch_size <= 0:
            raise ConfigError("--global-batch-size", f"must be a positive integer, got {self.global_batch_size!r}")
        if not isinstance(self.seq_len, int) or self.seq_len <= 0:
            raise ConfigError("--seq-len", f"must be a positive integer, got {self.seq_len!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("--dtype", f"unknown dtype {self.dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", f"unknown optimizer {self.optimizer!r}",
                              f"use one of {', '.join(OPTIMIZERS)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
