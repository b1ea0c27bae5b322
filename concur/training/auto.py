"""``streams="auto"``: the stream count (and scheduler) of a step, measured on a GPU and predicted elsewhere."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from concur.dag.annotate import tensors_in
from concur.fx import module as api

log = logging.getLogger("concur")


def as_tuple(x: Any) -> tuple:
    """A model's positional inputs as a tuple (one tensor or a list of them)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def auto_configuration(model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                        example_batch: tuple, scheduler: str, cuda_graph: bool, compile: bool,
                        amp_dtype: torch.dtype | None = None,
                        compile_options: dict[str, Any] | None = None,
                       make_step: Callable | None = None) -> tuple[int, str, bool]:
    """Return (streams, scheduler, cuda_graph) for ``streams="auto"``: measured on a GPU, predicted elsewhere.

    The trials run in the step's precision (bf16 kernels are shorter and leave
    more room for streams); a GradScaler is left out of them: it changes no
    kernel that matters for timing, and trials must not move the user's scale.
    With ``compile`` every trial compiles, so the climb tries the given
    scheduler only, up to :data:`COMPILED_MAX_STREAMS` streams, and stops at
    the first stream count that is not measurably faster than the best so far.
    """
    on_cuda = any(t.is_cuda for t in tensors_in(example_batch[0])) and torch.cuda.is_available()
    if on_cuda:
        from concur.observe.tuner import tune_train_step

        kwargs: dict[str, Any] = {} if amp_dtype is None else {"amp_dtype": amp_dtype}
        if compile:
            kwargs.update(compile=True, schedulers=(scheduler,), max_streams=COMPILED_MAX_STREAMS,
                          budget_s=COMPILED_TUNE_BUDGET_S, probe_utilization=False)
            if compile_options:
                kwargs["compile_options"] = dict(compile_options)
        chosen = tune_train_step(model, loss_fn, optimizer, example_batch, make_step=make_step, **kwargs).config
        if chosen.streams == 1:
            log.info("concur.train_step: streams='auto' keeps one stream for %s: no configuration with more "
                     "streams was measured faster than the serial graph", type(model).__name__)
        return chosen.streams, chosen.scheduler, cuda_graph and chosen.cuda_graph
    streams = _predicted_stream_count(model, as_tuple(example_batch[0]), scheduler)
    if streams == 1:
        log.info("concur.train_step: streams='auto' keeps one stream for %s: no plan with more streams is "
                 "predicted faster (kernels sharing the device)", type(model).__name__)
    return streams, scheduler, cuda_graph


# streams="auto" with compile=True: each trial compiles (inductor's cache serves the repeated graphs)
COMPILED_MAX_STREAMS = 4
COMPILED_TUNE_BUDGET_S = 600.0


def _predicted_stream_count(model: nn.Module, inputs: tuple, scheduler: str) -> int:
    """Fewest streams reaching 97% of the best predicted speedup of the unfused plan."""
    speedups = api.inspect(model, inputs, scheduler=scheduler).predicted_speedup
    best = max(speedups.values())
    return min(k for k, v in speedups.items() if v >= 0.97 * best)
