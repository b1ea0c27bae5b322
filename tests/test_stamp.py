"""concur.inductor.stamp: concur's schedule stamped on post-grad aten graphs, for inductor's own streams.

All on CPU (torch >= 2.13): the stamps, the syncs checked against an
independent happens-before oracle on the fx graph, the order inductor's CPU
wrapper gives them, training through ``torch.compile`` against eager, and
the FX graph cache. Nothing here runs an event or a stream: CPU has neither,
and no GPU test exists for this route (the H100 machine has torch 2.11).
"""

from __future__ import annotations

import importlib
import re
import warnings

import networkx as nx
import pytest
import torch
import torch.fx as fx

import concur
from concur import _torch_compat as compat
from concur.dag.cost import ROOFLINES
from concur.inductor import stamp as istreams
from concur.inductor.aten_dag import build_aten_dag

backend_module = importlib.import_module("concur.inductor.stream_backend")

pytestmark = [pytest.mark.inductor,  # compiles through inductor: CI runs it as its own tier
              pytest.mark.skipif(not compat.has_inductor_node_streams(),
                                 reason="inductor node streams need torch >= 2.13")]

CPU = ROOFLINES["cpu"]  # slow enough that three 256x256 matmuls are worth three streams


def fork_join(x, w1, w2, w3):
    a = torch.relu(x @ w1)
    b = torch.sigmoid(x @ w2)
    c = torch.tanh(x @ w3)
    return ((a + b) * c,)


def fork_join_graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    from torch.fx.experimental.proxy_tensor import make_fx

    args = [torch.randn(256, 256) for _ in range(4)]
    return make_fx(fork_join, tracing_mode="fake")(*args), args


def fork_and_output(x, w1, w2, w3):
    """Like fork_join, and a branch whose value only leaves the graph: only the join orders it."""
    return (torch.relu(x @ w1) + torch.sigmoid(x @ w2), torch.tanh(x @ w3))


def options(**kw) -> istreams.StreamOptions:
    return istreams.StreamOptions(**{"streams": 3, "roofline": CPU, "stamp_cpu": True, **kw})


def stream_of(n: fx.Node) -> int | None:
    return n.meta.get("custom", {}).get("stream")


