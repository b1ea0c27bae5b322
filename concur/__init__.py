"""concur: run the independent operations of branchy PyTorch networks concurrently on CUDA streams."""

from concur.backend import backend
from concur.errors import BatchError, CaptureError, ConcurError, ExampleInputError, PlanError
from concur.fx.module import ConcurModule, Inspection, inspect, optimize
from concur.training.step import TrainStep, train_step

# torch.compile(backend="concur") finds the backend through the torch_dynamo_backends entry point
# (pyproject.toml), which every torch concur supports (>= 2.4) reads: importing concur registers nothing.

__all__ = ["optimize", "inspect", "train_step", "TrainStep", "ConcurModule", "Inspection", "backend",
           "ConcurError", "CaptureError", "ExampleInputError", "BatchError", "PlanError"]
__version__ = "0.1.0"
