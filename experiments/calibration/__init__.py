"""The pieces of ``experiments/calibrate.py``, one job each.

:mod:`.rows` reads measured decisions and sweep rows, :mod:`.fit` fits a
calibration to them and grades it, :mod:`.table` formats the rows and the
errors, :mod:`.constants` reads and writes the generated block of
``concur/dag/calibration.py``; the command itself is ``experiments/calibrate.py``.
"""
