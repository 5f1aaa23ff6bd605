"""Jobs by their message id: cancel one wherever it is, and let a running job see it was cancelled."""

from __future__ import annotations

from .cancel import CancelRecord, CancelResult, cancel_job, get_cancellation
from .cancellation import Cancellation, check_cancelled, is_cancelled

__all__ = [
    "CancelRecord",
    "CancelResult",
    "Cancellation",
    "cancel_job",
    "check_cancelled",
    "get_cancellation",
    "is_cancelled",
]
