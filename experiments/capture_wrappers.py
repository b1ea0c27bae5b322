"""Capture inductor's generated wrappers, with inductor's own read/write sets, as golden test fixtures.

For each model, precision and graph (forward, backward) this writes, under
``--out/<torch version>-<device>/<model>_<precision>_<graph>/``:

- ``wrapper.py.gz``: the module inductor generated (its ``call`` function and kernels),
- ``oracle.json.gz``: what inductor's scheduler says each scheduled node reads and writes
  (``read_writes``, buffer names), with the fx nodes it came from, taken from the scheduler
  itself and not from the wrapper text, so a parser of the wrapper can be checked against it,
- ``meta.json``: torch version, device, model, input shape.

    python -m experiments.capture_wrappers --device cuda --models googlenet inception_v3 resnet50 \
        --out tests/fixtures/wrappers
    # the CPU sets of torch 2.13.0 and 2.14.1 (run once with each torch; one OpenMP thread, so the C++
    # kernels have no parallel region; a fresh cache, so that no cache can skip the scheduler):
    OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
        python -m experiments.capture_wrappers \
        --device cpu --models googlenet resnet50 branchy --batch 2 --no-compile-cpp --out tests/fixtures/wrappers

``--no-compile-cpp`` skips g++ (most of a CPU capture's time): the C++
kernels are replaced by ones that zero their tensors, which changes no
wrapper text and no scheduler record, only the values computed.

``--fake-cuda`` generates the CUDA wrappers of torch versions that the GPU
machine cannot install (2.13 and newer), on a CPU: inductor is told that an
H100 is there (its properties, Triton) and compiles fake tensors on
``cuda``, the backward eagerly (``force_non_lazy_backward_lowering``), so
nothing runs and no kernel is built; the Triton kernels' source is in the
wrapper, as on a GPU. Dynamo and AOTAutograd trace on the CPU (AOTAutograd's
backward trace runs the autograd engine, which asks the CUDA driver for a
device; bf16 under CPU autocast, which casts convolutions and matmuls as CUDA
autocast does), and each forward and backward aten graph is then moved to the
faked device and compiled by inductor for it::

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m experiments.capture_wrappers --fake-cuda \
        --models googlenet resnet50 branchy --out tests/fixtures/wrappers

A configuration that fails is named on stderr and the next one goes on; ``CAPTURE_TRACEBACK=1``
prints its traceback too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn as nn


def _torchvision_models():
    """Return ``torchvision.models``, even where torchvision's C extension does not load.

    PyPI's torchvision for torch 2.13 is built against the CUDA wheel of torch;
    beside the CPU wheel its ``_C`` does not load and ``import torchvision``
    fails registering fake kernels for ops that do not exist. The model
    definitions are pure Python, so they are imported without running the
    package's ``__init__`` (no torchvision op is used by these models).
    """
    try:
        import torchvision
        return torchvision.models
    except (RuntimeError, OSError) as exc:
        import importlib.util
        import types

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            raise
        print(f"torchvision does not import ({exc}); loading its pure-Python models", file=sys.stderr)
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = spec.origin
        sys.modules["torchvision"] = package
        import torchvision.models
        return torchvision.models


class Branchy(nn.Module):
    """A small inception-like net that compiles in seconds on a CPU.

    Four parallel branches joined by ``cat`` (views into one buffer), a
    branch-local in-place ``relu_``, dropout (random numbers: an aten
    fallback writing its seed with ``out=``) and batch-norm statistics
    updated in place: the wrapper shapes the big models give, at a size
    a CPU captures quickly.
    """

    def __init__(self, classes: int = 1000):
        super().__init__()

        def cbr(cin: int, cout: int, k: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.stem = cbr(3, 16, 3)
        self.b1 = cbr(16, 8, 1)
        self.b3 = nn.Sequential(cbr(16, 8, 1), cbr(8, 8, 3))
        self.b5 = nn.Sequential(cbr(16, 4, 1), cbr(4, 8, 5))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), cbr(16, 8, 1))
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], 1)
        y = torch.relu_(y * 2.0)
        y = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return self.fc(self.drop(y))


def _models(device: str) -> dict:
    class torchvision:  # noqa: N801 - keeps the table below reading as torchvision.models.X
        models = _torchvision_models()

    big = {
        "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False,
                                                           dropout=0.0), 224 if device == "cuda" else 64),
        "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False,
                                                                 init_weights=False, dropout=0.0),
                         299 if device == "cuda" else 75),
        "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224 if device == "cuda" else 64),
        "branchy": (Branchy, 32),
    }
    return big


def _scheduler_oracle(records: list) -> object:
    """Patch Scheduler.codegen to record each scheduled node's reads and writes before code is emitted."""
    from torch._inductor import scheduler as sched

    original = sched.Scheduler.codegen

    def names(deps) -> list[str]:
        return sorted({getattr(d, "name", str(d)) for d in deps})

    def node_record(node) -> dict:
        rw = node.read_writes
        snodes = node.get_nodes() if hasattr(node, "get_nodes") else [node]
        origins = set()
        for s in snodes:
            ir = getattr(s, "node", None)
            origins |= {o.name for o in getattr(ir, "origins", ()) or ()}
        outputs = []
        for s in snodes:
            for fn in ("get_buffer_names", "get_names"):
                if hasattr(s, fn):
                    outputs += sorted(getattr(s, fn)())
                    break
        return {
            "name": node.get_name(),
            "type": type(node).__name__,
            "extern": bool(node.is_extern()) if hasattr(node, "is_extern") else None,
            "reads": names(rw.reads),
            "writes": names(rw.writes),
            "outputs": sorted(set(outputs)),
            "origins": sorted(origins),
            "mutations": sorted(set().union(*[getattr(getattr(s, "node", None), "get_mutation_names",
                                                              lambda: [])() for s in snodes])),
        }

    def codegen(self, *args, **kwargs):
        records.append({
            "nodes": [node_record(n) for n in self.nodes],
            "mutation_renames": {k: v for k, v in getattr(self, "mutation_renames", {}).items()},
            "removed_buffers": sorted(getattr(self, "removed_buffers", set()) or ()),
        })
        return original(self, *args, **kwargs)

    sched.Scheduler.codegen = codegen
    return original


