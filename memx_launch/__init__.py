"""memx: memory-aware parallelism planning and launching for heterogeneous GPU clusters.

The names a script uses. They load on first use, so ``import memx_launch.planning`` stays free
of torch; the flow's steps are the sub-packages specs -> planning -> profiling -> runtime.
"""

from memx_launch.lazy import lazy_attributes

_EXPORTS = {
    "ConfigError": "memx_launch.errors", "MemxError": "memx_launch.errors",
    "NoFeasiblePlanError": "memx_launch.errors",
    "ClusterSpec": "memx_launch.specs", "ModelSpec": "memx_launch.specs", "TrainingSpec": "memx_launch.specs",
    "get_model": "memx_launch.specs",
    "Plan": "memx_launch.planning", "SearchSpace": "memx_launch.planning", "search": "memx_launch.planning",
    "evaluate_layout": "memx_launch.planning",
    "ProfileDB": "memx_launch.profiling", "load_cost_model": "memx_launch.profiling",
    "Runtime": "memx_launch.runtime", "build": "memx_launch.runtime", "from_env": "memx_launch.runtime",
    "prepare": "memx_launch.runtime",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_attributes(__name__, _EXPORTS)
