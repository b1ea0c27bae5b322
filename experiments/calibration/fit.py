"""Fit a calibration to measured rows, and grade it with each network left out of its own fit.

A row's measured saving (1 - 1/speedup) is fitted as a weighted sum of the
features of its prediction (:func:`concur.dag.calibration.features`). Rows of
one network share its kernels and its errors, so a fit graded on them would
look better than it is on a network it has not seen: the calibrated
prediction is therefore graded against a fit on the other networks only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from concur.dag.calibration import FEATURES, Calibration, features
from experiments.calibration.rows import Row

FITS = {"shrink": ("shared",), "contention": ("shared", "ideal_gap")}


@dataclass(frozen=True)
class Report:
    """A fit of rows: its constants, the held-out calibrated speedups and the errors."""

    fit: str                        # a key of FITS
    rows: list[Row]
    weights: dict[str, float]       # fitted on every row
    held_out: list[float] | None    # per row, calibrated by a fit without its network (None: one network)
    in_sample: list[float]          # per row, calibrated by the fit on every row
    mae_raw: float
    mae_held_out: float | None
    mae_in_sample: float


def _ideal(row: Row) -> float:
    return max(row.ideal if row.ideal is not None else row.predicted, row.predicted)


def design(rows: Sequence[Row], names: Sequence[str]) -> np.ndarray:
    """Return the rows' features (:func:`concur.dag.calibration.features`) named ``names``, one row each."""
    return np.array([[features(r.predicted, _ideal(r))[n] for n in names] for r in rows], dtype=float).reshape(
        len(rows), len(names))


def fit(rows: Sequence[Row], names: Sequence[str]) -> dict[str, float]:
    """Return the weights of ``names`` that best predict each row's measured saving, 1 - 1/measured.

    Least squares, each row weighted by its measured speedup: a saving off by
    d is a speedup off by about d * measured**2, a relative error of d *
    measured, so this minimises the squared relative error to first order.
    Features not named get 0 ("shared" 0 too: the fit then names it).

    Raises:
        ValueError: fewer rows than weights.
    """
    if len(rows) < len(names):
        raise ValueError(f"{len(rows)} measured rows cannot fit {len(names)} constants ({', '.join(names)})")
    measured = np.array([r.measured for r in rows])
    saved = 1 - 1 / measured
    x = design(rows, names)
    w = np.linalg.lstsq(x * measured[:, None], saved * measured, rcond=None)[0]
    weights = dict.fromkeys(FEATURES, 0.0)
    weights.update({n: float(v) for n, v in zip(names, w)})
    return weights


def calibrate(row: Row, weights: dict[str, float]) -> float:
    """Return ``row``'s prediction calibrated by ``weights``, through the same function concur applies."""
    return Calibration(gpu="", roofline="", **weights).speedup(row.predicted, _ideal(row))


def mean_abs_error(estimates: Sequence[float], measured: Sequence[float]) -> float:
    """Return the mean of |estimate / measured - 1| (0.1: off by 10% on average).

    >>> round(mean_abs_error([1.1, 0.9, 1.5], [1.0, 1.0, 1.0]), 3)
    0.233
    """
    if len(estimates) != len(measured) or not estimates:
        raise ValueError(f"{len(estimates)} estimates against {len(measured)} measurements: need as many, at least one")
    return float(np.mean([abs(e / m - 1) for e, m in zip(estimates, measured)]))


def leave_one_network_out(rows: Sequence[Row], names: Sequence[str]) -> list[float] | None:
    """Return each row calibrated by a fit on the other networks' rows only (None: fewer than two networks)."""
    networks = sorted({r.network for r in rows})
    if len(networks) < 2:
        return None
    out = [math.nan] * len(rows)
    for network in networks:
        weights = fit([r for r in rows if r.network != network], names)
        for i, r in enumerate(rows):
            if r.network == network:
                out[i] = calibrate(r, weights)
    return out


def report(rows: Sequence[Row], fit_name: str = "shrink") -> Report:
    """Return the fit ``fit_name`` (a key of FITS) of ``rows``, with its held-out and in-sample errors."""
    names = FITS[fit_name]
    rows = sorted(rows, key=lambda r: (r.model, r.graph, r.source))
    weights = fit(rows, names)
    in_sample = [calibrate(r, weights) for r in rows]
    held_out = leave_one_network_out(rows, names)
    measured = [r.measured for r in rows]
    return Report(fit_name, list(rows), weights, held_out, in_sample,
                  mae_raw=mean_abs_error([r.predicted for r in rows], measured),
                  mae_held_out=None if held_out is None else mean_abs_error(held_out, measured),
                  mae_in_sample=mean_abs_error(in_sample, measured))
