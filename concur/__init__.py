"""concur: run the independent operations of branchy PyTorch networks concurrently on CUDA streams."""

from concur import _torch_compat
from concur.backend import backend, concur_backend
from concur.errors import BatchError, CaptureError, ConcurError, ExampleInputError, PlanError
from concur.fx.module import ConcurModule, Inspection, inspect, optimize
from concur.training.step import TrainStep, train_step

_torch_compat.register_dynamo_backend("concur", concur_backend)

__all__ = ["optimize", "inspect", "train_step", "TrainStep", "ConcurModule", "Inspection", "backend",
           "ConcurError", "CaptureError", "ExampleInputError", "BatchError", "PlanError"]
__version__ = "0.1.0"
