"""Runtime: memx-run's launcher and workers, calibration on each rank, training with a plan,
the memory monitor, checkpoints and fault injection (torch)."""

from memx_launch.runtime.prepare import prepare
from memx_launch.runtime.communication import init_distributed
from memx_launch.runtime.step_stats import StepStats
from memx_launch.runtime.training import Runtime, build, from_env

__all__ = ["Runtime", "StepStats", "build", "from_env", "init_distributed", "prepare"]
