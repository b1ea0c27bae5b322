"""The checks and defaults of ``train_step``'s arguments, apart from the step that uses them."""

from __future__ import annotations

from typing import Any

import torch


def check_arguments(example_batch: Any, grad_scaler: Any, accumulate: Any, before_step: Any) -> None:
    """Raise a TypeError or ValueError naming the argument that ``train_step`` cannot take."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if not (isinstance(example_batch, (tuple, list)) and len(example_batch) == 2):
        raise TypeError("example_batch must be a pair (inputs, targets)")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int (micro-batches per optimizer step), got {accumulate!r}")
    if before_step is not None and not callable(before_step):
        raise TypeError(f"before_step must be callable as before_step(model, optimizer), got {before_step!r}")


def as_tuple(x: Any) -> tuple:
    """A model's positional inputs as a tuple (one tensor or a list of them)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_streams(streams: Any, compile: bool, compile_options: dict | None) -> None:
    """Raise a ValueError for a stream count that is not a positive int or "auto", or backend options without
    compile."""
    if streams != "auto" and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 1):
        raise ValueError(f"streams must be a positive int or 'auto', got {streams!r}")
    if compile_options and not compile:
        raise ValueError("compile_options are options of the torch.compile backend: pass compile=True too")


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if group.get("momentum", 0) and group.get("dampening", 0):
            raise ValueError("train_step with cuda_graph=True does not support SGD dampening != 0: the "
                             "captured step always takes the 'momentum buffer exists' branch, so the "
                             "first step would differ from eager PyTorch. Use cuda_graph=False.")


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Set ``capturable=True`` where the optimizer has it (NAdam, RAdam, ...), moving step counters."""
    for group in optimizer.param_groups:
        if not all(p.is_cuda for p in group["params"]):  # capturable asserts CUDA (the CPU tests emulate graphs)
            continue
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)


def split_option(split_weight_grads: bool | None, compile_options: dict[str, Any], compile: bool,
                  cuda_graph: bool) -> bool:
    """Return whether weight gradients are split: the argument, else ``compile_options``' value, else the default.

    The default is True except for an unfused step run eagerly, which would pay the split's host time each step.

    On the fused path the argument goes into ``compile_options``, as the backend's option of that name.
    """
    given = compile_options.get("split_weight_grads")
    if split_weight_grads is not None and given is not None and bool(given) != split_weight_grads:
        raise ValueError(f"concur.train_step: split_weight_grads={split_weight_grads} contradicts "
                         f"compile_options['split_weight_grads']={given}; compile_options are options of the "
                         "torch.compile backend, and this one is an argument of train_step too: pass it once")
    default = compile or cuda_graph
    value = split_weight_grads if split_weight_grads is not None else (default if given is None else bool(given))
    if compile and given is None and split_weight_grads is not None:
        compile_options["split_weight_grads"] = value
    return value