def _skip_cpp_compilation() -> object:
    """Replace C++ kernel compilation by kernels that zero their tensor arguments; return the original.

    On a shared CPU machine g++ takes most of a capture (one -O3 build per
    fused kernel). What is captured is the wrapper's text and the scheduler's
    read/write sets, which codegen fixes before any kernel is built, so the
    kernels need not compute anything: they only have to let the forward run
    far enough for the backward graph to be compiled. Zeroing keeps index
    tensors that later kernels read in range.
    """
    from torch._inductor.async_compile import AsyncCompile

    original = AsyncCompile.cpp_pybinding

    def cpp_pybinding(self, argtypes, source_code):
        def kernel(*args):
            for a in args:
                if isinstance(a, torch.Tensor):
                    a.zero_()
        return kernel

    AsyncCompile.cpp_pybinding = cpp_pybinding
    return original


def capture(model_name: str, make, size: int, precision: str, device: str, out: Path, batch: int,
            compile_kernels: bool = True) -> list[str]:
    from concur import _torch_compat as compat
    from torch._inductor.async_compile import AsyncCompile

    records: list = []
    original = _scheduler_oracle(records)
    original_cpp = None if compile_kernels else _skip_cpp_compilation()
    graphs: list[tuple[bool, str, dict]] = []

    def inner(gm, example_inputs, *args, **kwargs):
        start = len(records)
        compiled = compat.inductor_compile_graph(gm, example_inputs, *args, **kwargs)
        source, *_ = compat.inductor_wrapper(compiled)
        oracle = records[start:] if len(records) > start else []
        graphs.append((bool(kwargs.get("is_backward", False)), source,
                       {"scheduler": oracle, "fx_code": gm.code}))
        return compiled

    def backend(gm, example_inputs):
        return compat.inductor_compile_fx(gm, example_inputs, inner)

    torch.manual_seed(0)
    model = make().to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    if precision == "bf16_cl":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend=backend)
    import torch._inductor.config as inductor_config

    try:
        # a graph served from inductor's FX graph cache never reaches the scheduler, and would have no oracle
        with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16_cl"):
                out_ = compiled(x)
                logits = out_[0] if isinstance(out_, tuple) else out_
                loss = nn.functional.cross_entropy(logits.float(), y)
            loss.backward()  # compiles the backward graph
    finally:
        from torch._inductor import scheduler as sched
        sched.Scheduler.codegen = original
        if original_cpp is not None:
            AsyncCompile.cpp_pybinding = original_cpp
        torch._dynamo.reset()
    empty = [i for i, (_, _, oracle) in enumerate(graphs) if not oracle["scheduler"]]
    if empty:
        raise RuntimeError(f"graphs {empty} were compiled without running inductor's scheduler (a cache hit?): "
                           "no oracle to save; run with a fresh TORCHINDUCTOR_CACHE_DIR")
    return _write(model_name, precision, device, graphs, out, batch, size,
                  gpu=torch.cuda.get_device_name() if device == "cuda" else None, compiled=compile_kernels)


