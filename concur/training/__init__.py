"""The training runtime: ``concur.train_step``, a whole training step (forward, loss, backward,
optimizer) captured in one CUDA graph, on streams, with optimizer hyperparameters read
from device tensors so learning-rate schedules reach the captured graph.
"""
