"""The worker side of cancel: skip a cancelled delivery, and let a running job see its cancellation.

:func:`~dramatiq_reliable.jobs.cancel.cancel_job` deletes a job still waiting in Postgres; for
one already delivered or running it leaves a tombstone in ``job_cancellations``.  This module
honours the tombstone:

* :class:`Cancellation` looks the message id up before the actor runs (one primary-key look-up
  per message) and skips a cancelled one: Dramatiq acks it, the actor never runs, nothing is
  retried or dead-lettered.
* :func:`is_cancelled` answers, inside a running actor, whether its message was cancelled since
  it started (at most one look-up per ``check_interval_ms``); :func:`check_cancelled` raises
  :class:`~dramatiq_reliable.errors.JobCancelled` if so.  ``ClassifiedRetries`` treats that as
  final: the message is acked, not retried, not dead-lettered.

>>> broker = OutboxBroker(..., middleware=build_middleware(middleware=[
...     Tracing(), AgeLimit(), TimeLimit(), ShutdownNotifications(), Cancellation(), Idempotency(),
...     DeadLetters()]))                                                   # doctest: +SKIP
>>> @dramatiq.actor
... def export(rows):
...     for chunk in chunks(rows):
...         check_cancelled()          # stops here once 'jobs cancel' was run
...         write(chunk)                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
from typing import Any, ClassVar

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware, SkipMessage
from psycopg.rows import dict_row

from .. import _sql, events
from .._checks import check_ms
from ..backing import Backing, backing_of
from ..database import Database
from ..errors import DatabaseUnavailable, JobCancelled, MiddlewareFailed, NoCurrentJob
from ..schema import CANCEL_VERSION, ensure_ready

__all__ = [
    "DEFAULT_CHECK_INTERVAL_MS",
    "Cancellation",
    "CancelledSkipped",
    "CancelledStopped",
    "check_cancelled",
    "is_cancelled",
]

logger = logging.getLogger("dramatiq_reliable.cancellation")

#: How stale ``is_cancelled()`` may be: a loop calling it every millisecond costs one look-up a
#: second, and a cancel is seen within a second.
DEFAULT_CHECK_INTERVAL_MS = 1000


@dataclasses.dataclass(frozen=True)
class CancelledSkipped(events.Event):
    """A delivered message was cancelled before it ran: skipped and acked, the actor never ran."""

    name: ClassVar[str] = "job.cancelled_skipped"
    level: ClassVar[int] = logging.WARNING

    message_id: str
    actor_name: str
    queue_name: str
    cancelled_by: str


@dataclasses.dataclass(frozen=True)
class CancelledStopped(events.Event):
    """A running job stopped at a cancel check (``JobCancelled``): acked, not retried."""

    name: ClassVar[str] = "job.cancelled_stopped"
    level: ClassVar[int] = logging.WARNING

    message_id: str
    actor_name: str
    queue_name: str


@dataclasses.dataclass(eq=False)
class _Running:
    """The message a worker thread runs, and the cached answer of its last cancel look-up."""

    message_id: str
    database: Database
    schema: str
    interval_s: float
    checked_at: float = float("-inf")
    cancelled: bool = False


_running: contextvars.ContextVar[_Running | None] = contextvars.ContextVar(
    "dramatiq_reliable_cancellation", default=None
)


class Cancellation(Middleware):
    """Skips messages cancelled with ``jobs cancel``, and lets running jobs see their cancellation.

    Place it after ``Tracing``, ``AgeLimit``, ``TimeLimit`` and ``ShutdownNotifications`` and
    **before** ``Idempotency`` (docs/middleware-order.md): a cancelled message is then skipped
    before a job transaction is opened or a key claimed.

    The look-up fails closed: if it cannot be made (Postgres down, schema not migrated), the
    hook raises :class:`~dramatiq_reliable.errors.DatabaseUnavailable` or
    :class:`~dramatiq_reliable.errors.MiddlewareFailed` (both ``MiddlewareError``\\ s), so the
    actor does not run and the message is retried like a failed job, never run unchecked.

    It shares the broker's pool and schema on ``OutboxBroker`` and ``PostgresBroker``; on any
    other broker pass ``database=`` (and ``schema=``).
    """

    def __init__(
        self,
        *,
        database: Database | str | None = None,
        schema: str | None = None,
        check_interval_ms: int = DEFAULT_CHECK_INTERVAL_MS,
    ) -> None:
        self._database = None if database is None else Database.of(database)
        # a pool opened here from a URL is this middleware's to close; a Database given is not
        self._owns_database = isinstance(database, str)
        self._schema = None if schema is None else _sql.validate_schema(schema)
        self.check_interval_ms: int = check_ms("check_interval_ms", check_interval_ms)
        self._backing: Backing | None = None
        self._ready = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Cancellation(check_interval_ms={self.check_interval_ms!r})"

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        # A pool this middleware opened from a URL is its own to close; a shared one is not.
        if self._database is not None and self._owns_database:
            self._database.close()

    def backing(self, broker: Broker) -> Backing:
        """Where the tombstones are: the broker's pool and schema, or the ones given."""
        if self._backing is None:
            self._backing = backing_of(broker, needed_by="Cancellation", database=self._database, schema=self._schema)
        return self._backing

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        try:
            backing = self.backing(broker)
            found = self._look_up(backing, message.message_id)
        except psycopg.OperationalError as error:
            raise DatabaseUnavailable(
                f"could not check whether message {message.message_id} was cancelled: Postgres is unreachable "
                f"({error}); the actor did not run and the message is retried"
            ) from error
        except Exception as error:
            raise MiddlewareFailed(
                f"could not check whether message {message.message_id} was cancelled "
                f"({type(error).__name__}: {error}); the actor did not run and the message is retried"
            ) from error
        if found is not None:
            events.emit(
                CancelledSkipped(
                    message_id=message.message_id,
                    actor_name=message.actor_name,
                    queue_name=message.queue_name,
                    cancelled_by=found,
                )
            )
            raise SkipMessage(f"message {message.message_id} was cancelled by {found}")
        _running.set(
            _Running(
                message_id=message.message_id,
                database=backing.database,
                schema=backing.schema,
                interval_s=self.check_interval_ms / 1000,
            )
        )

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        _running.set(None)
        if isinstance(exception, JobCancelled):
            events.emit(
                CancelledStopped(
                    message_id=message.message_id, actor_name=message.actor_name, queue_name=message.queue_name
                )
            )
            backing = self.backing(broker)
            try:
                with backing.database.autocommit() as conn:
                    conn.execute(_sql.query("cancel_stopped", backing.schema), {"message_id": message.message_id})
            except Exception:
                # Only the "stopped" note for 'jobs show' is lost: the message is acked all the same.
                logger.exception("could not record that cancelled message %s stopped", message.message_id)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        _running.set(None)

    def _look_up(self, backing: Backing, message_id: str) -> str | None:
        with backing.database.autocommit() as conn:
            if not self._ready:
                ensure_ready(conn, schema=backing.schema, required=CANCEL_VERSION, feature="job cancellation")
                self._ready = True
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(_sql.rendered("cancel_check", backing.schema), {"message_id": message_id})
                .fetchone()
            )
            if row is not None:
                conn.execute(_sql.query("cancel_skipped", backing.schema), {"message_id": message_id})
        return None if row is None else str(row["cancelled_by"])


