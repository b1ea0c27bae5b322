"""Re-exports :mod:`concur.fx.module` (``optimize``, ``inspect``, ``ConcurModule``) under ``concur.api``.

Checkpoints of a ``ConcurModule`` pickled by concur releases that defined it here name
``concur.api._rebuild``; this module lets them load.
"""

from concur.fx.module import *  # noqa: F401,F403
from concur.fx.module import _rebuild  # noqa: F401
