"""concur: run the independent operations of branchy PyTorch networks concurrently on CUDA streams."""

from . import _torch_compat
from .api import ConcurModule, Inspection, inspect, optimize
from .backend import backend, concur_backend
from .errors import CaptureError, ConcurError, ExampleInputError, PlanError
from .train import TrainStep, train_step

_torch_compat.register_dynamo_backend("concur", concur_backend)

__all__ = ["optimize", "inspect", "train_step", "TrainStep", "ConcurModule", "Inspection", "backend",
           "ConcurError", "CaptureError", "ExampleInputError", "PlanError"]
__version__ = "0.1.0"
