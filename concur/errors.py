"""concur's exceptions: each says what went wrong, where, and what to do about it."""

from __future__ import annotations


class ConcurError(RuntimeError):
    """Base class of every error concur raises on purpose."""


class CaptureError(ConcurError):
    """torch.fx could not trace the model.

    Attributes name the innermost module being traced when tracing failed and
    the user's source line, so the message can point at the code to change.
    """

    def __init__(self, message: str, module_path: str, module_type: str, location: str | None):
        super().__init__(message)
        self.module_path = module_path
        self.module_type = module_type
        self.location = location


class PlanError(ConcurError):
    """A generated plan failed its own consistency check (a concur bug, never a user error)."""
