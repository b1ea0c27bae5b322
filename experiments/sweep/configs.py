"""What a sweep runs: its modes and precisions, the configurations in sweep order, and which share a child.

A configuration is a plain dict (model, batch, precision, mode and how to
time it) because it travels to a child as JSON and comes back in its row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ALL_MODES = ("eager", "eager_streams:4", "peer_eager_graph", "serial_graph", "concur_graph:2", "concur_graph:4",
             "concur_graph:auto", "compile", "peer_compile_graph", "compile_graph", "reduce_overhead", "fused:4",
             "critical_path")
# PyTorch's own recipes, built by experiments/peers.py (which imports nothing of concur): the baselines
PEER_MODES = ("peer_eager", "peer_compile", "peer_eager_graph", "peer_compile_graph")
FUSED_MODES = ("fused", "fused_fresh", "fused_reuse", "fused_ordered", "fused_nosplit", "fused_prio", "fused_noprio",
               "fused_gate105")
CUDA_MODES = ("serial_graph", "concur_graph", "concur_graph_nosplit", "compile_graph", "reduce_overhead", *FUSED_MODES,
              "critical_path", "peer_eager_graph", "peer_compile_graph")
CONCUR_MODES = ("eager_streams", "concur_graph", "concur_graph_nosplit", *FUSED_MODES)  # the rest: a user has
# concur's own step on one stream (train_step streams=1): a row of its own, not PyTorch's recipe
CONCUR_ONE_STREAM_MODES = ("serial_graph", "compile_graph")
COMPILING_MODES = ("compile", "compile_graph", "reduce_overhead", *FUSED_MODES, "peer_compile",
                   "peer_compile_graph")  # a child each
# the peer recipe each mode's ratios divide by, where the run has its row (report.peer_ratios)
PEER_OF = {"eager_streams": "peer_eager", "serial_graph": "peer_eager_graph", "concur_graph": "peer_eager_graph",
           "concur_graph_nosplit": "peer_eager_graph", "compile_graph": "peer_compile_graph",
           **{kind: "peer_compile_graph" for kind in FUSED_MODES}}
# the backend's options per fused mode (None: concur.backend's defaults); fused_noprio differs in train_step
FUSED_OPTIONS = {"fused": None, "fused_fresh": {"buffer_reuse": False}, "fused_reuse": {"buffer_reuse": True},
                 "fused_ordered": {"buffer_reuse": "ordered"}, "fused_nosplit": {"split_weight_grads": False},
                 "fused_prio": None, "fused_noprio": None, "fused_gate105": {"min_predicted_speedup": 1.05}}
PRECISIONS = ("fp32", "bf16", "fp32-cl")  # bf16 = autocast + channels-last; fp32-cl = fp32, channels-last
CHANNELS_LAST_PRECISIONS = ("bf16", "fp32-cl")
DEFAULT_BATCHES = [8, 32, 64, 128]
SMOKE = dict(models=["branchy:2x8", "nascell:8"], batches=[2], precisions=["fp32"],
             modes=["eager", "eager_streams:2", "serial_graph", "critical_path"], image_size=32, repeats=3)


def config_key(cfg: dict) -> str:
    """Return the identity of a configuration in results.jsonl (what --resume matches)."""
    return f"{cfg['model']}|{cfg['batch']}|{cfg['precision']}|{cfg['mode']}"


def file_stem(key: str) -> str:
    """Return a configuration key or model name as a file name (no ``|`` or ``:``)."""
    return key.replace("|", "_").replace(":", "-")


def mode_kind(mode: str) -> str:
    """Return a mode without its stream count: ``concur_graph:4`` -> ``concur_graph``."""
    return mode.split(":")[0]


def ordered_modes(modes: list[str], together: list[list[str]]) -> list[str]:
    """The modes in sweep order: each ``--together`` set in its own order, where its first mode stands."""
    ordered, placed = [], set()
    for mode in modes:
        if mode in placed:
            continue
        group = next((g for g in together if mode in g), [mode])
        ordered += group
        placed.update(group)
    return ordered


def make_configs(args: argparse.Namespace) -> list[dict]:
    """Return the configurations to run, in sweep order; critical_path once per model/batch/precision."""
    together = [t.split(",") for t in getattr(args, "together", None) or []]
    tag = {m: ",".join(g) for g in together for m in g}
    configs = []
    for precision in args.precisions:
        for model in args.models:
            for batch in args.batches:
                for mode in ordered_modes(args.modes, together):
                    cfg = dict(model=model, batch=batch, precision=precision, mode=mode, repeats=args.repeats,
                               util_seconds=args.util_seconds,
                               warmup=args.warmup, out=str(args.out))
                    if args.image_size:
                        cfg["image_size"] = args.image_size
                    if mode in tag:
                        cfg.update(together=tag[mode], rounds=getattr(args, "rounds", 5))
                    if mode_kind(mode) in COMPILING_MODES:
                        cfg["compile_cache"] = "shared" if args.shared_compile_cache else "cold"
                    if mode != "critical_path" and getattr(args, "compile_jobs", 1) > 1:
                        # compiles and captures run side by side, each timed alone; setup_s is not a lone one
                        cfg["compile_jobs"] = args.compile_jobs
                        cfg["gpu_lock"] = str(Path(args.out) / ".gpu.lock")
                    for spec in args.inject_failure:
                        needle, _, how = spec.rpartition("=")
                        if needle == config_key(cfg):
                            cfg["fail"] = how
                    configs.append(cfg)
    return configs


def group_configs(configs: list[dict]) -> list[list[dict]]:
    """Group configurations that share a child: modes to time together, or consecutive non-compiling modes.

    Both must be of one model, batch and precision. Every other compiling
    configuration gets a child of its own.
    """
    groups: list[list[dict]] = []
    for cfg in configs:
        last = groups[-1][-1] if groups else None
        same_point = last is not None and all(last[k] == cfg[k] for k in ("model", "batch", "precision"))
        if cfg.get("together") or (last is not None and last.get("together")):
            same = same_point and cfg.get("together") == last.get("together")
        else:
            same = same_point and mode_kind(last["mode"]) not in COMPILING_MODES and \
                mode_kind(cfg["mode"]) not in COMPILING_MODES
        if same:
            groups[-1].append(cfg)
        else:
            groups.append([cfg])
    return groups