def _write(model_name: str, precision: str, kind: str, graphs: list, out: Path, batch: int, size: int,
           gpu: str | None, compiled: bool = False, how: str | None = None) -> list[str]:
    """Write each graph's wrapper, oracle, fx code and meta.json under ``out/torch<version>-<kind>/``."""
    written = []
    tag = f"torch{torch.__version__.split('+')[0]}-{kind}"
    for i, (is_backward, source, oracle) in enumerate(graphs):
        name = f"{model_name}_{precision}_{'bwd' if is_backward else 'fwd'}" + (f"{i}" if len(graphs) > 2 else "")
        d = out / tag / name
        d.mkdir(parents=True, exist_ok=True)
        with gzip.open(d / "wrapper.py.gz", "wt") as f:
            f.write(source)
        with gzip.open(d / "oracle.json.gz", "wt") as f:
            json.dump(oracle["scheduler"], f)
        meta = {"torch": torch.__version__, "device": kind.split("-")[0], "gpu": gpu, "model": model_name,
                "precision": precision, "batch": batch, "size": size, "kernels_compiled": compiled,
                "graph": "backward" if is_backward else "forward"}
        if how is not None:
            meta["how"] = how
        (d / "meta.json").write_text(json.dumps(meta, indent=1))
        with gzip.open(d / "fx_graph.py.gz", "wt") as f:
            f.write(oracle["fx_code"])
        written.append(str(d))
    return written


# What inductor asks a CUDA device while it generates code, answered for an H100 without one.
_H100 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2**30,
             warp_size=32, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
             max_threads_per_block=1024, shared_memory_per_block_optin=232448, shared_memory_per_block=49152,
             shared_memory_per_multiprocessor=233472, L2_cache_size=50 * 2**20, clock_rate=1980000,
             memory_clock_rate=2619000, memory_bus_width=5120, gcnArchName="", uuid="fake", is_integrated=False)


class _FakeKernel:
    """Stands for a compiled Triton kernel: never launched, since nothing runs."""

    def __init__(self, name: str):
        self.name = name

    def run(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} was generated for a faked GPU and cannot run")


def _fake_cuda() -> None:
    """Let inductor generate CUDA code on a machine without a GPU (for this process: it patches torch)."""
    import types

    props = types.SimpleNamespace(**_H100)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (props.major, props.minor)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda._lazy_init = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    from torch._inductor import scheduler as inductor_scheduler
    from torch._inductor.async_compile import AsyncCompile

    inductor_scheduler.has_triton = lambda: True
    from torch._dynamo.device_interface import CudaInterface

    torch.cuda.is_bf16_supported = lambda *a, **k: True  # sm_90 has bf16
    CudaInterface.is_bf16_supported = staticmethod(lambda *a, **k: True)
    AsyncCompile.triton = lambda self, kernel_name, source_code, *a, **k: _FakeKernel(kernel_name)
    # Triton's CUDA driver, as inductor asks it for the target (sm_90) while it writes a kernel
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    class FakeCudaDriver(CudaDriver):
        def __init__(self):  # CudaDriver's own loads libcuda
            self.utils = types.SimpleNamespace(get_device_properties=lambda device: {
                "max_shared_mem": props.shared_memory_per_block_optin, "multiprocessor_count": props.multi_processor_count,
                "max_num_regs": props.regs_per_multiprocessor, "warpSize": props.warp_size})
            self.get_device_capability = lambda device=None: (props.major, props.minor)
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=None: 0
            self.set_current_device = lambda device: None

        def get_current_target(self):
            return GPUTarget("cuda", props.major * 10 + props.minor, props.warp_size)

    driver.set_active(FakeCudaDriver())