class Branchy(torch.nn.Module):
    """Three branches, one with BatchNorm (running stats are mutated inputs) and dropout (random)."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(width, width) for _ in range(3))
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x):
        return (torch.relu(self.a(x)) + torch.sigmoid(self.b(x))) * torch.tanh(self.bn(self.c(x)))


# -- the stamped graph ------------------------------------------------------------------------------


def test_independent_branches_get_different_streams_and_stamps_name_table_slots():
    gm, _ = fork_join_graph()
    result = istreams.stamp_graph(gm, options(syncs=False))
    assert result.reason is None and result.num_streams == 3
    nodes = {n.name: n for n in gm.graph.nodes}
    assert set(result.stream_of) == {n.name for n in gm.graph.nodes if n.op == "call_function"}
    branches = {result.stream_of[mm] for mm in ("mm", "mm_1", "mm_2")}
    assert branches == {0, 1, 2}
    for name, s in result.stream_of.items():  # stream 0 is the caller's: no stamp; others: a table slot
        expected = None if s == 0 else istreams.stream_slot(0, False, s)
        assert stream_of(nodes[name]) == expected
    # each pointwise op stays with the matmul it reads
    for mm, pw in (("mm", "relu"), ("mm_1", "sigmoid"), ("mm_2", "tanh")):
        assert result.stream_of[pw] == result.stream_of[mm]


def test_forward_and_backward_graphs_use_different_side_streams():
    gm_f, _ = fork_join_graph()
    gm_b, _ = fork_join_graph()
    istreams.stamp_graph(gm_f, options(syncs=False), backward=False)
    istreams.stamp_graph(gm_b, options(syncs=False), backward=True)
    side_f = {stream_of(n) for n in gm_f.graph.nodes} - {None}
    side_b = {stream_of(n) for n in gm_b.graph.nodes} - {None}
    assert side_f and side_b and not side_f & side_b


def test_ops_without_arithmetic_follow_their_producer():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, w2):
        var, mean = torch.var_mean(x @ w1, dim=0)       # a two-output op: getitems
        y = (x @ w2).t()                                # a view of a matmul
        return (var + mean, y.sum(0))

    args = [torch.randn(256, 256) for _ in range(3)]
    gm = make_fx(f, tracing_mode="fake")(*args)
    result = istreams.stamp_graph(gm, options(syncs=False))
    assert result.num_streams > 1
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is __import__("operator").getitem or n.target is torch.ops.aten.t.default:
            assert result.stream_of[n.name] == result.stream_of[n.args[0].name], n.name


def test_cpu_graphs_are_left_alone_unless_asked():
    gm, _ = fork_join_graph()
    result = istreams.stamp_graph(gm, options(stamp_cpu=False))
    assert result.num_streams == 1 and "no streams" in result.reason
    assert all(stream_of(n) is None for n in gm.graph.nodes)


def test_graph_with_user_streams_is_left_alone():
    gm, _ = fork_join_graph()
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    first.meta["custom"] = {"stream": 7}
    result = istreams.stamp_graph(gm, options())
    assert result.num_streams == 1 and "already has a stream" in result.reason
    assert sum(stream_of(n) is not None for n in gm.graph.nodes) == 1


# -- the syncs, against an independent happens-before oracle ---------------------------------------


def _sync_op(gm: fx.GraphModule, n: fx.Node) -> tuple[str, int, int] | None:
    """Return ("record"|"wait", event, stream slot) for a control_deps node wrapping an event op."""
    ops = compat.inductor_stream_ops()
    if n.op != "call_function" or n.target is not ops.control_deps:
        return None
    sub = getattr(gm, n.args[1].target)
    (op,) = [m for m in sub.graph.nodes if m.op == "call_function"]
    kind = {ops.record_event: "record", ops.wait_event: "wait"}[op.target]
    return kind, op.args[0], op.args[1]


def check_synced(gm: fx.GraphModule, edges: list[tuple[str, str]], stream: dict[str, int],
                 backward: bool = False) -> None:
    """Assert that inductor must order each cross-stream edge u -> v through an event.

    Inductor orders a node after every fx node it takes as an argument
    (``control_deps`` takes its extra dependencies as one), so a path in the fx
    graph is an order it keeps. For each edge on two streams there must be a
    record on u's stream after u and a wait on v's stream, on the same event,
    after the record and before v.
    """
    hb = nx.DiGraph()
    for n in gm.graph.nodes:
        hb.add_node(n)
        for a in n.all_input_nodes:
            hb.add_edge(a, n)
    nodes = {n.name: n for n in gm.graph.nodes}
    syncs = {n: _sync_op(gm, n) for n in gm.graph.nodes}
    syncs = {n: s for n, s in syncs.items() if s is not None}
    slot = lambda s: istreams.stream_slot(0, backward, s)  # noqa: E731
    for u_name, v_name in edges:
        su, sv = stream.get(u_name, 0), stream.get(v_name, 0)
        if su == sv:
            continue
        u, v = nodes[u_name], nodes[v_name]
        ok = any(kind == "wait" and st == slot(sv) and nx.has_path(hb, w, v)
                 and any(k2 == "record" and e2 == event and s2 == slot(su) and nx.has_path(hb, u, r)
                         and nx.has_path(hb, r, w) for r, (k2, e2, s2) in syncs.items())
                 for w, (kind, event, st) in syncs.items())
        assert ok, f"{u_name} (stream {su}) -> {v_name} (stream {sv}) is not ordered by an event"
    # join: every op on a side stream is before a record there that the caller's stream waits on
    waits_on_caller = [w for w, (k, _, st) in syncs.items() if k == "wait" and st == slot(0)]
    for name, s in stream.items():
        if s == 0:
            continue
        assert any(nx.has_path(hb, nodes[name], w) for w in waits_on_caller), f"{name} is not joined"


def test_every_cross_stream_edge_of_a_training_graph_waits_on_an_event():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    model, x = Branchy(), torch.randn(32, 128)
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture,
                                                   decompositions=select_decomp_table()))
    fn(x).sum().backward()
    assert len(graphs) == 2
    for backward, gm in enumerate(graphs):
        dag = build_aten_dag(gm.graph, CPU)
        edges = list(dag.edges)
        inputs_read = [(n.name, u.name) for n in gm.graph.nodes if n.op == "call_function"
                       for u in n.all_input_nodes if u.op == "placeholder"]
        result = istreams.stamp_graph(gm, options(syncs=True), backward=bool(backward))
        assert result.num_streams > 1 and result.num_waits > 0, result
        check_synced(gm, edges, result.stream_of, bool(backward))
        # side streams read graph inputs only after the fork: a wait on the caller's event
        for v_name, _ in inputs_read:
            if result.stream_of[v_name] == 0:
                continue
            v = next(n for n in gm.graph.nodes if n.name == v_name)
            assert all(a.op != "placeholder" for a in v.all_input_nodes), f"{v_name} reads an input unsynced"
        gm.graph.lint()


def test_a_branch_that_only_leaves_the_graph_is_joined_and_a_joined_one_is_not():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fork_and_output, tracing_mode="fake")(*[torch.randn(256, 256) for _ in range(4)])
    edges = list(build_aten_dag(gm.graph, CPU).edges)
    result = istreams.stamp_graph(gm, options(syncs=True))
    s = result.stream_of
    assert len({s["mm"], s["mm_1"], s["mm_2"]}) == 3 and s["tanh"] != 0
    check_synced(gm, edges, s)
    caller = istreams.stream_slot(0, False, 0)
    syncs = [op for n in gm.graph.nodes if (op := _sync_op(gm, n)) is not None]
    # waits on the caller's stream: one for the branch stream 0 reads, one join for the output branch
    assert sum(kind == "wait" and st == caller for kind, _, st in syncs) == 2


def test_values_read_on_another_stream_are_recorded_for_the_allocator():
    gm, _ = fork_join_graph()
    result = istreams.stamp_graph(gm, options(syncs=True))
    ops = compat.inductor_stream_ops()
    recorded = {(n.args[0].name, n.args[1]) for n in gm.graph.nodes if n.target is ops.record_stream}
    slot = lambda s: istreams.stream_slot(0, False, s)  # noqa: E731
    s = result.stream_of
    for producer, consumer in (("sigmoid", "add"), ("tanh", "mul")):
        assert s[producer] != s[consumer]
        assert (producer, slot(s[consumer])) in recorded
    # graph inputs read on side streams too (their allocation stream is unknown)
    assert ("x_1", slot(s["mm_1"])) in recorded and ("w2_1", slot(s["mm_1"])) in recorded
    assert result.num_record_streams == len(recorded)


# -- what inductor generates from it (CPU) ---------------------------------------------------------


def _call_body(source: str) -> list[str]:
    start = source.index("def call(")
    end = source.index("return (", start)
    return source[start:end].splitlines()


STREAM_NAMES = {"default_stream": 0, "stream1": 1, "stream2": 2}


def check_wrapper(source: str, kernel: str) -> dict[int, int]:
    """Check the stream contexts and events of a generated ``call``; return {line of a ``kernel``: stream}.

    Each event is recorded before any wait on it, and every side stream's last
    kernel is followed by a record there that the caller's stream waits on.
    """
    lines = _call_body(source)
    context, kernels, records, waits = None, {}, [], []
    for i, line in enumerate(lines):
        m = re.match(r"\s*with (default_stream|stream\d+):", line)
        if m:
            context = STREAM_NAMES[m.group(1)]
        if kernel in line:
            kernels[i] = context
        m = re.search(r"streams\.(record_event|wait_event)\.default\((\d+), (\d+)\)", line)
        if m:
            (records if m.group(1) == "record_event" else waits).append((i, int(m.group(2)), int(m.group(3))))
    assert waits and {e for _, e, _ in waits} == {e for _, e, _ in records}
    for i, event, _ in waits:
        assert any(j < i for j, e, _ in records if e == event), f"event {event} waited on before it is recorded"
    caller = istreams.stream_slot(0, False, 0)
    for side in set(kernels.values()) - {0}:
        last = max(i for i, s in kernels.items() if s == side)
        assert any(j > last and st == istreams.stream_slot(0, False, side)
                   and any(w > j and e2 == e and st2 == caller for w, e2, st2 in waits)
                   for j, e, st in records), f"stream {side} is not joined after its last kernel"
    return kernels


def test_inductor_cpu_wrapper_keeps_stream_contexts_and_event_order():
    """Inductor's CPU wrapper enters `with streamN:` per stamped node and keeps each record before its wait.

    It does not define the stream names there (only a device guard does, on
    GPUs), and CPU cannot run the event ops: the code is read, not run.
    """
    from torch._inductor import config
    from torch.fx.experimental.proxy_tensor import make_fx

    args = [torch.randn(256, 256) for _ in range(4)]
    gm = make_fx(fork_and_output, tracing_mode="fake")(*args)
    with config.patch(fx_graph_cache=False):
        done = istreams.compile_stamped(gm, args, options(syncs=True), is_backward=False)
    assert done.result.num_waits > 0
    mm_stream = check_wrapper(done.compiled.source_code, "extern_kernels.mm(")
    assert sorted(mm_stream.values()) == [0, 1, 2]  # one matmul per stream
    assert "stream1 = " not in done.compiled.source_code  # CPU codegen never defines the names it enters
    # the schedule's issue order: all three branches start before the kernel that adds two of them
    lines = _call_body(done.compiled.source_code)
    two_input_kernels = [i for i, line in enumerate(lines) if "cpp_fused" in line and line.count(",") >= 1]
    assert len(two_input_kernels) == 1 and max(mm_stream) < two_input_kernels[0]


CUDA_CODEGEN = """
import sys, types
import torch
# No GPU here: inductor asks the device for its properties and for Triton. These answers let it
# *generate* the CUDA wrapper of a graph of extern kernels; nothing is compiled or run on a device.
props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                              total_memory=80 * 2**30, warp_size=32, max_threads_per_multi_processor=2048,
                              regs_per_multiprocessor=65536, max_threads_per_block=1024,
                              shared_memory_per_block_optin=232448, L2_cache_size=50 * 2**20,
                              clock_rate=1980000, gcnArchName="")
