"""concur: run the independent operations of branchy PyTorch networks concurrently on CUDA streams."""

from .api import ConcurModule, Inspection, inspect, optimize
from .errors import CaptureError, ConcurError, PlanError
from .train import TrainStep, train_step

__all__ = ["optimize", "inspect", "train_step", "TrainStep", "ConcurModule", "Inspection", "ConcurError", "CaptureError", "PlanError"]
__version__ = "0.1.0"
