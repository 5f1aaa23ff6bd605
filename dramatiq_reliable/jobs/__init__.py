"""Jobs by id: the failure record each failed attempt leaves, and the lookup that says what became of a job.

>>> status = show_job(database_url, "dramatiq_reliable", message_id)   # doctest: +SKIP
>>> status.state, status.attempts, status.last_error_type               # doctest: +SKIP
('retrying', 2, 'ConnectionResetError')
"""

from __future__ import annotations

from .attempts import DEFAULT_FAILURE_RETENTION_MS
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
    "JobListing",
    "JobState",
    "JobStatus",
    "list_jobs",
    "show_job",
]