torch.cuda.get_device_properties = lambda *a, **k: props
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.current_device = lambda: 0
torch.cuda.device_count = lambda: 1
torch.cuda._lazy_init = lambda: None
torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
torch.cuda.set_rng_state = lambda *a, **k: None
import torch._inductor.scheduler
torch._inductor.scheduler.has_triton = lambda: True
from torch._guards import TracingContext, tracing
from torch._inductor import config
from torch._inductor.compile_fx import compile_fx_inner
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from concur.inductor import stamp as istreams
from concur.dag.cost import ROOFLINES

def mms(x, w1, w2, w3):
    return (x @ w1, x @ w2, x @ w3)

mode = FakeTensorMode()
with mode:
    args = [torch.empty(1024, 1024, device="cuda") for _ in range(4)]
gm = make_fx(mms)(*args)
stamp = istreams.make_stamp_pass(istreams.StreamOptions(streams=3, roofline=ROOFLINES["cpu"]))
with config.patch(fx_graph_cache=False), istreams.compat.post_grad_custom_post_pass(stamp), \
        tracing(TracingContext(mode)), mode:
    compiled = compile_fx_inner(gm, args)
assert stamp.results[0].num_waits > 0, stamp.results
sys.stdout.write(compiled.source_code)
"""


def test_inductor_cuda_wrapper_generated_without_a_gpu_fetches_streams_and_orders_events(tmp_path):
    """The CUDA wrapper inductor generates (not runs) for a stamped graph: streams from the table, events in order.

    In a subprocess, since it fakes the CUDA device's properties and Triton
    for inductor. The graph has only extern matmuls (no Triton kernel to
    compile) and the events the pass inserts by itself (``syncs=None``: CUDA).
    """
    import subprocess
    import sys

    script = tmp_path / "cuda_codegen.py"
    script.write_text(CUDA_CODEGEN)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    source = run.stdout
    for s in (1, 2):  # the side streams come from dynamo's table (2.13 reads it directly), at concur's slots
        fetch = rf"stream{s} = (_get_stream_by_index|get_external_object_by_index)\({istreams.stream_slot(0, False, s)}\)"
        assert re.search(fetch, source), fetch
    assert "default_stream = torch.cuda.current_stream()" in source
    mm_stream = check_wrapper(source, "extern_kernels.mm(")
    assert sorted(mm_stream.values()) == [0, 1, 2]


def test_stamped_graph_hits_inductor_fx_graph_cache_and_keys_on_the_options(monkeypatch):
    """A stamped graph is cached like any other (the pass has a uuid), under a key that holds the options."""
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.utils import fresh_cache

    monkeypatch.setattr(istreams, "STAMP_CPU", True)
    model, x = Branchy().eval(), torch.randn(32, 128)

    def compile_once(streams):
        torch._dynamo.reset()
        be = concur.backend(streams=streams, roofline=CPU, route="inductor_streams")
        with config.patch(fx_graph_cache=True, force_disable_caches=False), torch.no_grad():
            out = torch.compile(model, backend=be)(x)
        (graph,) = be.graphs
        return out, graph

    counters.clear()
    with fresh_cache():
        first, miss = compile_once(3)
        again, hit = compile_once(3)
        _, other = compile_once(2)
    assert miss.num_streams == 3 and miss.one_stream_reason is None
    assert "cache had the stamped graph" in hit.one_stream_reason  # the pass did not run: a hit
    assert other.num_streams == 2                                  # other options, another key
    assert counters["inductor"]["fxgraph_cache_hit"] == 1 and counters["inductor"]["fxgraph_cache_bypass"] == 0
    torch.testing.assert_close(again, first)


def test_pass_uuid_is_stable_and_names_the_options():
    a = istreams.make_stamp_pass(options()).uuid()
    assert a == istreams.make_stamp_pass(options()).uuid()
    assert a != istreams.make_stamp_pass(options(streams=2)).uuid()
    assert a != istreams.make_stamp_pass(options(), backward=True).uuid()
    assert a != istreams.make_stamp_pass(options(scheduler="fork")).uuid()


# -- dynamo's table of user objects ---------------------------------------------------------------


def test_table_entries_come_back_after_dynamo_clears_or_replaces_the_table():
    from torch._dynamo import graph_bytecode_inputs

    call = istreams.StreamTableCall(lambda args: list(args), torch.device("cpu"), 3)
    objects = call.objects
    slot = istreams.stream_slot(0, True, 2)
    with objects.table.installed():
        assert compat.external_object_table()[slot]() is objects.streams[(True, 2)]
    graph_bytecode_inputs.store_user_object_weakrefs(object.__new__(type("Obj", (), {})))  # a frame's objects
    table = compat.external_object_table()
    assert slot not in table if isinstance(table, dict) else len(table) == 1
    with objects.table.installed():
        table = compat.external_object_table()
        assert table[slot]() is objects.streams[(True, 2)]
        assert table[istreams.event_slot(0, 5)]() is objects.events[5]


def test_each_call_puts_the_objects_back_and_points_the_caller_slot_at_the_current_stream(monkeypatch):
    """What a compiled graph's code looks up in the table while it runs: concur's objects, the current stream."""
    from torch._dynamo import graph_bytecode_inputs

    device = torch.device("cpu")
    current = torch.Stream(device=device)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda d=None: current)
    seen = {}

    def compiled(args):  # stands in for inductor's call: it reads the slots its code names, as dynamo does
        seen["caller"] = graph_bytecode_inputs.get_external_object_by_index(istreams.stream_slot(0, False, 0))
        seen["side"] = graph_bytecode_inputs.get_external_object_by_index(istreams.stream_slot(0, True, 1))
        seen["event"] = graph_bytecode_inputs.get_external_object_by_index(istreams.event_slot(0, 3))
        return [a * 2 for a in args]

    call = istreams.StreamTableCall(compiled, device, 2)
    graph_bytecode_inputs.store_user_object_weakrefs(current)  # a frame with user streams ran: table cleared
    assert call([1, 2]) == [2, 4] and call._boxed_call
    assert seen["caller"] is current
    assert seen["side"] is call.objects.streams[(True, 1)]
    assert seen["event"] is call.objects.events[3]
    assert call.objects is istreams.StreamTableCall(compiled, device, 2).objects  # one set per device
    table = compat.external_object_table()
    if isinstance(table, list):  # torch >= 2.15: out again after the call, for AOTAutograd's snapshot
        assert len(table) == 1 and table[0]() is current


def test_a_list_table_holds_concurs_objects_only_during_the_call_so_a_backward_restores_dynamos_alone():
    """torch 2.15 snapshots the list after a forward and writes it back before the backward, index by index."""
    from torch._dynamo import graph_bytecode_inputs

    if not isinstance(compat.external_object_table(), list):
        pytest.skip("torch < 2.15: dynamo's table is a dict, where concur's objects stay")
    objects = compat.ExternalObjects()
    stream = torch.Stream(device="cpu")
    objects.add(istreams.TABLE_BASE + 7, stream)
    dynamos = torch.Stream(device="cpu")
    graph_bytecode_inputs.store_user_object_weakrefs(dynamos)
    with objects.installed():
        assert graph_bytecode_inputs.get_external_object_by_index(istreams.TABLE_BASE + 7) is stream
        with pytest.raises(AssertionError, match="no longer alive"):  # the padding is dead, never a wrong object
            graph_bytecode_inputs.get_external_object_by_index(istreams.TABLE_BASE + 6)
    assert [ref() for ref in compat.external_object_table()] == [dynamos]
    graph_bytecode_inputs.set_external_object_by_index(1, stream)  # a backward's restore of a snapshot: fine
    graph_bytecode_inputs.store_user_object_weakrefs(*[dynamos] * (istreams.TABLE_BASE + 8))  # up to ours
    with pytest.raises(RuntimeError, match="reaching concur's"), objects.installed():
        pass


# -- training through the backend -----------------------------------------------------------------


def _train_once(model: torch.nn.Module, x: torch.Tensor, be) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from torch._inductor import config

    with config.patch(fx_graph_cache=False):
        out = torch.compile(model, backend=be)(x)
        out.sum().backward()
    return out, [p.grad for p in model.parameters()]


def test_training_through_stamped_graphs_equals_eager(monkeypatch):
    """Stamped forward and backward (no events on CPU) give eager's values, grads and running stats."""
    monkeypatch.setattr(istreams, "STAMP_CPU", True)
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(32, 128)
    eager = Branchy()
    eager.load_state_dict(model.state_dict())
    be = concur.backend(streams=3, roofline=CPU, route="inductor_streams")
    out, grads = _train_once(model, x, be)
    ref = eager(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, eager.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    assert [g.is_backward for g in be.graphs] == [False, True]
    assert all(g.num_streams > 1 and g.fallback_reason is None for g in be.graphs), be.graphs


def test_route_without_inductor_streams_uses_the_wrapper_route_with_a_warning(monkeypatch):
    monkeypatch.setattr(compat, "has_inductor_node_streams", lambda: False)
    called = []
    monkeypatch.setattr(backend_module.ConcurBackend, "_compile_stamped",
                        lambda *a, **k: called.append(a))
    be = concur.backend(streams=2, roofline=CPU, route="inductor_streams")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(torch.nn.Linear(8, 8), backend=be)(torch.randn(4, 8))
    assert not called
    assert any("route='inductor_streams' needs" in str(w.message) for w in caught)


def test_unknown_route_is_refused():
    with pytest.raises(ValueError, match="route must be one of"):
        concur.backend(route="segments")


def test_torch_before_2_13_has_no_inductor_node_streams(monkeypatch):
    monkeypatch.setattr(compat, "torch_version", lambda: (2, 11))
    assert not compat.has_inductor_node_streams()
    with pytest.raises(RuntimeError, match="needs torch >= 2.13"):
        compat.inductor_stream_ops()


def test_several_stream_counts_are_chosen_among_by_the_prediction():
    """streams="auto" on the stamped route: the prediction chooses among the counts, the fewest streams within 3%
    of the best (on the CPU roofline the fork-join predicts 2 streams as well as 3), not the most."""
    from concur.dag import decide
    from concur.inductor.aten_dag import build_aten_dag

    ref, _ = fork_join_graph()
    dag = build_aten_dag(ref.graph, CPU)
    cost = decide.MIN_CLUSTER_LAUNCHES * CPU.kernel_overhead_us
    predictions = [decide.predict(dag, decide.schedule_graph(dag, k, "critical_path", cost)) for k in (2, 3, 4)]
    expected = decide.choose("the fork-join", predictions).num_streams
    gm, _ = fork_join_graph()
    result = istreams.stamp_graph(gm, options(syncs=False, streams=(2, 3, 4)))
    assert result.reason is None and result.num_streams == expected == 2, (result, predictions)
    most, _ = fork_join_graph()
    assert istreams.stamp_graph(most, options(syncs=False, streams=4)).num_streams == 3
