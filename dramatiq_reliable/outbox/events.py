"""The events a relay emits: small frozen records, logged and handed to listeners (Tracing turns them into spans)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from .. import events

__all__ = ["OutboxBatchPublished", "OutboxBrokerUnavailable", "OutboxPublished", "OutboxRowFailed", "RelayedMessage"]


@dataclasses.dataclass(frozen=True)
class OutboxPublished(events.Event):
    """A relay pass published ``count`` rows, confirmed by RabbitMQ."""

    name: ClassVar[str] = "outbox.published"
    level: ClassVar[int] = logging.DEBUG
    count: int
    schema: str
    duration_ms: float


@dataclasses.dataclass(frozen=True)
class RelayedMessage:
    """One message of a relay pass: ``error`` is ``None`` when RabbitMQ confirmed it."""

    message_id: str
    queue_name: str
    body: bytes
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class OutboxBatchPublished(events.Event):
    """Every message of one committed relay pass, with the publish's wall-clock bounds.

    Tracing turns each into a publish span linked to the message's creation context.  Bodies
    are carried for that purpose and never logged.
    """

    name: ClassVar[str] = "outbox.batch_published"
    level: ClassVar[int] = logging.DEBUG
    schema: str
    start_time_ns: int
    end_time_ns: int
    messages: tuple[RelayedMessage, ...]

    def as_attributes(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "count": len(self.messages),
            "failed": sum(m.error is not None for m in self.messages),
        }


@dataclasses.dataclass(frozen=True)
class OutboxRowFailed(events.Event):
    """One row could not be published on its own; it waits and is tried again."""

    name: ClassVar[str] = "outbox.row_failed"
    level: ClassVar[int] = logging.WARNING
    row_id: int
    message_id: str
    queue_name: str
    attempts: int
    error: str


@dataclasses.dataclass(frozen=True)
class OutboxBrokerUnavailable(events.Event):
    """RabbitMQ could not be reached; rows wait and the relay backs off."""

    name: ClassVar[str] = "outbox.broker_unavailable"
    level: ClassVar[int] = logging.WARNING
    error: str
    retry_in_ms: int
