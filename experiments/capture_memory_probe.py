"""What each of a concur step's captures found in memory: a probe over one ``experiments/memory.py`` run.

    PYTHONPATH=. python -m experiments.capture_memory_probe --network inception_v3 --batch 64 --limit-mb 4857.3 \
        --out DIR

Runs one concur side of ``experiments/memory.py`` in this process (its
child: the limit, setup, steps, timing) with every capture of the step's
runner recorded: the setup call it came in, the streams of its module, and
the allocator's state by pool and stream (``memory_records.breakdown``) as
the capture begins (after the runner gave cached blocks back) and as it ends
or fails, with the peak reserved over the capture. Where one capture of a
program fits and a later capture of the same program does not, these say
whether the memory outside the pool grew or the pool's own demand did.
Writes DIR/captures.jsonl: the memory.py row, then one line per capture.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from experiments import memory
from experiments.memory_records import MB, OWN_FILES, breakdown


def _state() -> dict:
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return dict(reserved_mb=round(torch.cuda.memory_reserved() / MB, 1),
                allocated_mb=round(torch.cuda.memory_allocated() / MB, 1),
                inactive_split_mb=round(stats.get("inactive_split_bytes.all.current", 0) / MB, 1),
                segments=stats.get("segment.all.current", 0), by_pool_and_stream=breakdown())


def _frames(block: dict) -> list[str]:
    return [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in block.get("frames", [])
            if OWN_FILES.search(f["filename"])][:6]


def _segments() -> list[dict]:
    """The default pool's segments, each with its stream, MB reserved and allocated, and its live blocks: MB and
    the project's frames that allocated them (memory history is on)."""
    found = []
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        live = [dict(mb=round(b["size"] / MB, 2), frames=_frames(b)) for b in segment["blocks"]
                if b["state"] == "active_allocated"]
        found.append(dict(stream=segment["stream"], mb=round(segment["total_size"] / MB, 1),
                          allocated_mb=round(segment["allocated_size"] / MB, 1), live=live))
    return found


def install(records: list[dict], calls: list[int]) -> None:
    """Record every capture of a concur step's runner in ``records`` (``calls[0]``: the setup call now)."""
    from concur.training import graph_runner

    inner = graph_runner.capturing

    @contextlib.contextmanager
    def capturing(graph: Any, pool: Any, stream: Any) -> Iterator[None]:
        record: dict[str, Any] = dict(call=calls[0], before=_state())
        records.append(record)
        torch.cuda.reset_peak_memory_stats()
        with inner(graph, pool, stream):
            record["begin"] = dict(reserved_mb=round(torch.cuda.memory_reserved() / MB, 1),
                                   allocated_mb=round(torch.cuda.memory_allocated() / MB, 1),
                                   by_pool_and_stream=breakdown(), segments=_segments())
            try:
                yield
            except BaseException as exc:
                record.update(outcome="failed", error=str(exc).splitlines()[0][:200],
                              peak_reserved_mb=round(torch.cuda.max_memory_reserved() / MB, 1),
                              at_failure=dict(by_pool_and_stream=breakdown()))
                raise
        record.update(outcome="captured", peak_reserved_mb=round(torch.cuda.max_memory_reserved() / MB, 1),
                      after=_state())

    graph_runner.capturing = capturing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--network", default="inception_v3", choices=memory.NETWORKS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--path", default="unfused", choices=memory.PATHS)
    ap.add_argument("--limit-mb", type=float, required=True, help="the process's limit (the recipe's peak x 1.05)")
    ap.add_argument("--without-caller-memory", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ.setdefault("CONCUR_CACHE_DIR", tempfile.mkdtemp(prefix="concur_decisions_"))
    records: list[dict] = []
    calls = [0]
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    install(records, calls)
    from experiments import memory_records

    observed = memory_records.CallLog.__call__

    def counted(self: Any, *batch: Any) -> Any:  # the call index, for the capture records
        try:
            return observed(self, *batch)
        finally:
            calls[0] += 1

    memory_records.CallLog.__call__ = counted  # type: ignore[method-assign]
    margs = memory.parse_args(["--out", str(args.out), "--oom-trace"]
                              + (["--without-caller-memory"] if args.without_caller_memory else []))
    payload = memory._payload(memory.Config(args.network, args.batch, args.path),
                              memory.Side("concur", "concur"), margs, args.limit_mb * MB)
    row = memory.child(payload)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "captures.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    print(row.get("status"), row.get("ms_per_step"))
    for r in records:
        print(r["call"], r.get("outcome"), r["before"]["reserved_mb"], r.get("begin", {}).get("reserved_mb"),
              r.get("peak_reserved_mb"), r.get("error", ""))


if __name__ == "__main__":
    main()
