"""The programs a captured step tries in turn where one does not fit in memory: its rungs.

A rung names the module the step builds and captures: a stream count (an
int, or ``"auto"``). Each side stream keeps the blocks it allocated apart
from the others (the caching allocator gives a block back only to its own
stream), so two streams need less than four.

The ladder is short on purpose: each program that does not fit is an
attempt that runs out of memory, and an operation that recovers from
running out may keep what it chose then for the rest of the process (cuDNN
keeps a convolution's algorithm with a smaller workspace, or none), which
slows every program captured after it, one stream's included.
"""

from __future__ import annotations

from typing import Protocol, Union

__all__ = ["Rung", "LEAN_POOLS_FIRST", "MEMORY_MODEL_FIRST", "CALLER_MEMORY_AFTER_OUT_OF_MEMORY", "stream_rungs",
           "describe"]

Rung = Union[int, str]

# Whether an unfused step's first plans already save no max-pooling indices (concur.fx.pool_indices), not only
# the rungs after a capture that ran out of memory: off, so that a step that fits runs the model's own program
# (one more pooling kernel in backward is time, and what memory it saves a step that fits does not need);
# `experiments/memory.py --lean-pools` weighs it
LEAN_POOLS_FIRST = False

# The memory model an unfused step's plans are made with (concur.fx.module.MEMORY_MODELS): "forward", the
# blocks a forward's side streams keep apart; "training" also counts the activations each side stream saves
# for backward, which only that stream's backward frees, so a plan made with it runs fewer branches side by side
# near backward's peak. "forward" by default; `experiments/memory.py --training-memory` weighs the other
MEMORY_MODEL_FIRST = "forward"

# Whether an unfused rung that ran out of memory is tried once more with its side streams' memory and its whole
# backward on the caller's stream (concur.caller_memory) before fewer streams. On the H200, b64 under 1.05x the
# recipe's memory, where 2 streams do not fit and one runs 1.00x: GoogLeNet and Inception-v3 keep 4 streams, 1.11x
# and 1.08x the recipe's speed (unlimited it is not taken: the plain program fits, and is faster).
# `experiments/memory.py --without-caller-memory` weighs it
CALLER_MEMORY_AFTER_OUT_OF_MEMORY = True


class _Asked(Protocol):
    requested_streams: int | str
    compile: bool


def stream_rungs(step: _Asked) -> list[Rung]:
    """The rungs ``step`` tries in turn, where a capture runs out of memory: the stream count asked for; for an
    unfused step asked for more than 2 (or ``"auto"``), 2, its plans saving no max-pooling indices
    (``step.lean_pools``, set where a rung ran out of memory); then 1.

    A compiled step takes no 2-stream rung: it takes its backward graphs
    down in the same compiled module (:func:`concur.training.capture._narrow`),
    where a new module would compile the model again.
    """
    asked = step.requested_streams
    wider = not step.compile and (asked == "auto" or (isinstance(asked, int) and asked > 2))
    return list(dict.fromkeys([asked, *([2] if wider else []), 1]))


def describe(rung: Rung) -> str:
    """The rung in words: "1 stream", "4 streams", "streams='auto'"."""
    return "1 stream" if rung == 1 else f"{rung} streams" if isinstance(rung, int) else f"streams={rung!r}"
