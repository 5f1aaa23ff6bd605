"""Jobs by id: the failure record each failed attempt leaves, the lookup that says what became of a
job, and cancelling one wherever it is (a running job sees it with :func:`is_cancelled`).

>>> status = show_job(database_url, "dramatiq_reliable", message_id)   # doctest: +SKIP
>>> status.state, status.attempts, status.last_error_type               # doctest: +SKIP
('retrying', 2, 'ConnectionResetError')
"""

from __future__ import annotations

from .attempts import DEFAULT_FAILURE_RETENTION_MS
from .cancel import CancelRecord, CancelResult, cancel_job, get_cancellation
from .cancellation import Cancellation, check_cancelled, is_cancelled
from .lookup import (
    JOB_STATES,
    LISTABLE_STATES,
    JobListing,
    JobState,
    JobStatus,
    list_jobs,
    show_job,
)

__all__ = [
    "DEFAULT_FAILURE_RETENTION_MS",
    "JOB_STATES",
    "LISTABLE_STATES",
    "CancelRecord",
    "CancelResult",
    "Cancellation",
    "JobListing",
    "JobState",
    "JobStatus",
    "cancel_job",
    "check_cancelled",
    "get_cancellation",
    "is_cancelled",
    "list_jobs",
    "show_job",
]
