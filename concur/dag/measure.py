"""Time a one-stream and a multi-stream program against each other on a GPU, for :mod:`concur.dag.decide`.

Both programs are captured in CUDA graphs, as the training step runs them
(``train_step`` replays one graph per step), so the host's launch cost, which
a graph replay does not pay, takes no part. Their replays then alternate:
round ``r`` times a block of replays of each, the first program first in
even rounds and second in odd ones, so a clock or temperature drift falls on
both alike. Each round gives one time per program (ms per replay); the
decision takes the medians.

What runs here must not change what the user sees: the programs run on
inputs made for the purpose (:func:`real_inputs`, :func:`boxed_timer`), or
on the caller's own inputs with the ones they write put back
(:func:`boxed_rounds`), or the caller restores its state around them (the
fx path); the random number generators are put back as they were
(:func:`rng_kept`), and nothing runs while a CUDA graph is being captured
(:func:`can_time`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from concur import _torch_compat as compat
from concur.dag import decide
from concur.dag.decide import Timer
from concur.dag.nvml import other_processes_on
from concur.errors import exception_chain

ROUNDS = 7     # at most this many rounds of alternating replays; the decision takes their median
REPLAYS = 5    # at most this many replays of each program per round, timed as one interval
# a round's block of one program lasts about this long: fewer replays for slower programs (at least one), so a
# timing costs about the same at batch 128 as at batch 8; one replay of a CUDA graph varies far less than 1%
BLOCK_MS = 5.0
# calls of each program before capture: one loads its kernels, makes cuBLAS's handle for each stream and runs
# inductor's autotuning, which a capture cannot; the times come from replays, which no later call changes
WARMUP = 1
# CONCUR_MEASURE=0 leaves every decision to the prediction, as on a machine without a GPU.
ENVIRONMENT_SWITCH = "CONCUR_MEASURE"
# CONCUR_MEASURE_LOCK=PATH: processes sharing a GPU take turns to time (an exclusive lock on PATH), so that
# one's replays are not timed beside another's kernels, which would skew the ratio, not only the times.
ENVIRONMENT_LOCK = "CONCUR_MEASURE_LOCK"


@contextlib.contextmanager
def gpu_turn() -> Iterator[None]:
    """Hold the exclusive file lock ``$CONCUR_MEASURE_LOCK`` names while timing (nothing where it is unset)."""
    path = os.environ.get(ENVIRONMENT_LOCK)
    if not path:
        yield
        return
    import fcntl  # POSIX only, as CUDA graphs of several streams in practice

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def can_time(device: torch.device | None) -> bool:
    """Return True where programs on ``device`` can be timed now: CUDA, no capture under way, not switched off."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return False
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return not torch.cuda.is_current_stream_capturing()


