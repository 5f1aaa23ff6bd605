"""The failure record: one ``job_attempts`` row per message that failed, upserted on each failure.

:class:`~dramatiq_reliable.ClassifiedRetries` calls :func:`record_failure` after it has decided
a failed attempt's fate, on any Postgres-backed broker (``OutboxBroker``, ``PostgresBroker``:
found through :func:`~dramatiq_reliable.backing.postgres_backed`).  A job that never fails writes
nothing here, so the happy path pays nothing.

Which transaction: its own, one autocommit statement on the broker's pool, written *before*
the retry (or the dead letter), so ``jobs show`` never loses sight of a message between its
failed attempt and its retry.  It cannot be the job's own transaction: a job that failed has
its transaction rolled back (``Idempotency`` ends it before anything is sent for a failed
message, so the retry is not written into it either).  Recording never raises: a record that
cannot be written is logged, and the retry or the dead letter goes ahead as if it had been.

Retention: a record is kept for ``retention_ms`` (7 days by default) after its latest failure,
whatever became of the job (done, dead or cancelled), so "done after 3 attempts, last error X"
stays answerable for a week; ``dramatiq-reliable idempotency purge`` (and its purge actor)
deletes expired records with the expired keys.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

import psycopg
from dramatiq.broker import Broker, MessageProxy

from .. import _sql
from ..backing import postgres_backed
from ..database import Database

__all__ = ["DEFAULT_FAILURE_RETENTION_MS", "purge_attempts", "record_failure"]

logger = logging.getLogger("dramatiq_reliable.jobs")

#: A week: long enough to answer "why did this job take three tries" after the weekend.
DEFAULT_FAILURE_RETENTION_MS = 7 * 24 * 60 * 60 * 1000
# Long error messages are cut: the dead letter keeps the whole traceback of a job that dies.
_MAX_ERROR_CHARS = 2000
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def trace_id_of(options: dict[str, Any]) -> str | None:
    """The W3C trace id of the message's creation context (``options["trace_context"]``), if any."""
    context = options.get("trace_context")
    if not isinstance(context, dict):
        return None
    match = _TRACEPARENT.match(str(context.get("traceparent", "")))
    return match[1] if match else None


def error_where(error: BaseException) -> str | None:
    """The innermost frame of ``error``'s traceback, for people: ``"app/tasks.py:42 in send_email"``."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def record_failure(
    broker: Broker,
    message: MessageProxy,
    exception: BaseException,
    decision: dict[str, Any],
    *,
    retention_ms: int = DEFAULT_FAILURE_RETENTION_MS,
) -> bool:
    """Upsert ``message``'s failure record from the retry ``decision``; ``True`` if it was written.

    ``decision`` is the dict stored under ``message.options["retry_decision"]``.  Does nothing on
    a broker that is not Postgres-backed, and never raises (see the module docstring).
    """
    backed = postgres_backed(broker)
    if backed is None:
        return False
    text = str(exception)
    params = {
        "message_id": message.message_id,
        "queue_name": message.queue_name.removesuffix(".DQ").removesuffix(".XQ"),
        "actor_name": message.actor_name,
        "attempts": int(decision.get("attempt") or 1),
        "max_retries": decision.get("max_retries"),
        "outcome": str(decision.get("outcome") or "fail"),
        "reason": str(decision.get("reason") or ""),
        "error_type": decision.get("error_type") or type(exception).__name__,
        "error_message": text[:_MAX_ERROR_CHARS].replace("\x00", ""),
        "error_where": error_where(exception),
        "delay_ms": decision.get("delay_ms") if decision.get("outcome") == "retry" else None,
        "trace_id": trace_id_of(message.options),
        "retention_ms": retention_ms,
    }
    try:
        _write(backed.database, backed.schema, params)
    except Exception:
        logger.exception(
            "could not write the failure record of message %s (run 'dramatiq-reliable migrate'?); "
            "its retry or dead letter is not affected",
            message.message_id,
        )
        return False
    return True


def _write(database: Database, schema: str, params: dict[str, Any]) -> None:
    with database.autocommit() as conn:
        conn.execute(_sql.rendered("job_attempts_record", schema), params)


def purge_attempts(conn: psycopg.Connection[Any], schema: str, *, batch_size: int) -> int:
    """Delete expired failure records in batches on the autocommit ``conn``; return how many."""
    total = 0
    while True:
        deleted = conn.execute(_sql.query("job_attempts_purge", schema), {"batch_size": batch_size}).rowcount
        total += deleted
        if deleted < batch_size:
            return total
