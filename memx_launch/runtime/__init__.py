"""Runtime: memx-run's launcher and workers, calibration on each rank, training with a plan,
the memory monitor, checkpoints and fault injection (torch).

The names a script uses load on first use: memx-run's launcher imports this package's modules
without the training stack (torch.distributed.pipelining alone takes seconds to import)."""

from memx_launch.lazy import lazy_attributes

_EXPORTS = {"Runtime": "memx_launch.runtime.training", "build": "memx_launch.runtime.training",
            "from_env": "memx_launch.runtime.training", "StepStats": "memx_launch.runtime.step_stats",
            "init_distributed": "memx_launch.runtime.communication", "prepare": "memx_launch.runtime.prepare"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_attributes(__name__, _EXPORTS)
