r"""Sweep models x batch sizes x precisions x modes; one subprocess per configuration, resumable.

    python -m experiments.sweep                                   # everything, on the GPU
    python -m experiments.sweep --models googlenet branchy:8x64 --batches 8 64 --precisions bf16
    python -m experiments.sweep --out DIR --resume                # carry on where a run in DIR stopped
    python -m experiments.sweep --cpu-smoke --out /tmp/smoke       # tiny nets on CPU: plumbing only
    python -m experiments.sweep --models googlenet --modes compile_graph fused:4 \
        --together compile_graph,fused:4 --compile-jobs 6          # the two timed in turns, one child

Modes (``:K`` is a stream count, ``auto`` lets ``train_step`` choose):

    peer_eager          PyTorch's recipes, written without concur in experiments/peers.py: the plain
    peer_compile        loop; the loop around torch.compile; the whole-network capture of PyTorch's
    peer_eager_graph    CUDA-graph docs; that capture around torch.compile. The baselines: the report
    peer_compile_graph  divides fused modes by peer_compile_graph, serial_graph and concur_graph by
                        peer_eager_graph, eager_streams by peer_eager, where the run has the peer's row
    eager               the plain loop (zero_grad, forward under autocast, backward, step)
    eager_streams:K     concur's plan on K streams without a graph (train_step, cuda_graph=False)
    serial_graph        concur's own unfused step on one stream, captured whole (train_step streams=1)
    concur_graph:K      whole-step CUDA graph with K streams; concur_graph:auto uses streams="auto"
    concur_graph_nosplit:K  concur_graph with split_weight_grads=False (weight gradients in the layers' nodes)
    compile             torch.compile(model) in the plain loop
    compile_graph       concur's own compiled step on one stream, captured whole (train_step streams=1,
                        compile=True): concur's backend and capture, not PyTorch's recipe (peer_compile_graph)
    reduce_overhead     torch.compile(model, mode="reduce-overhead") in the plain loop, with
                        torch.compiler.cudagraph_mark_step_begin() before each step
    fused:K             concur's torch.compile backend on K streams + whole-step graph, with its
                        defaults (inductor's kernels placed on streams after fusion, no buffer
                        reuse, backward convolutions split into input and weight parts)
    fused_reuse:K       fused with buffer_reuse=True (inductor's memory footprint)
    fused_ordered:K     fused with buffer_reuse="ordered" (inductor's reuse kept where the streams order it)
    fused_nosplit:K     fused with split_weight_grads=False (AOTAutograd's joint convolution backward)
    fused_noprio:K      fused, the step captured on an ordinary stream (stream_priority=False)
    fused_prio:K        stream_priority=True, named apart in rows measured while False was the default
    fused_fresh:K       buffer_reuse=False, named apart in rows measured while reuse was the default
    fused_gate105:K     fused with min_predicted_speedup=1.05 (graphs predicted below 1.05x stay on one stream)
    critical_path       not a step time: profiles the forward op by op and reports the
                        longest dependency path of the measured kernel times (the bound)

Every compiling configuration runs in its own ``python -m experiments.sweep --one '<json>'``;
the other modes of one model, batch and precision share one child
(``--group``), which saves an interpreter start, a CUDA context and a model
build per mode. A crash, an OOM or a hang (``--timeout-per-config``) is
recorded against the configuration it hit, the rest of its group runs again
one per child, and the sweep goes on; a mode that raises is a result too. Results are appended to
``results.jsonl`` as they come; ``--resume`` skips configurations already there.

``--together serial_graph,concur_graph:4`` sets up those modes of each model,
batch and precision in one child and times them in alternating rounds, so
that the ratio of two modes does not depend on the minute each was timed in.
``--compile-jobs N`` runs N children at once, in waves that keep their memory
apart: they compile and capture side by side and take turns to time, each
alone on the GPU (a file lock).
At the end ``summary.md`` and PNG plots are
written; each names the date, GPU, driver and torch version.
Modes needing CUDA are recorded as "skipped: no CUDA" on a machine without one.
Every row that ran records its peak memory, allocated and reserved, over its
setup and over its timed steps (``setup_peak_allocated_mb``,
``setup_peak_reserved_mb``, ``steady_peak_allocated_mb``,
``steady_peak_reserved_mb``; ``peak_mb`` = the first, as older rows name it).
"""

# One job per module:
#   configs.py   the modes, precisions and defaults; the configurations to run and which share a child
#   children.py  the parent: children in subprocesses, in memory waves, taking turns on the GPU (GpuTurn)
#   measure.py   inside a child: set each mode up, time it, describe it, print its row
#   timing.py    the timed steps of a child: CUDA events (wall clock on CPU), rounds in turns, NVML
#   memory.py    a mode's peak memory, allocated and reserved, over its setup and its timed steps
#   bounds.py    the critical-path bound from a profiler trace of the forward pass, node by node
#   rows.py      results.jsonl and the meta (date, GPU, versions) every row carries
#   report.py    summary.md and the plots
#   combine.py   one run as the union of runs measured in parts
#   cli.py       the command line (``python -m experiments.sweep``, which the children re-invoke)
