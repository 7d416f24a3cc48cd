"""The combinations of training options memx refuses (``TrainingSpec.__post_init__``, once every
field has its setup's default): one clear error naming the flag and the fix for each pair of
options that contradict each other or that no framework runs together."""

from __future__ import annotations

from memx_launch.errors import ConfigError
from memx_launch.specs.checks import require_number
from memx_launch.specs.model import MAX_DIMENSION


def check_combinations(spec) -> None:
    """Refuse a ``TrainingSpec`` whose options contradict each other."""
    if spec.torch_loss_parallel and not spec.vocab_parallel_loss:
        raise ConfigError("--torch-loss-parallel", "is a vocab-parallel loss, and vocab_parallel_loss is off",
                          "drop --no-vocab-parallel-loss (or --torch-loss-parallel)")
    if spec.async_tp and spec.tp_comm_overlap:
        raise ConfigError("--async-tp", "and --tp-comm-overlap both hide TP collectives",
                          "keep --async-tp for torch's AsyncTP or --tp-comm-overlap for Megatron's")
    if spec.async_tp and not spec.sequence_parallel:
        raise ConfigError("--async-tp", "micro-pipelines sequence parallelism's gathers and scatters",
                          "add --sequence-parallel (or use --setup torchtitan)")
    if spec.tp_comm_overlap and not spec.sequence_parallel:
        raise ConfigError("--tp-comm-overlap", "overlaps sequence parallelism's all-gathers and reduce-scatters",
                          "add --sequence-parallel (or use --setup megatron)")
    if spec.sharded_gradients and not spec.distributed_optimizer and not spec.fully_sharded:
        raise ConfigError("--sharded-gradients", "needs the optimizer state sharded as well",
                          "use --setup zero2 or add --distributed-optimizer")
    _check_shard_degree(spec)


def _check_shard_degree(spec) -> None:
    """Hybrid sharding shards what a sharded setup shards, over part of the DP group."""
    if spec.shard_degree is None:
        return
    require_number(spec.shard_degree, "--shard-degree", lo=1, hi=MAX_DIMENSION, integer=True,
                   fix="give the ranks of a DP group that shard the model states, e.g. 8 (a node's)")
    if not (spec.fully_sharded or spec.distributed_optimizer):
        raise ConfigError("--shard-degree", "shards the model states over part of each DP group, and this run "
                          "shards none", "use a sharded setup (--setup fsdp2, zero3, zero1, megatron, torchtitan) "
                          "or drop --shard-degree")
    if spec.full_gradient_allreduce:
        raise ConfigError("--shard-degree", "with full_gradient_allreduce (--setup scaling), whose optimizer "
                          "all-reduces the whole gradients over the DP group", "drop --shard-degree")
    if spec.hpz_partition_size > 1:
        raise ConfigError("--shard-degree", "and --hpz-partition-size: DeepSpeed runs MiCS or ZeRO++'s hpZ, "
                          "not both", "drop one of them")