def environment(device: torch.device) -> tuple[str, str, str | None]:
    """Return what a measured decision depends on besides the program: GPU name, torch and CUDA versions."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name, torch.__version__, torch.version.cuda


def alternating_replays(one_stream: Callable[[], Any], streams: Callable[[], Any], device: torch.device,
                        rounds: int = ROUNDS, replays: int = REPLAYS, warmup: int = WARMUP, *,
                        capture_stream: torch.cuda.Stream | None = None) -> list[tuple[float, float]]:
    """Return, per round, the ms of one replay of ``one_stream`` and of ``streams``: :func:`replay_rounds` of two."""
    return replay_rounds((one_stream, streams), device, rounds, replays, warmup,  # type: ignore[return-value]
                         capture_stream=capture_stream)


def replay_rounds(programs: Sequence[Callable[[], Any]], device: torch.device, rounds: int = ROUNDS,
                  replays: int = REPLAYS, warmup: int = WARMUP, *, capture_stream: torch.cuda.Stream | None = None,
                  settled: Callable[[Sequence[tuple[float, ...]]], bool] | None = decide.settled
                  ) -> list[tuple[float, ...]]:
    """Return, per round, the ms of one replay of each program, each captured in a CUDA graph.

    Every callable runs its program on fixed inputs (a CUDA graph replays
    the same addresses). Round ``r`` times a block of replays of each, in
    the order rotated by ``r`` (two programs: first-second, then
    second-first), so a clock or temperature drift falls on all alike. The
    rounds stop early where ``settled`` says more could not change the
    decision (:func:`concur.dag.decide.settled`): each round costs a
    setup ``replays`` steps per program.

    Warm-up and capture run on one stream that is not the device's default
    stream, as ``torch.cuda.graph`` requires: the caller's own where it is a
    side stream already (``train_step`` sets up on one), else a side stream
    kept per device. Each new stream would cost a cuBLAS workspace (32 MiB
    on an H100) and cached blocks of its own, held for the life of the
    process. A caller may name the ``capture_stream``, or make it the
    default inside a block (:func:`captures_into`).

    The graphs share one memory pool of their own, which is safe because
    they never run at once and nobody reads their outputs; it is given back
    before this returns, graphs freed and the cache emptied, so that no
    timing's memory stays reserved beside what runs next (the rest of
    setup, or the next graph's timing).
    """
    if capture_stream is None and _CAPTURES_INTO:
        capture_stream = _CAPTURES_INTO[-1]
    with torch.cuda.device(device), gpu_turn():
        caller = torch.cuda.current_stream()
        work = caller if caller != torch.cuda.default_stream() else _side_stream(device)
        work.wait_stream(caller)
        with torch.cuda.stream(work):
            for _ in range(warmup):
                for program in programs:
                    program()
        capture_stream = work if capture_stream is None else capture_stream
        failure = None
        try:
            times = _timed_rounds(programs, rounds, replays, capture_stream, settled)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once what it held is given back
            failure = _without_frames(exc)
        if failure is not None:
            # the failed graphs and their tensors lived in the frames of its traceback: with those gone, a
            # capture the driver invalidated is cleaned up now, not at the next capture (after a warm-up that
            # would run beside its pool)
            settle_failed_captures()
        # the graphs are gone (the pool's last users): give its blocks back to the device
        torch.cuda.empty_cache()
        if failure is not None:
            raise failure
        caller.wait_stream(work)
        caller.wait_stream(capture_stream)
        return decide.TimedRounds(times, others_timing_beside(device))


def others_timing_beside(device: torch.device | None) -> int | None:
    """How many other processes had work on ``device`` as it was timed (NVML), warned once; None where unknown.

    Nothing is counted under ``$CONCUR_MEASURE_LOCK``: processes that share
    the GPU by taking turns to time have said so.
    """
    if os.environ.get(ENVIRONMENT_LOCK) or device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    others = other_processes_on(index)
    if others and index not in _WARNED_BESIDE:
        _WARNED_BESIDE.add(index)
        warnings.warn(f"concur: timed its stream decisions beside {others} other process"
                      f"{'es' if others > 1 else ''} on GPU {index} (NVML); their kernels can turn the answer, so "
                      f"these decisions are not reused by a later run (`concur cache list` shows them). Processes "
                      f"that share a GPU on purpose can take turns to time: CONCUR_MEASURE_LOCK=PATH.",
                      RuntimeWarning, stacklevel=2)
    return others


_WARNED_BESIDE: set[int] = set()  # the devices warned of, once each per process


def _timed_rounds(programs: Sequence[Callable[[], Any]], rounds: int, replays: int,
                  capture_stream: torch.cuda.Stream,
                  settled: Callable[[Sequence[tuple[float, ...]]], bool] | None) -> list[tuple[float, ...]]:
    """Capture each program into one new pool and time alternating rounds; the graphs die with this frame."""
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for program in programs:
        graphs.append(torch.cuda.CUDAGraph())
        with capturing(graphs[-1], pool, capture_stream):
            program()
    torch.cuda.current_stream().wait_stream(capture_stream)
    n = len(graphs)
    # each graph's first replay, which no round then pays, says how many replays fill a round's block
    replays = block_replays([_replays_ms(g, 1) for g in graphs], replays)
    times: list[tuple[float, ...]] = []
    for r in range(rounds):
        ms = [0.0] * n
        for i in [(r + k) % n for k in range(n)]:
            ms[i] = _replays_ms(graphs[i], replays)
        times.append(tuple(ms))
        if settled is not None and settled(times):
            break
    return times


def block_replays(first_ms: Sequence[float], replays: int = REPLAYS, block_ms: float = BLOCK_MS) -> int:
    """Replays per program and round: enough for the fastest program's block to last ``block_ms``, 1 to ``replays``."""
    fastest = min(first_ms, default=0.0)
    if fastest <= 0:
        return replays
    return max(1, min(replays, math.ceil(block_ms / fastest)))


def _replays_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Replay ``graph`` ``replays`` times in a row, timed as one interval; return the ms of one replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


# (device, pool) of each capture that failed and has not been cleaned up after (settle_failed_captures)
_FAILED_CAPTURES: list[tuple[int, Any]] = []


