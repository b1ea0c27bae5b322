"""The programs a captured step tries in turn where one does not fit in memory: its rungs.

A rung names the module the step builds and captures: a stream count (an
int, or ``"auto"``), or an unfused step's :class:`TrainingMemory` of one.
Each side stream keeps the blocks it allocated apart from the others (the
caching allocator gives a block back only to its own stream), so two streams
need less than four; and a plan whose budget covers the backward too keeps
large saved activations on the caller's stream, so it needs less than either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

__all__ = ["TrainingMemory", "Rung", "stream_rungs", "describe", "plain"]


@dataclass(frozen=True)
class TrainingMemory:
    """``streams`` planned within a memory budget that covers a training step's backward too
    (``concur.optimize(..., memory_model="training")``): side streams run only the branches whose saved
    activations fit it; the others run on the caller's stream."""

    streams: int | str


Rung = Union[int, str, TrainingMemory]


class _Asked(Protocol):
    requested_streams: int | str
    compile: bool


def stream_rungs(step: _Asked) -> list[Rung]:
    """The rungs ``step`` tries in turn, where a capture runs out of memory: the stream count asked for; for an
    unfused step asked for more than 2 (or ``"auto"``), 2; for an unfused step on streams, the count asked for
    planned for training's memory, then 2 so planned; then 1.

    The stream counts come first: where they fit, every branch keeps its
    stream. The rungs for training's memory come where they do not: they run
    the branches with small saved activations (at large batches, the late
    blocks of a network, where one stream fills the GPU least) beside the
    others; on 2 streams, one side stream keeps its own blocks (convolution
    workspaces, say) where 4 keep three sets. The 2-stream rung is skipped
    where the program that did not fit ran on 2 streams already (an
    ``"auto"`` plan, a network of two branches).
    A compiled step takes neither: it takes its backward graphs down in the
    same compiled module (:func:`concur.training.capture._narrow`), where a
    new module would compile the model again.
    """
    asked = step.requested_streams
    if step.compile or asked == 1:
        return list(dict.fromkeys([asked, 1]))
    wider = asked == "auto" or (isinstance(asked, int) and asked > 2)
    two = [2] if wider else []
    return list(dict.fromkeys([asked, *two, TrainingMemory(asked), *map(TrainingMemory, two), 1]))


def describe(rung: Rung) -> str:
    """The rung in words: "1 stream", "4 streams", "streams='auto'", "4 streams planned for training's memory"."""
    if isinstance(rung, TrainingMemory):
        return f"{describe(rung.streams)} planned for training's memory"
    return "1 stream" if rung == 1 else f"{rung} streams" if isinstance(rung, int) else f"streams={rung!r}"


def plain(rung: Rung | None) -> int | str | None:
    """The rung as a JSON value: a stream count as it is, a plan for training's memory in words."""
    return describe(rung) if isinstance(rung, TrainingMemory) else rung
