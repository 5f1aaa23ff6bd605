"""dramatiq-reliable: background jobs on Dramatiq that end done, retrying, or loudly failed.

Everything a user needs is importable from here; ``__all__`` is the public surface (the
sub-modules stay importable for their less common names, such as the event records).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from .async_sending import send_async, send_async_with_options
from .checkpoints import CheckpointWindow, checkpoint
from .classify import Decision, classify
from .database import Database
from .dead_letters import (
    DeadLetter,
    DeadLetterFilter,
    DeadLetters,
    DeadLetterStore,
    PostgresDeadLetterStore,
    ReplayResult,
)
from .errors import (
    ActorOptionError,
    BrokerUnavailable,
    CheckpointError,
    CommitOutcomeUnknown,
    ConfigurationError,
    DatabaseUnavailable,
    DeliveryLimitReached,
    IdempotencyConflict,
    IdempotencyKeyError,
    JobCancelled,
    JobCommitFailed,
    JobNotFound,
    MiddlewareFailed,
    NoCurrentJob,
    NotBound,
    OutboxWriteError,
    PayloadError,
    QueueMismatch,
    ReliableError,
    ScheduleDisabled,
    ScheduleNotFound,
    SchemaNotReady,
    TargetUnknown,
    Unrecoverable,
)
from .flow import ConcurrencyLimit, OrderedKeys, RateLimit, RateLimits
from .idempotency import (
    Idempotency,
    IdempotencyStore,
    PostgresIdempotencyStore,
    current_job,
    external_key,
    job_connection,
    job_connection_async,
)
from .jobs import Cancellation, CancelResult, JobStatus, cancel_job, check_cancelled, is_cancelled, list_jobs, show_job
from .outbox import OutboxBroker, Relay, RelayOptions, WorkerRelay, bind
from .postgres import PostgresBroker
from .retries import ClassifiedRetries, build_middleware, no_delays
from .scheduler import Scheduler, ScheduleRuns, WorkerScheduler, schedule
from .schema import migrate, migration_sql
from .singleton import Singleton, current_lease
from .tracing import Tracing
from .workflows import (
    Batch,
    Batches,
    BatchStatus,
    Group,
    Workflow,
    Workflows,
    WorkflowStatus,
    batch_status,
    cancel_batch,
    cancel_workflow,
    workflow_status,
)

__all__ = [
    "ActorOptionError",
    "Batch",
    "BatchStatus",
    "Batches",
    "BrokerUnavailable",
    "CancelResult",
    "Cancellation",
    "CheckpointError",
    "CheckpointWindow",
    "ClassifiedRetries",
    "CommitOutcomeUnknown",
    "ConcurrencyLimit",
    "ConfigurationError",
    "Database",
    "DatabaseUnavailable",
    "DeadLetter",
    "DeadLetterFilter",
    "DeadLetterStore",
    "DeadLetters",
    "Decision",
    "DeliveryLimitReached",
    "Group",
    "Idempotency",
    "IdempotencyConflict",
    "IdempotencyKeyError",
    "IdempotencyStore",
    "JobCancelled",
    "JobCommitFailed",
    "JobNotFound",
    "JobStatus",
    "MiddlewareFailed",
    "NoCurrentJob",
    "NotBound",
    "OrderedKeys",
    "OutboxBroker",
    "OutboxWriteError",
    "PayloadError",
    "PostgresBroker",
    "PostgresDeadLetterStore",
    "PostgresIdempotencyStore",
    "QueueMismatch",
    "RateLimit",
    "RateLimits",
    "Relay",
    "RelayOptions",
    "ReliableError",
    "ReplayResult",
    "ScheduleDisabled",
    "ScheduleNotFound",
    "ScheduleRuns",
    "Scheduler",
    "SchemaNotReady",
    "Singleton",
    "TargetUnknown",
    "Tracing",
    "Unrecoverable",
    "WorkerRelay",
    "WorkerScheduler",
    "Workflow",
    "WorkflowStatus",
    "Workflows",
    "batch_status",
    "bind",
    "build_middleware",
    "cancel_batch",
    "cancel_job",
    "cancel_workflow",
    "check_cancelled",
    "checkpoint",
    "classify",
    "current_job",
    "current_lease",
    "external_key",
    "is_cancelled",
    "job_connection",
    "job_connection_async",
    "list_jobs",
    "migrate",
    "migration_sql",
    "no_delays",
    "schedule",
    "send_async",
    "send_async_with_options",
    "show_job",
    "workflow_status",
]

try:
    __version__ = _version("dramatiq-reliable")
except PackageNotFoundError:  # pragma: no cover - running from a checkout that was never installed
    __version__ = "0+unknown"
