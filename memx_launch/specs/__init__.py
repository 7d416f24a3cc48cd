"""What is trained (model), on what (cluster) and how (training): validated specs, no torch."""

from memx_launch.specs.cluster import ClusterSpec, DeviceType, Emulation, Node
from memx_launch.specs.efficiency import DEFAULT_EFFICIENCY, default_efficiency
from memx_launch.specs.model import ModelSpec
from memx_launch.specs.catalog import MODEL_CATALOG, get_model
from memx_launch.specs.training import DTYPE_BYTES, OPTIMIZERS, TrainingSpec

__all__ = ["DEFAULT_EFFICIENCY", "DTYPE_BYTES", "MODEL_CATALOG", "OPTIMIZERS", "ClusterSpec", "DeviceType",
           "Emulation", "ModelSpec", "Node", "TrainingSpec", "default_efficiency", "get_model"]
