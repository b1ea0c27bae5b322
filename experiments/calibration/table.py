"""What ``experiments/calibrate.py`` prints about a fit: one line per row, and the constants with their errors."""

from __future__ import annotations

from typing import Sequence

from experiments.calibration.fit import FITS, Report


def pct(x: float | None) -> str:
    """Return ``x`` as a percentage with one decimal, or "n/a" for None."""
    return "n/a" if x is None else f"{x:.1%}"


def table(rep: Report) -> str:
    """Return one line per row: model, graph, predicted, calibrated (held out), measured, and both errors."""
    calibrated = rep.held_out if rep.held_out is not None else rep.in_sample
    head = "calibrated (held out)" if rep.held_out is not None else "calibrated (in sample)"
    mw = max([5] + [len(r.model) for r in rep.rows])
    lines = [f"{'model':<{mw}}  {'graph':<48}  predicted  {head:>22}  measured  error raw  error calibrated"]
    for r, c in zip(rep.rows, calibrated):
        lines.append(f"{r.model:<{mw}}  {r.graph[:48]:<48}  {r.predicted:8.2f}x  {c:21.2f}x  {r.measured:7.2f}x  "
                     f"{r.predicted / r.measured - 1:+9.1%}  {c / r.measured - 1:+16.1%}")
    return "\n".join(lines)


def summary(rep: Report, others: Sequence[Report] = ()) -> str:
    """Return the fitted constants and the MAE of the raw and the calibrated prediction."""
    terms = " + ".join(f"{rep.weights[n]:.3f} x {n}" for n in FITS[rep.fit])
    lines = [f"{len(rep.rows)} measured rows of {len({r.model for r in rep.rows})} models, "
             f"{len({r.network for r in rep.rows})} networks",
             f"fit {rep.fit}: measured saving = {terms}  (saving = 1 - 1/speedup)",
             f"MAE: raw prediction {pct(rep.mae_raw)}; calibrated {pct(rep.mae_held_out)} with each network left "
             f"out of its own fit ({pct(rep.mae_in_sample)} fitted on every row)"]
    lines += [f"fit {o.fit}: calibrated MAE {pct(o.mae_held_out)} left out, {pct(o.mae_in_sample)} in sample"
              for o in others]
    return "\n".join(lines)
