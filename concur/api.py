"""Former home of ``optimize``, ``inspect`` and ``ConcurModule``, which live in :mod:`concur.fx.module`.

Kept because checkpoints pickled before the move name ``concur.api._rebuild``.
"""

from concur.fx.module import *  # noqa: F401,F403
from concur.fx.module import _rebuild  # noqa: F401
