"""The DeadLetters middleware: captures every message that fails for good, before its nack."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name, xq_name
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from .. import events
from .._checks import check_int, check_ms
from .._util import first_line as _first_line
from ..backing import backing_of
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError, JobCancelled
from .analysis import _as_int, _describe_failure
from .protocol import DeadLetterStore
from .records import (
    _PRIOR_ATTR,
    _RAN_ATTR,
    FIRST_FAILURE_OPTION,
    DeadLetter,
    DeadLetterCaptured,
    DeadLetterCaptureFailed,
    notify_channel,
)
from .store import PostgresDeadLetterStore

__all__ = ["DeadLetters"]

logger = logging.getLogger("dramatiq_reliable.dead_letters")


class DeadLetters(Middleware):
    """Writes every message that fails for good to the ``dead_letters`` table.

    It captures every way a message dies, because it hooks the nack itself rather than the
    reasons for it: retries exhausted, ``Unrecoverable`` or another error classified permanent
    by ``ClassifiedRetries``, an actor's ``throws``, ``AgeLimit``, ``TimeLimit`` (after its
    retries), and messages for an actor this worker does not know.

    **Never lose the message.**  The row is written in ``before_nack``, from the message and
    exception the worker holds in memory (the ``.XQ`` copy has a stale retry count and
    traceback), *before* the nack reaches RabbitMQ:

    * if the write fails (Postgres down, schema not migrated), the failure is logged at
      CRITICAL with the message id and emitted as :class:`DeadLetterCaptureFailed`, the hook
      returns normally and the nack still happens: the message is in the ``.XQ`` queue;
    * if the worker dies between the write and the nack, RabbitMQ redelivers the message; if
      it dies again, the row is refreshed (``captures`` counts it), never doubled.

    Writing after the nack (``after_nack``) would open the opposite window: a crash between the
    nack and the write leaves the message in ``.XQ`` only.  The hook raises nothing: Dramatiq
    would skip the nack for a ``MiddlewareError``.

    **Where it goes** in the middleware list: anywhere before the retry middleware, which must
    stay last; after ``Tracing``, so the trace context is in the stored options (the whole
    list: docs/middleware-order.md).

    Parameters:
      database: where to write (a URL, a pool or a ``Database``); by default the
        ``OutboxBroker``'s pool.
      schema: the schema of the tables; by default the ``OutboxBroker``'s (else
        ``dramatiq_reliable``).
      on_dead_letter: called with each stored :class:`DeadLetter`, in the worker thread, after
        the row committed (alerting); its exceptions are logged and ignored.
      timeout_ms: longest wait for a pooled connection (when this middleware owns the pool) and
        for the insert, so an outage delays a nack by at most about this long.
      max_traceback_chars: longer tracebacks keep their head and tail.
      store: a :class:`~.protocol.DeadLetterStore` to write to instead of Postgres, e.g.
        ``dramatiq_reliable.testing.InMemoryDeadLetterStore()`` in unit tests under ``StubBroker``.

    >>> broker = OutboxBroker(url=..., database=..., middleware=build_middleware(  # doctest: +SKIP
    ...     middleware=[AgeLimit(), TimeLimit(), ShutdownNotifications(), Idempotency(),
    ...                 DeadLetters(on_dead_letter=page_the_on_call)],
    ...     retries=ClassifiedRetries()))
    """

    def __init__(
        self,
        *,
        database: DatabaseLike | None = None,
        schema: str | None = None,
        on_dead_letter: Callable[[DeadLetter], None] | None = None,
        timeout_ms: int = 5000,
        max_traceback_chars: int = 64 * 1024,
        store: DeadLetterStore | None = None,
    ) -> None:
        if store is not None and (database is not None or schema is not None):
            raise ConfigurationError("pass store= or database=/schema= to DeadLetters, not both")
        if schema is not None:
            notify_channel(schema)
        if on_dead_letter is not None and not callable(on_dead_letter):
            raise ConfigurationError(f"on_dead_letter must be a callable taking a DeadLetter, got {on_dead_letter!r}")
        check_ms("timeout_ms", timeout_ms, allow_none=False, fix="e.g. timeout_ms=5000", minimum=1)
        check_int("max_traceback_chars", max_traceback_chars, minimum=1000, fix="e.g. 65536")
        self.schema = schema
        self.on_dead_letter = on_dead_letter
        self.timeout_ms = timeout_ms
        self.max_traceback_chars = max_traceback_chars
        self._database = database if isinstance(database, Database) else None
        self._owned_database: Database | None = None
        if database is not None and not isinstance(database, Database):
            self._owned_database = Database.of(database, max_size=4, timeout_ms=timeout_ms)
        self._store: DeadLetterStore | None = store
        self._lock = threading.Lock()

    def store(self, broker: Broker) -> DeadLetterStore:
        """The store this middleware writes to (built on first use)."""
        if self._store is not None:
            return self._store
        with self._lock:
            if self._store is None:
                backing = backing_of(
                    broker,
                    needed_by="DeadLetters",
                    database=self._owned_database or self._database,
                    schema=self.schema,
                )
                self._store = PostgresDeadLetterStore(
                    database=backing.database, schema=backing.schema, replay_to=backing.sends_to
                )
            return self._store

    # -- lifecycle -----------------------------------------------------------------------------

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        # Say so at boot, not at the first failure, if nothing will be stored; in a thread, so
        # an unreachable Postgres does not hold up the worker's start.
        threading.Thread(
            target=self._check_at_boot, args=(broker,), name="dramatiq-reliable-dead-letters-check", daemon=True
        ).start()

    def _check_at_boot(self, broker: Broker) -> None:
        try:
            store = self.store(broker)
            store.check_ready()
        except Exception as error:
            logger.critical(
                "dead letters will NOT be stored in Postgres (%s: %s); failed messages go only to RabbitMQ's "
                ".XQ queues until this is fixed",
                type(error).__name__,
                _first_line(error),
            )

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self._owned_database is not None:
            self._owned_database.close()

    # -- what the capture needs from earlier hooks ---------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int) -> None:
        # The first retry is enqueued right after the first failure, whose time the retry
        # middleware put in requeue_timestamp; later retries overwrite that, so keep a copy.
        options = message.options
        if FIRST_FAILURE_OPTION not in options:
            first = _as_int(options.get("requeue_timestamp"))
            if first is not None:
                options[FIRST_FAILURE_OPTION] = first

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        # The retry middleware increments "retries" in its after-hook, before the nack: keep the
        # count as the delivery arrived to know how many times the actor ran.
        # try/except, not contextlib.suppress: this runs for every message, a failure for none.
        try:  # noqa: SIM105
            setattr(message, _PRIOR_ATTR, _as_int(message.options.get("retries")) or 0)
        except (AttributeError, dataclasses.FrozenInstanceError):
            pass

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        try:  # noqa: SIM105 (see before_process_message)
            setattr(message, _RAN_ATTR, True)
        except (AttributeError, dataclasses.FrozenInstanceError):
            pass

    # -- the capture ---------------------------------------------------------------------------

    def before_nack(self, broker: Broker, message: MessageProxy) -> None:
        """Store the dying message; never raises, so the nack always follows."""
        if isinstance(getattr(message, "_exception", None), JobCancelled):
            # A cancelled job is not a failure to fix or replay (ClassifiedRetries acks it); if
            # another middleware failed it anyway, it must not come back through a replay.
            logger.warning("cancelled message %s was nacked; not storing it as a dead letter", message.message_id)
            return
        try:
            self.capture(broker, message)
        except Exception:  # pragma: no cover - capture() already catches; belt and braces
            logger.critical("dead letter capture of message %s failed", getattr(message, "message_id", "?"))

    def capture(self, broker: Broker, message: MessageProxy) -> DeadLetter | None:
        """Write ``message`` (failed, with its stuffed exception) to the store; return the row,
        or ``None`` when it could not be written (then logged at CRITICAL)."""
        message_id = str(getattr(message, "message_id", "?"))
        actor_name = str(getattr(message, "actor_name", "?"))
        queue_name = q_name(str(getattr(message, "queue_name", "?")))
        try:
            exception = getattr(message, "_exception", None)
            failure = _describe_failure(
                message.asdict(),
                exception if isinstance(exception, BaseException) else None,
                ran=bool(getattr(message, _RAN_ATTR, False)),
                prior_retries=_as_int(getattr(message, _PRIOR_ATTR, None)),
                throws=_throws(broker, message),
                max_traceback_chars=self.max_traceback_chars,
            )
            if not failure.exact:
                logger.warning(
                    "message %s has values JSON cannot hold exactly (NUL characters, NaN, objects); its dead "
                    "letter stores a readable copy, and a replay would send that copy",
                    message_id,
                )
            dead_letter = self.store(broker).save(failure, timeout_ms=self.timeout_ms)
        except Exception as error:
            logger.critical(
                "dead letter of message %s (actor %r, queue %r) was NOT stored in Postgres: %s: %s; "
                "the message is only in RabbitMQ's dead-letter queue %r",
                message_id,
                actor_name,
                queue_name,
                type(error).__name__,
                _first_line(error),
                xq_name(queue_name),
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            events.emit(
                DeadLetterCaptureFailed(
                    message_id=message_id,
                    actor_name=actor_name,
                    queue_name=queue_name,
                    dead_letter_queue=xq_name(queue_name),
                    error=f"{type(error).__name__}: {_first_line(error)}",
                )
            )
            return None
        events.emit(
            DeadLetterCaptured(
                dead_letter_id=dead_letter.id,
                message_id=dead_letter.message_id,
                actor_name=dead_letter.actor_name,
                queue_name=dead_letter.queue_name,
                error_type=dead_letter.error_type,
                reason=dead_letter.reason,
                attempts=dead_letter.attempts,
                fingerprint=dead_letter.fingerprint,
                captures=dead_letter.captures,
            )
        )
        if self.on_dead_letter is not None:
            try:
                self.on_dead_letter(dead_letter)
            except Exception:
                logger.exception(
                    "on_dead_letter hook %r failed for dead letter %d; the dead letter is stored",
                    self.on_dead_letter,
                    dead_letter.id,
                )
        return dead_letter


def _throws(broker: Broker, message: MessageProxy) -> Any:
    throws = message.options.get("throws")
    if throws:
        return throws
    try:
        return broker.get_actor(message.actor_name).options.get("throws")
    except ActorNotFound:
        return None
