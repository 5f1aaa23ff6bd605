"""dramatiq-reliable: background jobs on Dramatiq that end done, retrying, or loudly failed."""

from . import events, idempotency
from .classify import Decision, classify
from .database import Database
from .dead_letters import DeadLetter, DeadLetterFilter, DeadLetters, DeadLetterStore, ReplayResult
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    NotBound,
    OutboxWriteError,
    PayloadError,
    ReliableError,
    SchemaNotReady,
    Unrecoverable,
)
from .idempotency import Idempotency, IdempotencyConflict, IdempotencyKeyError, current_job, external_key
from .outbox import OutboxBroker, Relay, WorkerRelay, bind, current_connection
from .retries import ClassifiedRetries, build_middleware, no_delays
from .schema import migrate, migration_sql

__all__ = [
    "ClassifiedRetries",
    "ConfigurationError",
    "Database",
    "DatabaseUnavailable",
    "DeadLetter",
    "DeadLetterFilter",
    "DeadLetterStore",
    "DeadLetters",
    "Decision",
    "Idempotency",
    "IdempotencyConflict",
    "IdempotencyKeyError",
    "NotBound",
    "OutboxBroker",
    "OutboxWriteError",
    "PayloadError",
    "Relay",
    "ReliableError",
    "ReplayResult",
    "SchemaNotReady",
    "Unrecoverable",
    "WorkerRelay",
    "bind",
    "build_middleware",
    "classify",
    "current_connection",
    "current_job",
    "events",
    "external_key",
    "idempotency",
    "migrate",
    "migration_sql",
    "no_delays",
]

__version__ = "0.1.0.dev0"
