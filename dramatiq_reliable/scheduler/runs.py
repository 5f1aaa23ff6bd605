"""Worker-side run state of scheduled messages, so the overlap policy reads what really runs.

The scheduler loop marks a tick ``enqueued`` when it writes the message.  Without this
middleware nothing moves it on, and the overlap policy can only wait for ``stale_after_ms``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from dramatiq import Middleware
from dramatiq.broker import Broker, MessageProxy

from .. import _sql
from .._checks import check_ms
from .._util import first_line, redact
from ..backing import backing_of
from ..database import Database, DatabaseLike

__all__ = ["ScheduleRuns"]

logger = logging.getLogger("dramatiq_reliable.scheduler")

_SKIPPED_ATTR = "_dramatiq_reliable_schedule_skipped"


class ScheduleRuns(Middleware):
    """Records ``schedule_ticks.state`` for messages the scheduler sent (options carry ``schedule``).

    ``running`` before the actor runs; after it, ``succeeded``, ``retrying`` (it raised and the
    retry middleware enqueued another attempt), ``failed`` (it raised and will not run again)
    or ``skipped`` (a middleware skipped it).  The retry decision is read from ``message.failed``,
    which ``ClassifiedRetries`` sets in its after-hook: it is last in the list (see
    ``docs/middleware-order.md``), so its after-hook runs before this one.  Place this
    middleware before ``Idempotency``, so ``succeeded`` is written after the job's commit.

    It never fails the job: a Postgres error while recording is logged and the message goes on.
    The tick then stays ``enqueued`` or ``running``, and the schedule's ``stale_after_ms`` bounds
    how long that can hold back the next tick.  A finished state is never reopened by a late
    duplicate delivery (the SQL refuses it).

    Parameters:
      database: where the ticks live (default: the broker's ``database``).
      schema: their Postgres schema (default: the broker's ``schema``).
      timeout_ms: the most one record may take (pool wait and statement), since it runs on the
        worker thread.

    >>> middleware = build_middleware(middleware=[ScheduleRuns(), Idempotency()])   # doctest: +SKIP
    """

    def __init__(
        self, *, database: DatabaseLike | None = None, schema: str | None = None, timeout_ms: int = 2000
    ) -> None:
        check_ms("timeout_ms", timeout_ms, minimum=1, fix="pass e.g. timeout_ms=2000")
        self._database = Database.of(database) if database is not None else None
        # Only a pool made here from a URL is closed here.
        self._owned = self._database if isinstance(database, str) else None
        self._schema = _sql.validate_schema(schema) if schema is not None else None
        self.timeout_ms = timeout_ms

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        if _scheduled(message):
            self.record(broker, message.message_id, "running")

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        if _scheduled(message):
            with contextlib.suppress(AttributeError, dataclasses.FrozenInstanceError):
                setattr(message, _SKIPPED_ATTR, True)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        if not _scheduled(message):
            return
        if exception is None:
            state = "failed" if message.failed else "succeeded"
        else:
            state = "failed" if message.failed else "retrying"
        self.record(broker, message.message_id, state)

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        # A skipped message is acked without after_process_message.
        if _scheduled(message) and getattr(message, _SKIPPED_ATTR, False):
            self.record(broker, message.message_id, "skipped")

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        if _scheduled(message) and getattr(message, _SKIPPED_ATTR, False):
            self.record(broker, message.message_id, "failed")

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self._owned is not None:
            self._owned.close()

    def record(self, broker: Broker, message_id: str, state: str) -> bool:
        """Write ``state`` for the tick of ``message_id``; return False (logged) when it could not."""
        try:
            database, schema_name = self._target(broker)
            with database.connection(timeout_ms=self.timeout_ms) as conn, conn.transaction():
                _sql.set_local_timeouts(conn, statement_timeout_ms=self.timeout_ms)
                conn.execute(_sql.query("schedule_run_state", schema_name), {"state": state, "message_id": message_id})
        except Exception as error:
            logger.warning(
                "could not record run state %r of scheduled message %s (%s: %s); the schedule's "
                "stale_after_ms bounds how long this holds back its next tick",
                state,
                message_id,
                type(error).__name__,
                redact(first_line(error)),
            )
            return False
        return True

    def _target(self, broker: Broker) -> tuple[Database, str]:
        backing = backing_of(broker, needed_by="ScheduleRuns", database=self._database, schema=self._schema)
        return backing.database, backing.schema


def _scheduled(message: MessageProxy) -> bool:
    return isinstance(message.options.get("schedule"), str)