def _on_fake_cuda(gm: torch.fx.GraphModule, example_inputs: list, mode) -> list:
    """Move an aten graph traced on the CPU to a faked CUDA device; return its inputs there (fake tensors).

    Device constants in the graph (``device=cpu`` of factory calls) become
    ``cuda:0``, and each node's ``meta["val"]`` is propagated again from the
    CUDA inputs, which is what inductor lowers and schedules by.
    """
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    cuda = torch.device("cuda", 0)

    def retarget(value):
        return cuda if isinstance(value, torch.device) and value.type == "cpu" else value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, retarget)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, retarget)
    gm.recompile()
    with mode:
        inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda)
                  if isinstance(t, torch.Tensor) else t for t in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return inputs


def capture_fake_cuda(model_name: str, make, size: int, precision: str, out: Path, batch: int) -> list[str]:
    """Capture the CUDA wrappers and oracle of one model without a GPU (see ``--fake-cuda``); needs _fake_cuda()."""
    from torch._functorch import config as functorch_config
    from torch._guards import TracingContext, tracing
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from concur import _torch_compat as compat

    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(batch, 3, size, size)
    if precision == "bf16_cl":
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    traced: list = []

    def grab(gm, example_inputs):
        traced.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab)(x)
    torch._dynamo.reset()
    if len(traced) != 1:
        raise RuntimeError(f"dynamo made {len(traced)} graphs of {model_name}; one expected")
    gm, real_inputs = traced[0]
    records: list = []
    original = _scheduler_oracle(records)
    graphs: list[tuple[bool, str, dict]] = []

    def inner(gm, example_inputs, *args, **kwargs):  # each aten graph, traced on the CPU: compiled for CUDA
        mode = FakeTensorMode()
        inputs = _on_fake_cuda(gm, example_inputs, mode)
        start = len(records)
        with tracing(TracingContext(mode)), mode:
            compiled = compat.inductor_compile_graph(gm, inputs, *args, **kwargs)
        source, *_ = compat.inductor_wrapper(compiled)
        graphs.append((bool(kwargs.get("is_backward", False)), source,
                       {"scheduler": records[start:], "fx_code": gm.code}))
        return compiled

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_cl")
    try:
        with functorch_config.patch(force_non_lazy_backward_lowering=True), \
                inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), autocast:
            compat.inductor_compile_fx(gm, real_inputs, inner)
    finally:
        from torch._inductor import scheduler as sched
        sched.Scheduler.codegen = original
    if len(graphs) != 2 or any(not oracle["scheduler"] for _, _, oracle in graphs):
        raise RuntimeError(f"{model_name}: {len(graphs)} graphs compiled, some without the scheduler's record")
    return _write(model_name, precision, "cuda-codegen", graphs, out, batch, size, gpu=None,
                  how="CUDA code generated on a CPU, the device (an H100's properties) and Triton faked")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--models", nargs="*", default=None, help="default: all (googlenet inception_v3 resnet50 branchy)")
    p.add_argument("--precisions", nargs="*", default=["fp32", "bf16_cl"], help="fp32 and/or bf16_cl")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/wrappers"), help="output folder")
    p.add_argument("--no-compile-cpp", action="store_true",
                   help="CPU: do not build the C++ kernels (the wrapper and oracle do not depend on them)")
    p.add_argument("--fake-cuda", action="store_true",
                   help="generate CUDA wrappers without a GPU (inductor told of an H100; nothing runs)")
    a = p.parse_args(argv)
    if a.fake_cuda:
        _fake_cuda()
    models = _models("cuda" if a.fake_cuda else a.device)
    for name in a.models or list(models):
        make, size = models[name]
        for precision in a.precisions:
            try:
                if a.fake_cuda:
                    written = capture_fake_cuda(name, make, size, precision, a.out, a.batch)
                else:
                    written = capture(name, make, size, precision, a.device, a.out, a.batch,
                                      compile_kernels=not a.no_compile_cpp)
                for d in written:
                    print("wrote", d, flush=True)
            except Exception as exc:  # noqa: BLE001 - record and go on with the next configuration
                if os.environ.get("CAPTURE_TRACEBACK"):
                    traceback.print_exc()
                print(f"FAILED {name} {precision}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
