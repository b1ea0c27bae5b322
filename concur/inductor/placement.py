"""Place an inductor-compiled graph's kernels: decide which program it runs, and install it in place.

Emission (:mod:`concur.inductor.wrapper_emit`) turns one schedule into code,
and knows nothing of timing, caches or the compiled graph. Placement is the
decision around it, kept apart so that emission stays data in, code out; for
one compiled graph, :func:`place_kernels` does four things:

1. read the wrapper (:mod:`concur.inductor.wrapper_parse`), with the joint
   convolution backward calls split where asked
   (:mod:`concur.inductor.wrapper_split`), into the launch DAG;
2. schedule it on each stream count asked for: schedules that coincide are
   one candidate, and each candidate is emitted as a program;
3. choose among the candidates and inductor's own call through
   :func:`concur.dag.decide.choose`, the one decision every route makes:
   predicted, timed now with ``measure``, or timed at the graph's first call
   on its own inputs (:class:`~concur.inductor.first_call.FirstCall`);
4. install the chosen program in the compiled graph's place, keeping
   inductor's own call at hand (:class:`InstalledPlan`) so a decision over
   the whole step can put it back.

A graph left on one stream says why (:attr:`PlacedKernels.one_stream`), and
where barriers (statements concur cannot read) are what serialized a branchy
graph, which one did it (:func:`serializing_barrier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import networkx as nx

import schedulers

from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.cost import Roofline
from concur.inductor.first_call import Deferred, FirstCall, FirstCallTiming, defer
from concur.inductor.backward_split import SplitCall
from concur.inductor.wrapper_build import build_call
from concur.inductor.wrapper_emit import (KernelStreamPlan, check_streams, launch_dag, plan_emission,
                                          written_inputs)
from concur.inductor.wrapper_parse import parse_wrapper
from concur.inductor.wrapper_program import KernelProgram, Statement
from concur.inductor.wrapper_split import split_costs, split_weight_gradient_calls


@dataclass(frozen=True)
class InstalledPlan:
    """An installed multi-stream program, with inductor's own call kept beside it.

    A decision over the whole captured step (:mod:`concur.training.step_streams`)
    times the step with every graph's plan against the step with none, and
    can put a graph back on inductor's call after its own decision kept the
    plan: a small graph's gain measured alone need not survive in the step.
    """

    key: str | None                     # the graph's own decision key (None where nothing is measured)
    prediction: decide.Prediction
    use_streams: Callable[[bool], None]  # True: the multi-stream program runs; False: inductor's own call
    # for a step that does not fit in memory: put the launches on at most k streams (with lean=True every
    # launch that allocates on its own stream, aten's calls, on the caller's: only inductor's kernels, which
    # write buffers made on the caller's stream, go to side streams) and run that program from now on
    # (use_streams(True) included), returning its plan; None, changing nothing, where that schedule uses one
    # stream or is predicted no faster than one (None: the graph cannot be re-placed)
    fewer_streams: Callable[..., KernelStreamPlan | None] | None = None


@dataclass(frozen=True)
class PlacedKernels:
    """What :func:`place_kernels` did: the plan, and whether the compiled graph now runs it."""

    plan: KernelStreamPlan | None
    installed: bool
    num_launches: int = 0
    # why the graph keeps inductor's own call on one stream, when that is a decision (None if installed)
    one_stream: str | None = None
    # the first barrier of a graph its barriers serialized (it would use several streams without them)
    serialized_by: Statement | None = None
    # inductor's reuse lines in what runs: kept as written, or (installed plans only) made fresh allocations
    reuses_kept: int = 0
    reuses_fresh: int = 0
    decision: decide.Decision | None = None  # None where there was nothing to decide, or not yet
    # the decision waits for the graph's first call, which times both programs on its inputs (first_call)
    pending: bool = False
    convolutions_split: int = 0  # joint convolution backward calls split in what runs (installed plans only)
    # installed plans: how to switch back to inductor's call
    installed_plan: InstalledPlan | None = None


def serializing_barrier(program: KernelProgram, dag: nx.DiGraph, streams: int, scheduler: str,
                        min_cost: float) -> Statement | None:
    """Return the first barrier if, without its barriers, the launch DAG would be scheduled on several streams."""
    barriers = [s for s in program.launches if s.kind == "barrier"]
    rest = [v for v in dag if not dag.nodes[v]["barrier"]]
    if not barriers or len(rest) < 2:
        return None
    unbarred = decide.schedule_graph(dag.subgraph(rest).copy(), streams, scheduler, min_cost)
    return barriers[0] if unbarred.num_streams > 1 else None


# Times a compiled graph's own call (one stream) against rewritten ones: (one, [streams, ...]) -> timer.
Measure = Callable[[Callable[[list], Any], Sequence[Callable[[list], Any]]], decide.Timer]


def place_kernels(compiled: Any, node_costs: Mapping[str, tuple[float, dict]], roof: Roofline,
                  streams: int | Sequence[int], scheduler: str, min_predicted_speedup: float = decide.MIN_SPEEDUP,
                  split_reuses: bool = False, *,
                  label: str = "a graph", measure: Measure | None = None, cache: decide.DecisionCache | None = None,
                  key_parts: tuple = (), first_call: FirstCallTiming | None = None,
                  on_decided: Callable[[PlacedKernels], None] | None = None,
                  weight_grad_split: Mapping[str, SplitCall] | None = None,
                  allocate_on_caller: bool = False) -> PlacedKernels:
    """Put the launches of an inductor-compiled graph on up to ``streams`` streams, in place.

    The graph keeps running inductor's own call when it has fewer than two
    launches, or when :func:`concur.dag.decide.decide` drops its plan: the
    schedule uses one stream, it predicts less than
    ``min_predicted_speedup`` (kernels sharing the device), or, with
    ``measure``, inductor's own call measured at least as fast as the
    rewritten one. The result says why (``one_stream``), and names the
    barrier when barriers are what put a branchy graph on one stream
    (``serialized_by``). A measurement is cached under a key of the
    wrapper's source, the plan and ``key_parts`` (the inputs' shapes and
    dtypes, the device, torch).

    ``streams`` may be several stream counts (``streams="auto"``): each
    gives a schedule, those that coincide count once, and
    :func:`concur.dag.decide.choose` picks among them and one stream, all
    timed in the same rounds; nothing compiles twice.

    With ``first_call`` as well, a plan to be timed (no cached decision) is
    timed on the inputs of the graph's first call instead of inputs made
    for it (:mod:`concur.inductor.first_call`): the graph runs a
    :class:`~concur.inductor.first_call.FirstCall` until then, the result is
    ``pending``, and ``on_decided`` gets what was decided. Where inductor
    does not say which inputs the graph mutates
    (:func:`compat.inductor_mutated_inputs`), ``measure`` times it now.

    With ``split_reuses``, the launches are scheduled as if each renameable
    reuse line were a fresh allocation, and the plan keeps the reuses its
    schedule orders anyway (:func:`~concur.inductor.wrapper_emit.kept_reuses`).

    With ``weight_grad_split`` (a backward's joint convolution backward
    calls, :func:`concur.inductor.backward_split.split_calls`), the program put
    on streams has them split (:mod:`concur.inductor.wrapper_split`), while
    the one-stream program it is weighed against stays inductor's own.

    With ``allocate_on_caller``, each program makes the buffers a side
    stream touches first on the caller's stream
    (:func:`~concur.inductor.wrapper_emit.caller_allocations`), so that
    their memory comes from, and goes back to, one stream's pool.

    Raises:
        ValueError: the wrapper cannot be read or the plan is invalid; ``compiled`` is then unchanged.
    """
    source, namespace, bound_to, replace = compat.inductor_wrapper(compiled)
    source, split = split_weight_gradient_calls(source, weight_grad_split or {})
    node_costs = split_costs(node_costs, split)
    program = parse_wrapper(source, namespace, split_reuses)
    launches = len(program.launches)
    added = sum(1 + s.copy_input for s in split)  # launches the split adds to inductor's own call
    as_written = program.reuse_lines  # inductor's own call keeps every reuse
    if launches < 2:  # nothing is reordered, so nothing needs reading further
        return PlacedKernels(None, False, launches, f"{launches} kernel launch{'es' if launches != 1 else ''}: "
                                                    "nothing to put on streams", reuses_kept=as_written)
    check_streams(program)
    dag = launch_dag(program, node_costs, roof.kernel_overhead_us)
    min_cost = decide.MIN_CLUSTER_LAUNCHES * roof.kernel_overhead_us
    counts = decide.stream_counts(streams)
    schedules = decide.distinct_schedules(dag, counts, scheduler, min_cost)
    for schedule in schedules:
        problems = schedulers.validate(dag, schedule)
        if problems:
            raise ValueError(f"invalid launch schedule (a concur bug, please report it): {problems[:3]}")
    candidates = [s for s in schedules if s.num_streams > 1]
    if not candidates:
        plan = plan_emission(program, schedules[0], dag, allocate_on_caller=allocate_on_caller)
        return PlacedKernels(plan, False, launches - added, "the schedule uses one stream",
                             serializing_barrier(program, dag, max(counts), scheduler, min_cost), as_written)
    plans = [plan_emission(program, schedule, dag, allocate_on_caller=allocate_on_caller) for schedule in candidates]
    built: dict[int, Callable] = {}

    def rewritten(i: int) -> Callable:  # built only where something is timed or installed
        if i not in built:
            built[i] = build_call(program, plans[i], namespace, bound_to)[0]
        return built[i]

    def placed(decision: decide.Decision, own: Callable | None = None) -> PlacedKernels:
        plan = plans[decision.candidate]
        if not decision.keep:  # inductor's own call runs, its convolution backward calls joint
            return PlacedKernels(plan, False, launches - added, decision.reason, reuses_kept=as_written,
                                 decision=decision)
        running = [rewritten(decision.candidate)]  # the program use_streams(True) runs: fewer_streams changes it

        def fewer_streams(k: int, lean: bool = False) -> KernelStreamPlan | None:
            if lean and not allocate_on_caller:  # inductor's kernels' buffers would be made on the side streams
                return None
            schedule = decide.schedule_graph(dag, k, scheduler, min_cost)
            if lean:
                schedule = schedulers.on_caller(dag, schedule, (s.index for s in program.launches if s.allocates))
            if schedule.num_streams < 2 or decide.predict(dag, schedule).speedup < min_predicted_speedup:
                return None
            fewer = plan_emission(program, schedule, dag, allocate_on_caller=allocate_on_caller)
            running[0] = build_call(program, fewer, namespace, bound_to)[0]
            replace(running[0])
            return fewer

        switch = None if own is None else InstalledPlan(key, decision.prediction,
                                                        lambda on: replace(running[0] if on else own), fewer_streams)
        return PlacedKernels(plan, True, launches, reuses_kept=plan.reuses_kept, reuses_fresh=plan.reuses_fresh,
                             decision=decision, convolutions_split=len(split), installed_plan=switch)

    # one plan's key is the key it always had, so its cached decisions stay valid
    plans_in_key = [x for s in candidates for x in (s.order, sorted(s.stream.items(), key=repr))]
    key = decide.decision_key("wrapper", source, *plans_in_key, *key_parts) if measure is not None else None
    predictions = [decide.predict(dag, schedule) for schedule in candidates]
    timed = decide.timed_candidates(predictions, min_predicted_speedup)

    def decided(timer: decide.Timer | None) -> decide.Decision:
        return decide.choose(f"{label} ({launches} launches)", predictions, min_speedup=min_predicted_speedup,
                             timer=timer, cache=cache, key=key)

    mutated = compat.inductor_mutated_inputs(compiled) if measure is not None and first_call is not None else None
    if mutated is None:
        decision = decided((lambda: measure(compiled, [rewritten(i) for i in timed])())
                           if measure is not None else None)
    else:
        try:
            decision = decided(defer)  # a cached decision, or none worth timing, is made now
        except Deferred:
            own = compat.inductor_generated_call(compiled)

            def settle(timer: decide.Timer) -> Callable[[list], Any]:
                decision = decided(timer)
                call = rewritten(decision.candidate) if decision.keep else own
                replace(call)
                if on_decided is not None:
                    on_decided(placed(decision, own))
                return call

            replace(FirstCall(own, [rewritten(i) for i in timed], settle, first_call, mutated,
                              written_inputs(program), len(program.inputs)))
            return PlacedKernels(plans[timed[0]], False, launches - added, "not decided yet: the graph's first "
                                 "call times both programs on its inputs", reuses_kept=as_written, pending=True)
    # inductor's own call at hand: a measured decision can be revisited over the whole step, and a step that does
    # not fit in memory switches plans off (ConcurBackend.narrow_plans)
    try:
        own = compat.inductor_generated_call(compiled)
    except ValueError:
        if measure is not None:
            raise
        own = None  # only narrowing needs it here: a graph whose call is not found keeps its plan
    if decision.keep:
        replace(rewritten(decision.candidate))
    return placed(decision, own)
