"""The contention model's predicted speedup, calibrated against measurements on one GPU.

:func:`concur.dag.decide.predict` shares the device between concurrent
kernels by a roofline (:func:`schedulers.simulate_shared`). On networks it was
never tuned for that can be off by tens of percent: it counts every overlap the
schedule allows, and some of it never happens. So the calibration keeps the
prediction's shape and fits how much of it a GPU delivers, in time saved::

    saved = 1 - 1/speedup                  the fraction of one stream's time the schedule saves
    saved_calibrated = shared * saved + ideal_gap * (1/speedup - 1/ideal_speedup)
    calibrated speedup = 1 / (1 - saved_calibrated), at most the ideal speedup

``shared`` is the share of the predicted saving that the GPU realised in the
measured rows; ``ideal_gap`` weighs the contention the model already counted
(the ideal schedule's saving beyond the shared one; 0 unless the fit chose it).
The identity is ``shared=1, ideal_gap=0``. The constants below are made by
``python experiments/calibrate.py DIR...`` from measured decisions (each
entry of a ``decisions/`` cache holds the prediction's terms and both medians)
and say where they come from. They apply to predictions for the GPU they were
fitted on only; anywhere else the raw prediction stands.

>>> h100 = Calibration(gpu="NVIDIA H100 80GB HBM3", roofline="h100", shared=0.5)
>>> round(h100.speedup(2.0, 3.0), 3)     # half of a predicted 50% saving: 25%
1.333
>>> fitted = {h100.gpu: h100}
>>> calibration_for("NVIDIA H100 80GB HBM3", fitted) is h100, calibration_for("NVIDIA H100 PCIe", fitted)
(True, None)

This module makes no CUDA call: the caller passes the GPU's name
(``torch.cuda.get_device_name()``, or the roofline key a prediction was made
for, such as ``"h100"`` without a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol

FEATURES = ("shared", "ideal_gap")  # the weights of a Calibration, in the order experiments/calibrate.py fits them


@dataclass(frozen=True)
class Calibration:
    """How much of the predicted saving one GPU delivers, and the measurements that say so."""

    gpu: str                  # torch.cuda.get_device_name() of the GPU the rows were measured on
    roofline: str             # the concur.dag.cost.ROOFLINES key its predictions were made with
    shared: float = 1.0       # weight of the predicted saving, 1 - 1/speedup
    ideal_gap: float = 0.0    # weight of the ideal saving beyond it, 1/speedup - 1/ideal_speedup
    rows: int = 0             # measured rows fitted (a graph each)
    networks: int = 0         # networks they came from (cross-validation leaves each out in turn)
    torch: str = ""           # torch version of the measurements
    date: str = ""            # when they were measured (the newest)
    mae_raw: float | None = None         # mean |predicted / measured - 1| over the rows
    mae_calibrated: float | None = None  # the same for the calibration, each network left out of its own fit
    placeholder: bool = False  # True: no measurements yet; never applied

    def speedup(self, speedup: float, ideal_speedup: float | None = None) -> float:
        """Return the calibrated speedup of a prediction, at most ``ideal_speedup``.

        ``ideal_speedup`` None (unknown) counts as ``speedup``: no gap, and the
        calibration can then only lower the prediction. A prediction that is
        not a positive finite number is returned as it is.
        """
        if not (math.isfinite(speedup) and speedup > 0):
            return speedup
        ideal = ideal_speedup if ideal_speedup is not None and math.isfinite(ideal_speedup) else speedup
        ideal = max(ideal, speedup)  # the ideal makespan is a bound on the shared one
        x = features(speedup, ideal)
        saved = sum(getattr(self, name) * x[name] for name in FEATURES)
        # never above the ideal bound: a schedule cannot save more than its kernels alone would
        saved = min(saved, 1 - 1 / ideal)
        return 1 / (1 - saved)


def features(speedup: float, ideal_speedup: float) -> dict[str, float]:
    """Return the terms a calibration weighs, as fractions of one stream's time saved.

    >>> features(2.0, 4.0)
    {'shared': 0.5, 'ideal_gap': 0.25}
    """
    return {"shared": 1 - 1 / speedup, "ideal_gap": 1 / speedup - 1 / ideal_speedup}


class Predicted(Protocol):
    """What a calibration reads of a prediction (:class:`concur.dag.decide.Prediction` has both)."""

    @property
    def speedup(self) -> float: ...

    @property
    def ideal_speedup(self) -> float: ...


def _fold(name: str) -> str:
    return " ".join(name.split()).casefold()


def calibration_for(gpu_name: str | None,
                    calibrations: Mapping[str, Calibration] | None = None) -> Calibration | None:
    """Return the calibration fitted on ``gpu_name``, or None (no such GPU, or only a placeholder for it).

    ``gpu_name`` is a CUDA device name, matched whole (an "NVIDIA H100 PCIe"
    is not an "NVIDIA H100 80GB HBM3"), or the roofline key a prediction was
    made for without a GPU (``"h100"``).
    """
    if not gpu_name:
        return None
    wanted = _fold(gpu_name)
    for cal in (CALIBRATIONS if calibrations is None else calibrations).values():
        if not cal.placeholder and wanted in (_fold(cal.gpu), _fold(cal.roofline)):
            return cal
    return None


def calibrated_speedup(prediction: Predicted, gpu_name: str | None,
                       calibrations: Mapping[str, Calibration] | None = None) -> tuple[float, str | None]:
    """Return ``prediction``'s speedup calibrated for ``gpu_name``, and the GPU the calibration was fitted on.

    Where no calibration fits ``gpu_name`` the raw ``prediction.speedup`` is
    returned with None.
    """
    cal = calibration_for(gpu_name, calibrations)
    if cal is None:
        return prediction.speedup, None
    return cal.speedup(prediction.speedup, prediction.ideal_speedup), cal.gpu


# -- generated by experiments/calibrate.py: run it again rather than edit by hand ----------------------------
CALIBRATIONS: dict[str, Calibration] = {
    # 48 measured rows of 24 networks, torch 2.11.0, measured 2026-11-24: MAE 13.3% raw,
    # 6.9% calibrated (each network left out of its own fit)
    "NVIDIA H100 80GB HBM3": Calibration(
        gpu="NVIDIA H100 80GB HBM3", roofline="h100", shared=0.4521, ideal_gap=0.0,
        rows=48, networks=24, torch="2.11.0", date="2026-11-24",
        mae_raw=0.1326, mae_calibrated=0.0688, placeholder=False),
    # 44 measured rows of 22 networks, torch 2.11.0, measured 2026-11-29: MAE 17.8% raw,
    # 9.2% calibrated (each network left out of its own fit)
    "NVIDIA H200": Calibration(
        gpu="NVIDIA H200", roofline="h200", shared=0.3766, ideal_gap=0.0,
        rows=44, networks=22, torch="2.11.0", date="2026-11-29",
        mae_raw=0.1782, mae_calibrated=0.0924, placeholder=False),
}
# -- end of generated constants ------------------------------------------------------------------------------
