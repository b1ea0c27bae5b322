"""Run a traced graph once on example inputs and record, per node, what the scheduler must know.

For every operation node this pass stores a :class:`NodeFacts` in
``node.meta["concur"]``: the storages it reads and writes, whether it draws
random numbers, its FLOPs (``torch.utils.flop_counter``) and the bytes it
moves. Shapes come from ``torch.fx.passes.shape_prop.ShapeProp``, which this
pass extends rather than re-implements.

Why run the graph instead of reading op names: a mutation is *observed*
through the tensor version counters (shared by all views of a storage), so
in-place ops hidden inside leaf modules, ``inplace=True`` flags, custom ops
and buffer updates are all caught the same way. Static rules (trailing
underscore, ``inplace=True``, ``out=``, schema write annotations) are added
on top, so a mutation that happened not to fire on the example input still
counts. Intermediate values are freed after their last use, as in a plain
forward, so annotating costs no more memory than an inference run; a
storage's key is its address plus a generation that changes when the
address is reused by a new storage (a weak reference tells whether the
old one is still alive), so equal keys still mean real aliasing.

The run leaves no trace on the model: buffers (BatchNorm running
statistics), the RNG state and the example inputs are restored or cloned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from concur._torch_compat import op_schema, version_counter

OP_KINDS = ("call_function", "call_method", "call_module")
RNG = "rng"  # storage key of the global random-number generator state

_RANDOM_NAMES = frozenset(
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rand randn randint "
    "rand_like randn_like randint_like bernoulli bernoulli_ multinomial normal normal_ randperm "
    "uniform_ exponential_ geometric_ log_normal_ cauchy_ random_ rrelu rrelu_ gumbel_softmax".split()
)
_RANDOM_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout, torch.nn.RReLU,
)
# Python's augmented assignments: on a tensor each writes its first argument (``a += b`` is ``a.add_(b)``);
# concur's tracer records them as these operators (concur.fx.trace), fx's code generator writes them back as such
AUGMENTED_ASSIGNMENTS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                         operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                         operator.irshift, operator.imatmul)
_INPLACE_OPERATORS = frozenset([operator.setitem, *AUGMENTED_ASSIGNMENTS])


@dataclass(frozen=True)
class NodeFacts:
    """What one operation touches and costs, observed on the example inputs."""

    reads: frozenset[Hashable]
    writes: frozenset[Hashable]
    outputs: frozenset[Hashable]
    flops: int
    bytes_moved: int
    launches_kernel: bool
    # No arithmetic worth a stream: nothing launched (a view, getattr/getitem, an nn.Identity), or
    # only tensors of at most one element (BatchNorm's num_batches_tracked.add_(1)). Such an op's
    # time is the CPU's launch, which streams cannot overlap, so it stays beside its data.
    no_arithmetic: bool = False
    # bytes of the storages the op allocates (outputs in storages it did not read: not views, not in place)
    alloc_bytes: int = 0
    # whether autograd saves one of its outputs for backward (alive until backward reaches it): seen where
    # the module trains and the run records a graph (annotate(..., saved=True))
    saved: bool = False


class StorageKeys:
    """Keys equal for two tensors exactly when they share a storage, also after an address is reused.

    An address alone is not enough once values are freed during the run: the
    caching allocator hands a freed block to the next tensor. The key adds a
    generation per address, new whenever the storage last seen there is dead.
    """

    def __init__(self):
        self._seen: dict[tuple[str, int], tuple[int, StorageWeakRef]] = {}
        self._generations = itertools.count()

    def __call__(self, t: torch.Tensor) -> Hashable:
        storage = t.untyped_storage()
        address = (str(t.device), storage.data_ptr())
        seen = self._seen.get(address)
        if seen is None or seen[1].expired():
            seen = self._seen[address] = (next(self._generations), StorageWeakRef(storage))
        return (*address, seen[0])


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Return the tensors inside a (nested) fx argument value."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    map_aggregate(value, visit)
    return found


def cuda_device_in(*values: Any) -> torch.device | None:
    """Return the device of the first CUDA tensor inside the (nested) values, or None when none is on CUDA."""
    return next((t.device for t in tensors_in(values) if t.is_cuda), None)


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def statically_mutated_args(node: fx.Node, module: torch.nn.Module | None) -> list[Any]:
    """Return the fx arguments of ``node`` that its op is declared to modify in place."""
    name = _target_name(node)
    mutated: list[Any] = []
    if node.kwargs.get("out") is not None:
        mutated.append(node.kwargs["out"])
    first = node.args[:1]
    if node.op == "call_module":
        if getattr(module, "inplace", False):
            mutated.extend(first)
        return mutated
    if node.kwargs.get("inplace") or (name.endswith("_") and not name.startswith("_")):
        mutated.extend(first)
    elif node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        mutated.extend(first)
    schema = op_schema(node.target)  # aten OpOverloads carry alias info
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                if i < len(node.args):
                    mutated.append(node.args[i])
                elif arg.name in node.kwargs:
                    mutated.append(node.kwargs[arg.name])
    if _positional_inplace_flag(node, name):
        mutated.extend(first)
    return mutated


def _positional_inplace_flag(node: fx.Node, name: str) -> bool:
    """F.relu(x, True) and friends pass ``inplace`` positionally as their last argument."""
    positional_inplace = {"relu": 1, "relu6": 1, "elu": 2, "selu": 1, "celu": 2, "leaky_relu": 2,
                          "hardtanh": 3, "hardswish": 1, "hardsigmoid": 1, "silu": 1, "mish": 1,
                          "threshold": 3, "dropout": 3, "alpha_dropout": 3, "dropout1d": 3,
                          "dropout2d": 3, "dropout3d": 3, "feature_alpha_dropout": 3, "rrelu": 4}
    idx = positional_inplace.get(name)
    return (node.op == "call_function" and idx is not None and len(node.args) > idx
            and node.args[idx] is True)


def uses_rng_statically(node: fx.Node, module: torch.nn.Module | None) -> bool:
    """Return True if the op is known to draw from the random-number generator."""
    if node.op == "call_module":
        return isinstance(module, _RANDOM_MODULES) and module.training
    return _target_name(node) in _RANDOM_NAMES


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module, devices: set[torch.device]) -> Iterator[None]:
    """Restore buffers and RNG states after the block, so annotation changes nothing."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}
    try:
        yield
    finally:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        torch.random.set_rng_state(cpu_rng)
        for d, state in cuda_rng.items():
            torch.cuda.set_rng_state(state, d)


