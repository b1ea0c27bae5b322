"""concur.fx.codegen on a diamond: the generated forward issues the schedule's order, switches, records and waits."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import schedulers
from concur.fx.codegen import allocation_streams, event_count, generate
from concur.fx.plan import analyse


class Diamond(nn.Module):
    """stem -> (left, right) -> cat: the two branches can run side by side."""

    def __init__(self):
        super().__init__()
        self.stem, self.left, self.right = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a = self.stem(x)
        return torch.cat([self.left(a), self.right(a).view_as(a)], dim=1)


def _diamond_on_two_streams():
    torch.manual_seed(0)
    model, x = Diamond(), torch.randn(2, 3, 8, 8)
    traced, dag = analyse(model, (x,))
    # left on a side stream, everything else on the caller's; issue order: stem, left, right, view, cat
    order = ["stem", "left", "right", "view_as", "cat"]
    stream = {"stem": 0, "left": 1, "right": 0, "view_as": 0, "cat": 0}
    schedule = schedulers.build_schedule(dag, order, stream, "hand")
    return model, x, traced, schedule


def _calls(graph: fx.Graph) -> list[str]:
    """The generated forward as a list: 'fork', 'switch 1', 'wait 0', 'record 0', op names, 'join'."""
    out = []
    for n in graph.nodes:
        if n.op == "call_method" and n.target in ("fork", "switch", "record", "wait", "keep", "join"):
            ints = [a for a in n.args[1:] if isinstance(a, int)]
            kept = [a.name for a in n.args[1:] if isinstance(a, fx.Node)] if n.target in ("keep", "join") else []
            out.append(" ".join([n.target, *map(str, ints), *kept]))
        elif n.op in ("call_module", "call_function", "call_method"):
            out.append(n.name)
    return out


def test_the_generated_forward_follows_the_schedule_with_one_event_per_cross_stream_edge():
    _, _, traced, schedule = _diamond_on_two_streams()
    assert [(w.producer, w.consumer) for w in schedule.waits] == [("stem", "left"), ("left", "cat")]
    graph = generate(traced.graph, schedule, "_rt")
    assert _calls(graph) == [
        "fork",
        "stem", "record 0",                             # stem's output is needed on stream 1
        "switch 1", "wait 0", "keep stem", "left", "record 1",  # stem was allocated on stream 0
        "switch 0", "right", "view_as",
        "wait 1", "keep left", "cat",                   # left's output was allocated on stream 1
        "join cat",
    ]
    assert event_count(schedule) == 2


def test_a_serial_schedule_generates_no_switches_waits_or_events():
    _, _, traced, _ = _diamond_on_two_streams()
    _, dag = analyse(Diamond(), (torch.randn(2, 3, 8, 8),))
    serial = schedulers.schedule(dag, 1, "serial")
    calls = _calls(generate(traced.graph, serial, "_rt"))
    assert calls[0] == "fork" and calls[-1] == "join cat"
    assert not [c for c in calls if c.split()[0] in ("switch", "wait", "record", "keep")]
    assert event_count(serial) == 0


def test_views_live_on_the_stream_their_base_was_allocated_on():
    _, _, traced, schedule = _diamond_on_two_streams()
    alloc = {n.name: streams for n, streams in allocation_streams(traced.graph, schedule).items()}
    assert alloc["x"] == {0} and alloc["left"] == {1} and alloc["right"] == {0}
    assert alloc["view_as"] == {0}  # a view of right's output: no memory of its own


def test_the_generated_module_computes_what_the_model_does():
    model, x, traced, schedule = _diamond_on_two_streams()
    from concur.streams import StreamRuntime

    traced._rt = StreamRuntime(schedule.num_streams, event_count(schedule))
    generated = fx.GraphModule(traced, generate(traced.graph, schedule, "_rt"))
    torch.testing.assert_close(generated(x), model(x), rtol=0, atol=0)
