"""The name of the ``torch_dynamo_backends`` entry point (``concur.backend:concur_backend``).

The backend lives in :mod:`concur.inductor.stream_backend`; this module keeps installed metadata working.
``concur/__init__.py`` imports ``backend`` through here so that the attribute ``concur.backend``
is the function, not this module.
"""

from concur.inductor.stream_backend import *  # noqa: F401,F403
from concur.inductor.stream_backend import backend, concur_backend  # noqa: F401