def _rng_snapshot(devices: set[torch.device]) -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    states += [torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"]
    return states


class OpFailed(Exception):
    """An operation of the traced graph raised on the example inputs: ``node`` and the exception (``cause``)."""

    def __init__(self, node: fx.Node, cause: Exception):
        super().__init__(f"{node.format_node()}: {type(cause).__name__}: {cause}")
        self.node = node
        self.cause = cause


class _Annotator(ShapeProp):
    """ShapeProp that also records storages, mutations, RNG use, FLOPs and bytes per node.

    An op that raises is caught below ShapeProp's own handler, which would
    print torch's whole traceback to stderr before re-raising, and is raised
    as :class:`OpFailed` naming the node, so the caller can explain it in a
    few lines (the example inputs are usually what is wrong).
    """

    def __init__(self, gm: fx.GraphModule, devices: set[torch.device]):
        super().__init__(gm)
        self.garbage_collect_values = True  # as a plain forward: StorageKeys tells reused addresses apart
        self.devices = devices
        self.storage_key = StorageKeys()
        self._failure: Exception | None = None
        self.saved_keys: set[Hashable] = set()  # storages autograd saved for backward so far


    def _guarded(self, run: Any, target: Any, args: Any, kwargs: Any) -> Any:
        try:
            return run(target, args, kwargs)
        except Exception as exc:
            self._failure = exc
            return None

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._guarded(super().call_function, target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._guarded(super().call_method, target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._guarded(super().call_module, target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in OP_KINDS:
            return super().run_node(n)
        module = self.submodules.get(n.target) if n.op == "call_module" else None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = tensors_in((args, kwargs))
        state = list(module.parameters()) + list(module.buffers()) if module is not None else []
        watched = inputs + state
        versions = [version_counter(t) for t in watched]
        rng_before = _rng_snapshot(self.devices)
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(n)
        if self._failure is not None:
            raise OpFailed(n, self._failure) from self._failure
        rng_used = any(not torch.equal(a, b) for a, b in zip(rng_before, _rng_snapshot(self.devices)))

        storage_key = self.storage_key
        reads = {storage_key(t) for t in watched}
        writes = {storage_key(t) for t, v in zip(watched, versions) if version_counter(t) != v}
        for arg in statically_mutated_args(n, module):
            writes |= {storage_key(t) for t in tensors_in(self._value_of(arg))}
        if rng_used or uses_rng_statically(n, module):
            reads.add(RNG)
            writes.add(RNG)
        outputs = tensors_in(result)
        out_keys = {storage_key(t) for t in outputs}
        new_storage = bool(out_keys - reads)
        flops = int(counter.get_total_flops())
        launches = new_storage or bool(writes - {RNG}) or flops > 0
        moved = 0
        if launches:
            seen: set[Hashable] = set()
            for t in inputs + outputs:
                key = (storage_key(t), t.shape, t.stride(), t.storage_offset())
                if key not in seen:
                    seen.add(key)
                    moved += t.numel() * t.element_size()
        scalar_only = flops == 0 and all(t.numel() <= 1 for t in inputs + outputs + state)
        allocated: dict[Hashable, int] = {}
        for t in outputs:
            key = storage_key(t)
            if key not in reads:
                allocated[key] = t.untyped_storage().nbytes()
        n.meta["concur"] = NodeFacts(frozenset(reads), frozenset(writes), frozenset(out_keys),
                                     flops, moved, launches, not launches or scalar_only,
                                     sum(allocated.values()))
        return result

    def _value_of(self, arg: Any) -> Any:
        return map_aggregate(arg, lambda a: self.env[a] if isinstance(a, fx.Node) else a)


def _noting_saved(storage_key: StorageKeys, saved_keys: set) -> tuple[Callable, Callable]:
    """``saved_tensors_hooks``' pack and unpack for the annotation run: note each storage autograd saves, keep its
    key instead of it.

    Nothing runs backward on this graph, so nothing needs the tensor: the run
    holds no more memory than one without gradients. Autograd keeps the hooks
    with what it saved, out of the collector's sight, so they hold nothing but
    the key maker and the set: a hook bound to the annotator would keep it, its
    values and the traced model alive for as long as the graph lives, and the
    graph itself through the output (an op that saves its own output, kept as
    it is, would hold itself the same way).
    """
    def pack(t: torch.Tensor) -> Hashable:
        key = storage_key(t)
        saved_keys.add(key)
        return key

    def unpack(key: Hashable) -> torch.Tensor:
        raise RuntimeError("concur's annotation run records which tensors autograd saves; it runs no backward")

    return pack, unpack


def annotate(gm: fx.GraphModule, example_inputs: tuple, saved: bool = False) -> Any:
    """Run ``gm`` once on clones of ``example_inputs`` and fill ``node.meta``; return its output.

    Model buffers and RNG state are restored afterwards and the inputs are
    cloned, so the caller's model and data are exactly as they were. Raises
    :class:`OpFailed` when an operation raises on the inputs.

    With ``saved`` (a module that trains, with parameters to train) the run
    records autograd's graph, as a training step's forward does, and notes
    which outputs autograd saves for backward (:attr:`NodeFacts.saved`):
    those stay alive to the start of backward, the step's peak of memory.
    It keeps none of them (each is noted and dropped, as in a run without
    gradients); without ``saved`` it runs without gradients.
    """
    inputs = tuple(map_aggregate(x, lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a)
                   for x in example_inputs)
    devices = {t.device for t in tensors_in(inputs)} | {p.device for p in gm.parameters()}
    annotator = _Annotator(gm, devices)
    recording = torch.enable_grad() if saved else torch.no_grad()
    hooks = torch.autograd.graph.saved_tensors_hooks(*_noting_saved(annotator.storage_key, annotator.saved_keys)) \
        if saved else contextlib.nullcontext()
    with preserved_state(gm, devices), recording, hooks:
        result = annotator.propagate(*inputs)
    if saved:  # an output is saved where a later op saves it as its input: known once the run is over
        for n in gm.graph.nodes:
            found = n.meta.get("concur")
            if isinstance(found, NodeFacts) and found.outputs & annotator.saved_keys:
                n.meta["concur"] = dataclasses.replace(found, saved=True)
    return map_aggregate(result, lambda a: a.detach() if isinstance(a, torch.Tensor) else a)
