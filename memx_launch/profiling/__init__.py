"""Profiling: which configurations to measure, the measurement kernel, the profile database and
the learned predictor built on it. torch is imported only inside the kernel's functions.

The names load on first use: a module that needs the profile database alone (memx-run's launcher,
a worker's watchdog) does not pay for xgboost and scipy, which the predictor imports."""

from memx_launch.lazy import lazy_attributes

_EXPORTS = {name: f"memx_launch.profiling.{module}" for module, names in {
    "design": ("MinimalSet", "minimal_sample_set", "new_type_design"),
    "kernel": ("calibrate", "detect_device_type", "profile_model"),
    "predictor": ("LearnedCostModel", "Predictor", "fit_predictor", "load_cost_model"),
    "profiledb": ("BridgeMeasurement", "Measurement", "ProfileDB"),
    "space": ("ProfileSpace", "Sample", "default_space"),
}.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_attributes(__name__, _EXPORTS)
