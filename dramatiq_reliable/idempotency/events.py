"""The events the idempotency middleware emits: small frozen records, logged and handed to listeners."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from .. import events

__all__ = [
    "IdempotencyCommitFailed",
    "IdempotencyDuplicateSkipped",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyReused",
    "IdempotencyKeysPurged",
    "IdempotencyRecordFailed",
    "IdempotencyUnavailable",
]

# -- events -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IdempotencyDuplicateSkipped(events.Event):
    """A job whose key already ran was acked without running the actor."""

    name: ClassVar[str] = "idempotency.duplicate"
    actor_name: str
    message_id: str
    key: str
    mode: str
    first_message_id: str
    queue_name: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeyReused(events.Event):
    """A key that ran was reused with other arguments; the message failed."""

    name: ClassVar[str] = "idempotency.conflict"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    key: str
    first_message_id: str


@dataclasses.dataclass(frozen=True)
class IdempotencyUnavailable(events.Event):
    """The key could not be checked (Postgres unreachable, schema missing): the actor did not run."""

    name: ClassVar[str] = "idempotency.unavailable"
    level: ClassVar[int] = logging.WARNING
    actor_name: str
    message_id: str
    mode: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeyInvalid(events.Event):
    """The key could not be computed; the message failed without running the actor."""

    name: ClassVar[str] = "idempotency.key_invalid"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyCommitFailed(events.Event):
    """The actor returned but its transaction did not commit; the message was not acked as done."""

    name: ClassVar[str] = "idempotency.commit_failed"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    key: str
    error: str
    #: ``"unknown"``: the connection broke during COMMIT (the message is retried apart from its
    #: budget); ``"failed"``: Postgres refused the commit (the retry middleware decides).
    outcome: str


@dataclasses.dataclass(frozen=True)
class IdempotencyRecordFailed(events.Event):
    """Record mode: the actor succeeded but its key could not be recorded; a redelivery would run it again."""

    name: ClassVar[str] = "idempotency.record_failed"
    level: ClassVar[int] = logging.WARNING
    actor_name: str
    message_id: str
    key: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeysPurged(events.Event):
    """Expired keys were deleted."""

    name: ClassVar[str] = "idempotency.purged"
    count: int
    schema: str
    duration_ms: float