COLLECTED_BEFORE_CAPTURE = 1  # gc generations 0 and 1: objects made since the last full collection, walked in ms


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture the block into ``graph`` (in ``pool``, on ``stream``), as every capture of concur's does.

    The cyclic garbage collector is held off during the capture: it frees
    objects at moments of its own choosing, and freeing a CUDA graph (one in
    a reference cycle) while a stream captures is an illegal call that
    invalidates the capture ("operation not permitted when stream is
    capturing"). Just before, only its young generations are collected
    (:data:`COLLECTED_BEFORE_CAPTURE`): a full collection walks every object
    of the process, which inductor's compiled code makes many, on each of a
    setup's captures (``torch.cuda.graph`` stopped running one for that
    reason); a failed attempt's cycles are collected in full where it is
    given back. Where a capture fails, the device's generator is
    taken out of capture mode at once (random ops run eagerly right after,
    in a warm-up), and the pool is cleaned up after once the failed graph is
    gone (:func:`settle_failed_captures`): before the next capture, or where
    the caller gives back a failed attempt's memory. The caller captures
    later graphs into another pool.
    """
    settle_failed_captures()
    gc.collect(COLLECTED_BEFORE_CAPTURE)
    # Blocks cached outside the pool (the warm-up's activations, on every stream it ran) count against the
    # process's memory as long as they are cached, and a capture cannot give them back once it runs out: the
    # allocator's cudaFree would invalidate it. Given back now, the capture has their room.
    torch.cuda.empty_cache()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with compat.capture_reuses_cross_stream_blocks(), torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    except BaseException:
        compat.end_generator_capture(stream)
        device = getattr(stream, "device", None)
        _FAILED_CAPTURES.append((torch.cuda.current_device() if device is None else device.index, pool))
        raise
    finally:
        if collecting:
            gc.enable()


def _without_frames(exc: BaseException) -> BaseException:
    """``exc`` with the tracebacks of its whole chain dropped: their frames hold what failed (graphs, tensors)."""
    for link in exception_chain(exc):
        link.__traceback__ = None
    return exc


def settle_failed_captures() -> int:
    """Clean up after every failed capture whose graph is gone (:func:`concur._torch_compat.finish_failed_capture`);
    return how many had left the allocator recording. Runs the cyclic collector first: a failed capture's graph
    may sit in a cycle through the traceback of its error."""
    if not _FAILED_CAPTURES:
        return 0
    gc.collect()
    failed, _FAILED_CAPTURES[:] = list(_FAILED_CAPTURES), []
    return sum(compat.finish_failed_capture(device, pool) for device, pool in failed)


# the capture stream of the innermost captures_into block, for replay_rounds
_CAPTURES_INTO: list[torch.cuda.Stream] = []


@contextlib.contextmanager
def captures_into(capture_stream: torch.cuda.Stream) -> Iterator[None]:
    """Inside the block, timing captures its graphs on ``capture_stream``.

    ``train_step`` sets up inside one: the graphs compiled during its setup
    time their programs at their first call (:mod:`concur.inductor.first_call`),
    deep below any argument it could pass, and their multi-stream programs
    should run beneath the step's stream priority as they will in the step
    (:class:`concur.training.graph_runner.CudaGraphRunner`).
    """
    _CAPTURES_INTO.append(capture_stream)
    try:
        yield
    finally:
        _CAPTURES_INTO.pop()


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream measurements use on ``device`` when called from its default stream."""
    key = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(key)
    return _SIDE_STREAMS[key]


def real_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Return real tensors shaped as the (possibly fake) example inputs: same size, strides, dtype, device.

    Values only need to be harmless: floating point in [0.5, 1) (no NaN out of
    a square root or a log), integers 0 (a valid index), booleans False.
    Anything that is not a tensor is passed as it is.
    """
    out: list[Any] = []
    with compat.outside_fake_mode(), torch.no_grad():
        for x in example_inputs:
            if not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)
            if t.is_floating_point() or t.is_complex():
                t.uniform_(0.5, 1.0)
            else:
                t.zero_()
            out.append(t)
    return out


@contextlib.contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """Put the CPU's random number generator, and ``device``'s if it is a GPU, back as they were after the block.

    Timing runs a program a dozen times or more, and a program with dropout
    draws each time: without this the user's next random numbers would
    depend on whether a decision was measured.
    """
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)


def boxed_timer(one_stream: Callable[[list], Any], streams: Sequence[Callable[[list], Any]],
                example_inputs: Sequence[Any], device: torch.device) -> Timer:
    """Return a :data:`~concur.dag.decide.Timer` of compiled graphs' boxed calls (one list argument each).

    Rounds of one stream's time, then each of ``streams``'. The inputs are
    made when the timer runs and dropped after it; each call gets its own
    list, which inductor's ``call`` empties.
    """
    def timer() -> list[tuple[float, ...]]:
        with compat.outside_fake_mode(), rng_kept(device):  # making the inputs draws random numbers too
            return boxed_rounds((one_stream, *streams), real_inputs(example_inputs), device)

    return timer


def boxed_rounds(programs: Sequence[Callable[[list], Any]], args: Sequence[Any], device: torch.device,
                 restore: frozenset[int] = frozenset()) -> list[tuple[float, ...]]:
    """Return :func:`replay_rounds` of compiled graphs' boxed calls (one stream first) on the caller's own ``args``.

    Each call gets its own ``list(args)`` (inductor's ``call`` empties the
    list it is given; ``args`` keeps the tensors alive). The tensors at the
    positions in ``restore``, which the programs write in place (a training
    forward's BatchNorm statistics), are copied before and copied back
    after, and the random number generators are put back (:func:`rng_kept`),
    so a later call sees them as if nothing had been timed. Any other
    tensor the programs write keeps what they left in it: the caller passes
    only tensors whose values nobody reads afterwards.
    """
    saved = [(args[i], args[i].clone()) for i in sorted(restore)
             if i < len(args) and isinstance(args[i], torch.Tensor)]
    try:
        with rng_kept(device):
            return replay_rounds([_boxed(p, args) for p in programs], device)
    finally:
        with torch.no_grad():
            for live, copy in saved:
                live.copy_(copy)


def _boxed(program: Callable[[list], Any], args: Sequence[Any]) -> Callable[[], Any]:
    return lambda: program(list(args))
