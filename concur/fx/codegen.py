"""Turn a schedule into an fx graph whose nodes switch streams, record and wait on events.

The generated forward of a 2-stream diamond reads::

    _concur_rt.fork(x)
    a = self.stem(x);        _concur_rt.record(0)
    _concur_rt.switch(1);    _concur_rt.wait(0);  _concur_rt.keep(a)
    b = self.left(a);        _concur_rt.record(1)
    _concur_rt.switch(0)
    c = self.right(a)
    _concur_rt.wait(1);      _concur_rt.keep(b)
    d = torch.cat([b, c]);   _concur_rt.join(d)
    return d

Operations are emitted in the schedule's issue order; placeholders and
attribute reads come first since they cost nothing and run nowhere.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
from schedulers import Schedule

from concur.dag.annotate import OP_KINDS
from concur.dag.hazards import facts


def allocation_streams(graph: fx.Graph, schedule: Schedule) -> dict[fx.Node, frozenset[int]]:
    """Return, per node, the streams on which the memory of its output was allocated.

    A view (or tuple element) lives in the memory of its input, so it
    inherits the input's streams; graph inputs were allocated on the caller's
    stream (0); parameters and buffers are never freed during a call.
    """
    result: dict[fx.Node, frozenset[int]] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            result[n] = frozenset({0})
        elif n.name not in schedule.stream:  # hoisted into the prologue: views of inputs or state
            result[n] = frozenset().union(*(result.get(u, frozenset()) for u in n.all_input_nodes))
        elif n.op in OP_KINDS:
            f = facts(n)
            own = frozenset({schedule.stream[n.name]}) if f.outputs - f.reads else frozenset()
            inherited = frozenset().union(*(result.get(u, frozenset()) for u in n.all_input_nodes
                                            if u.op != "get_attr"))
            result[n] = own | (inherited if f.outputs & f.reads or not f.outputs else frozenset())
        else:
            result[n] = frozenset()
    return result


def generate(graph: fx.Graph, schedule: Schedule, runtime_attr: str,
             prologue: frozenset[str] = frozenset()) -> fx.Graph:
    """Return a new graph computing ``graph`` in ``schedule``'s order on its streams.

    ``prologue`` names ops that launch no kernel and depend on nothing; they
    are emitted first, in program order, before the fork.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in graph.nodes}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") or n.name in prologue:
            env[n] = new.node_copy(n, lambda x: env[x])
    rt = new.get_attr(runtime_attr)
    placeholders = [env[n] for n in graph.nodes if n.op == "placeholder"]
    new.call_method("fork", (rt, *placeholders))

    event_of = {p: i for i, p in enumerate(sorted(schedule.producers(), key=schedule.order.index))}
    waits_into: dict[str, list[str]] = defaultdict(list)
    for w in schedule.waits:
        waits_into[w.consumer].append(w.producer)
    alloc = allocation_streams(graph, schedule)

    current = 0
    for name in schedule.order:
        n = by_name[name]
        stream = schedule.stream[name]
        if stream != current:
            new.call_method("switch", (rt, stream))
            current = stream
        for producer in waits_into[name]:
            new.call_method("wait", (rt, event_of[producer]))
        foreign = [env[u] for u in n.all_input_nodes if alloc[u] - {stream}]
        if foreign:
            new.call_method("keep", (rt, *foreign))
        env[n] = new.node_copy(n, lambda x: env[x])
        if name in event_of:
            new.call_method("record", (rt, event_of[name]))

    output = next(n for n in graph.nodes if n.op == "output")
    results = [env[u] for u in output.all_input_nodes]
    new.call_method("join", (rt, *results))
    new.node_copy(output, lambda x: env[x])
    return new


def event_count(schedule: Schedule) -> int:
    """Return how many events the generated code records."""
    return len(schedule.producers())
