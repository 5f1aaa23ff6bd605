"""dramatiq-reliable: background jobs on Dramatiq that end done, retrying, or loudly failed."""

from . import events
from .database import Database
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
from .outbox import OutboxBroker, Relay, WorkerRelay, bind, current_connection
from .schema import migrate, migration_sql

__all__ = [
    "ConfigurationError",
    "Database",
    "DatabaseUnavailable",
    "NotBound",
    "OutboxBroker",
    "OutboxWriteError",
    "PayloadError",
    "Relay",
    "ReliableError",
    "SchemaNotReady",
    "Unrecoverable",
    "WorkerRelay",
    "bind",
    "current_connection",
    "events",
    "migrate",
    "migration_sql",
]

__version__ = "0.1.0.dev0"
