"""Whether a compiled step keeps its graphs' multi-stream programs: decided on the captured step itself.

Each forward and backward graph decides alone, at its first call
(:mod:`concur.dag.decide`). On small networks a graph's gain measured alone
need not survive in the step: a forward measured faster on streams alone
can make the step slower (the measured cases are in experiments/RESULTS.md).
So before ``train_step(compile=True)`` captures a step whose graphs kept
several streams, it times forward, loss and backward captured with every new plan
against the same with inductor's own call in each plan's place. Both come
from the same compile, so nothing compiles twice. The comparison goes
through the one decision point (same margin, one INFO line, the disk cache
under a key of the graphs' own keys), and if the step is not faster by the
margin every plan is dropped for inductor's call, which is what
``torch.compile`` alone runs.

Forward and backward only: the update is the same in both programs, and
timing it would step the optimizer. What timing changes (BatchNorm
statistics, the generators) the caller's snapshot puts back. Not under
several distributed ranks: the step's backward holds DDP's collectives, and
ranks that decided differently (one reading the cache, one timing) would
replay them unmatched; there each graph's own decision stands.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch

from concur.dag import decide
from concur.dag.disk_cache import JsonCache
from concur.inductor.stream_backend import ConcurBackend
from concur.training.trial import several_ranks


class ProgramTimer(Protocol):
    """What times the two steps (:class:`concur.training.graph_runner.CudaGraphRunner`; CPU tests fake it)."""

    def can_time(self, device: torch.device) -> bool: ...

    def time_programs(self, one_stream: Callable[[], Any], streams: Callable[[], Any],
                      device: torch.device) -> Sequence[tuple[float, float]]: ...


def decide_step_streams(backend: ConcurBackend, forward_backward: Callable[[], Any], timer: ProgramTimer,
                        device: torch.device, what: str, key_parts: tuple = (),
                        cache: decide.DecisionCache | None = None) -> decide.Decision | None:
    """Time ``forward_backward`` with the plans ``backend`` installed since the last such decision, and without them.

    Returns None where there was nothing to decide (no such plan, timing
    switched off or impossible here, ``measure=False``); else the decision.
    Either way the plans are settled for good: dropped
    (:meth:`ConcurBackend.drop_installed_plans`) if the decision says one
    stream, else kept. The key is the plans' own keys (each holds its
    graph's code, input shapes and dtypes, the device and torch) and
    ``key_parts`` (what the step adds outside the graphs).
    """
    plans = backend.installed_plans()
    if not plans or not backend.options.measure or not timer.can_time(device) or several_ranks():
        backend.keep_installed_plans()
        return None
    keys = [p.key for p in plans]
    key = decide.decision_key("step", *keys, *key_parts) if all(k is not None for k in keys) else None

    def run(on: bool) -> Callable[[], Any]:
        def program() -> Any:
            backend.use_installed_plans(on)
            return forward_backward()
        return program

    try:
        what = f"the forward and backward of {what} ({len(plans)} graph{'s' if len(plans) != 1 else ''} on streams)"
        decision = decide.decide(what, decide.together([p.prediction for p in plans]),
                                 timer=lambda: timer.time_programs(run(False), run(True), device),
                                 cache=cache if cache is not None else JsonCache(), key=key, scope="step")
    finally:
        backend.use_installed_plans(True)
    if decision.keep:
        backend.keep_installed_plans()
    else:
        backend.drop_installed_plans(f"the whole step was not faster on streams: {decision.reason}",
                                     decided_by=f"step {decision.source}")
    return decision