def is_cancelled() -> bool:
    """Whether the running job's message was cancelled (``jobs cancel``) since it started.

    Call it from a long actor between steps and return (or raise
    :class:`~dramatiq_reliable.errors.JobCancelled`, as :func:`check_cancelled` does) when it
    says so.  Cheap enough for a tight loop: it looks the message up at most once per
    ``check_interval_ms`` of :class:`Cancellation` and answers from the last look-up in between;
    once true it stays true.  Raises :class:`~dramatiq_reliable.errors.NoCurrentJob` outside an
    actor run by a worker with the ``Cancellation`` middleware, and
    :class:`~dramatiq_reliable.errors.DatabaseUnavailable` if Postgres cannot be reached (the job
    then fails and is retried, as for any error it raises).
    """
    running = _running.get()
    if running is None:
        raise NoCurrentJob(
            "is_cancelled() was called outside a job run by a worker with the Cancellation middleware; "
            "add Cancellation() to the broker's middleware list and call it from inside an actor"
        )
    if running.cancelled:
        return True
    now = time.monotonic()
    if now - running.checked_at < running.interval_s:
        return False
    try:
        with running.database.autocommit() as conn:
            row = conn.execute(_sql.rendered("cancel_check", running.schema), {"message_id": running.message_id})
            running.cancelled = row.fetchone() is not None
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(
            f"could not check whether message {running.message_id} was cancelled: Postgres is unreachable ({error})"
        ) from error
    running.checked_at = now
    return running.cancelled


def check_cancelled() -> None:
    """Raise :class:`~dramatiq_reliable.errors.JobCancelled` if the running job was cancelled.

    A checkpoint for long jobs: the exception unwinds the actor, its transaction (under
    transactional ``Idempotency``) rolls back, and the message is acked without a retry or a
    dead letter.  Same cost and rules as :func:`is_cancelled`.
    """
    if is_cancelled():
        running = _running.get()
        message_id = running.message_id if running is not None else "?"
        raise JobCancelled(f"job {message_id} was cancelled while it ran; it stopped at a cancel check")
