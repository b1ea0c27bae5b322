"""The memory budget of a plan: the one-stream program's peak times a factor, never more than the device has free.

The sizes and lifetimes are the DAG's (``bytes`` and ``held``, set where the
DAG is built); the model of what a schedule needs and the budget kept while
scheduling are pure (:mod:`schedulers.stream_memory`). What is free is asked of the
device here: the caching allocator's limit for this process
(``torch.cuda.set_per_process_memory_fraction``) and what the driver has left.
"""

from __future__ import annotations

import networkx as nx
import torch

import schedulers
from schedulers.stream_memory import peak_bytes
from schedulers.schedule import insertion_order

__all__ = ["FACTOR", "FLOOR", "one_stream_peak", "free_bytes", "plan_budget"]

FACTOR = 1.05  # a plan of several streams may need at most this times the one-stream program's memory
# and never less than this more: the caching allocator holds memory in segments of 2 MiB (small blocks) and
# more, so a plan of a few small tensors that the factor alone would keep on one stream costs a segment or two
FLOOR = 8 << 20


def one_stream_peak(dag: nx.DiGraph) -> int:
    """The bytes the program needs on one stream, in program order (:func:`schedulers.peak_bytes`)."""
    order = insertion_order(dag)
    return peak_bytes(dag, order, dict.fromkeys(order, 0))


def free_bytes(device: torch.device | None) -> int | None:
    """Bytes this process may still take on ``device``: the driver's free memory, within the process's limit,
    plus what the caching allocator holds unused; None off CUDA."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(device) if get_fraction is not None else 1.0
    except RuntimeError:  # no driver to ask (a device faked for a test): nothing known
        return None
    if fraction < 1.0:
        free = min(free, max(int(fraction * total) - reserved, 0))
    return free + reserved - allocated


def plan_budget(dag: nx.DiGraph, device: torch.device | None, factor: float = FACTOR) -> int | None:
    """The bytes a multi-stream schedule of ``dag`` may need (:func:`schedulers.memory_budget`): ``factor``
    times the one-stream peak, at least :data:`FLOOR` more, never more than is free; None where the DAG says
    nothing of memory (no node with ``bytes``)."""
    if not any(b for _, b in dag.nodes(data="bytes")):
        return None
    return schedulers.memory_budget(one_stream_peak(dag), factor, free_bytes(device), at_least=FLOOR)
