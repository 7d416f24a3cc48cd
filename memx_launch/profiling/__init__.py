"""Profiling: which configurations to measure, the measurement kernel, the profile database and
the learned predictor built on it. torch is imported only inside the kernel's functions."""

from memx_launch.profiling.design import MinimalSet, minimal_sample_set, new_type_design
from memx_launch.profiling.kernel import calibrate, detect_device_type, profile_model
from memx_launch.profiling.predictor import LearnedCostModel, Predictor, fit_predictor, load_cost_model
from memx_launch.profiling.profiledb import BridgeMeasurement, Measurement, ProfileDB
from memx_launch.profiling.space import ProfileSpace, Sample, default_space

__all__ = ["BridgeMeasurement", "LearnedCostModel", "Measurement", "MinimalSet", "Predictor", "ProfileDB", "ProfileSpace", "Sample",
           "calibrate", "default_space", "detect_device_type", "fit_predictor", "load_cost_model",
           "minimal_sample_set", "new_type_design", "profile_model"]
