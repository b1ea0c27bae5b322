r"""What a schedule costs in memory: each stream's own peak of live bytes, and a budget a scheduler keeps to.

Nodes may carry ``bytes`` (what the node allocates for its outputs; missing
means 0) and ``held`` (its outputs stay alive to the end of the program: a
graph output, an activation saved for backward). Any other node's outputs
are freed once the last of its successors has been issued. The model is
the caching allocator's as a CUDA graph captures it: the host issues and
frees in issue order, a block is tagged with the stream that allocated it,
and a freed block serves only that stream again. So a schedule needs, per
stream, the peak of the bytes live on that stream, and the program needs their **sum**, where one stream needs only the
peak of all of them. Two branches of two nodes each, 4 bytes a node::

           a             one stream, a b1 b2 c1 c2 d: at most 3 outputs live, 12 bytes
         /   \
       b1     c1         b on stream 0, c on stream 1, issued a b1 c1 b2 c2 d: each
       |      |          stream holds 2 outputs at its peak (8 bytes), and neither
       b2     c2         reuses the other's freed blocks: 16 bytes
         \   /
           d

The budget is bytes; :func:`critical_path <schedulers.critical_path.critical_path>`
given ``memory_budget`` moves a node to another stream only where the sum
of the streams' peaks stays within it. Memory is lowest where a node stays
beside its inputs, and highest near the program's peak (every held output
alive), so the budget limits concurrency there and nowhere else.

A training step's peak comes after the program, at the start of backward,
which frees the held outputs one by one and allocates the gradients: on one
stream the gradients reuse the freed blocks, but a held output a side stream
made is freed into that side stream's blocks, which the caller's stream (where
the step's backward allocates) cannot reuse. With ``training=True`` the model
counts such bytes twice: live on their side stream in the program, and again as
what the caller's stream then needs beside them. Above, c1 and c2 held on
stream 1 make the two-stream program need 16 + 8 = 24 bytes for training.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import networkx as nx

from schedulers.schedule import insertion_order

__all__ = ["MemoryTracker", "node_bytes", "stream_peaks", "peak_bytes", "memory_budget"]


def node_bytes(dag: nx.DiGraph, v: Hashable) -> int:
    """Return the ``bytes`` attribute of ``v`` (0 when missing)."""
    return int(dag.nodes[v].get("bytes") or 0)


class MemoryTracker:
    """Live and peak bytes per stream while nodes are issued one by one (the order a scheduler places them).

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b1"), ("b1", "b2"), ("b2", "d"), ("a", "c1"), ("c1", "c2"), ("c2", "d")])
    >>> nx.set_node_attributes(dag, 4, "bytes")
    >>> t = MemoryTracker(dag, streams=2)
    >>> for v, s in [("a", 0), ("b1", 0), ("c1", 1), ("b2", 0)]:
    ...     t.issue(v, s)
    >>> t.total_if("c2", 1), t.total_if("c2", 0)
    (16, 12)
    >>> t.issue("c2", 1); t.issue("d", 0)
    >>> t.peak, t.total()
    ([8, 8], 16)

    For a training step (``training=True``), held outputs made on a side stream count again:

    >>> nx.set_node_attributes(dag, {"c1": True, "c2": True}, "held")
    >>> t = MemoryTracker(dag, streams=2, training=True)
    >>> for v, s in [("a", 0), ("b1", 0), ("c1", 1), ("b2", 0), ("c2", 1), ("d", 0)]:
    ...     t.issue(v, s)
    >>> t.peak, t.side_held, t.total()
    ([8, 8], 8, 24)
    """

    def __init__(self, dag: nx.DiGraph, streams: int, training: bool = False):
        self.dag = dag
        self.training = training
        self.live = [0] * streams
        self.peak = [0] * streams
        self.side_held = 0  # for training: the bytes of held outputs made on side streams
        self._stream: dict[Hashable, int] = {}
        self._waiting = {v: dag.out_degree(v) for v in dag.nodes}  # successors not yet issued
        self._unissued = sum(node_bytes(dag, v) for v in dag.nodes)  # bytes of the nodes not yet issued
        self._program: list[Hashable] | None = None  # program order, made where a look-ahead first needs it

    def total(self) -> int:
        """The program's bytes so far: the sum of the streams' peaks, and for training the side streams' held
        bytes again."""
        return sum(self.peak) + (self.side_held if self.training else 0)

    def total_if(self, v: Hashable, stream: int) -> int:
        """:meth:`total` were ``v`` issued on ``stream`` next (nothing is changed)."""
        grown = max(self.peak[stream], self.live[stream] + node_bytes(self.dag, v))
        return self.total() - self.peak[stream] + grown + self._stranded(v, stream)

    def _stranded(self, v: Hashable, stream: int) -> int:
        """The bytes issuing ``v`` on ``stream`` leaves the caller's stream without in a training step's backward."""
        if not self.training or stream == 0 or not self.dag.nodes[v].get("held"):
            return 0
        return node_bytes(self.dag, v)

    def copy(self) -> "MemoryTracker":
        """A tracker in the same state, to try a continuation on."""
        other = MemoryTracker.__new__(MemoryTracker)
        other.dag, other.live, other.peak = self.dag, list(self.live), list(self.peak)
        other.training, other.side_held = self.training, self.side_held
        other._stream, other._waiting = dict(self._stream), dict(self._waiting)
        other._unissued, other._program = self._unissued, self._program
        return other

    def fits_if(self, v: Hashable, stream: int, budget: int) -> bool:
        """Whether issuing ``v`` on ``stream`` leaves the program within ``budget`` with every node not yet
        issued then issued on stream 0, in program order.

        Looking ahead keeps the budget where a branch would otherwise take
        its share early and leave a later join no room on any stream.
        """
        if self.total_if(v, stream) > budget:
            return False
        if self.total() + self._unissued + self._stranded(v, stream) <= budget:
            return True  # everything left fits even if nothing were ever freed
        if self._program is None:
            self._program = insertion_order(self.dag)
        trial = self.copy()
        trial.issue(v, stream)
        for u in self._program:
            if u in trial._stream:
                continue
            trial.issue(u, 0)
            if trial.total() > budget:
                return False
        return True

    def issue(self, v: Hashable, stream: int) -> None:
        """Issue ``v`` on ``stream``: its outputs become live there; inputs whose last reader it is are freed."""
        self._stream[v] = stream
        self.side_held += self._stranded(v, stream)
        self._unissued -= node_bytes(self.dag, v)
        self.live[stream] += node_bytes(self.dag, v)
        self.peak[stream] = max(self.peak[stream], self.live[stream])
        for u in self.dag.predecessors(v):
            self._waiting[u] -= 1
            if self._waiting[u] == 0 and not self.dag.nodes[u].get("held"):
                self.live[self._stream[u]] -= node_bytes(self.dag, u)
        if self._waiting[v] == 0 and not self.dag.nodes[v].get("held"):  # read by nothing: freed at once
            self.live[stream] -= node_bytes(self.dag, v)


def stream_peaks(dag: nx.DiGraph, order: Sequence[Hashable], stream: Mapping[Hashable, int]) -> list[int]:
    """Return each stream's peak of live bytes when ``order`` is issued with ``stream`` (a schedule's fields).

    >>> import networkx as nx
    >>> dag = nx.DiGraph([("a", "b1"), ("b1", "b2"), ("b2", "d"), ("a", "c1"), ("c1", "c2"), ("c2", "d")])
    >>> nx.set_node_attributes(dag, 4, "bytes")
    >>> stream_peaks(dag, ["a", "b1", "b2", "c1", "c2", "d"], dict.fromkeys(dag, 0))
    [12]
    >>> stream_peaks(dag, ["a", "b1", "c1", "b2", "c2", "d"], dict(a=0, b1=0, b2=0, c1=1, c2=1, d=0))
    [8, 8]
    """
    tracker = MemoryTracker(dag, max(stream.values(), default=0) + 1)
    for v in order:
        tracker.issue(v, stream[v])
    return tracker.peak


def peak_bytes(dag: nx.DiGraph, order: Sequence[Hashable], stream: Mapping[Hashable, int]) -> int:
    """Return the bytes a schedule needs: the sum over streams of each stream's peak (:func:`stream_peaks`)."""
    return sum(stream_peaks(dag, order, stream))


def memory_budget(one_stream_peak: int, factor: float = 1.05, free: int | None = None, at_least: int = 0) -> int:
    """Return the bytes a multi-stream program may need: ``factor`` times the one-stream program's peak, and at
    least ``at_least`` bytes more than it, but never more than that peak plus ``free`` (what the device has left,
    where known).

    >>> memory_budget(100), memory_budget(100, free=2), memory_budget(100, factor=1.5, free=None)
    (105, 102, 150)
    >>> memory_budget(100, at_least=8), memory_budget(100, free=2, at_least=8)
    (108, 102)
    """
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (the one-stream program must fit its own budget), got {factor!r}")
    budget = max(int(one_stream_peak * factor), one_stream_peak + at_least)
    return budget if free is None else min(budget, one_stream_peak + max(free, 0))
