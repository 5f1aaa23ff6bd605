"""Fail closed when a finished child or step cannot be written on a connection of its own.

With no job transaction bound (no ``Idempotency``, or its record mode), ``Batches`` and
``Workflows`` write "this one is done" after the actor returned, on their own connection.
Dramatiq logs and swallows whatever an after-hook raises and acks the message, so a write lost
to a Postgres outage would leave the batch or workflow waiting for ever.  Instead:

1. the write is tried again, with backoff, while the worker holds the message, for up to
   ``write_timeout_ms``: each write is idempotent per child or step (a second one finds the mark
   and does nothing), so a retry after a connection broke mid-commit counts once;
2. past that, the message is failed (nacked, so it lands in the dead letters) instead of acked,
   and not recorded as a dead child or step, because its actor succeeded.  Replaying the dead
   letter runs the actor again and writes the mark once.  ``Idempotency`` stores no key for a
   message failed this way (record mode), so the replay is not skipped as a duplicate.

In the job's transaction (transactional ``Idempotency``), an error that aborted it or lost its
connection (in the mark or in the next stage's send) lets the job's commit fail and decide: a
retry, as for any job whose commit failed; an error that leaves it able to commit (a next stage
refused by a ``before_enqueue`` hook) would let the job commit without its mark, so the message
is failed and ``Idempotency`` rolls the job back.  A death (``after_nack``) is written the same way, but the message is nacked
already: a death that cannot be written is logged, and the dead letter's replay counts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from dramatiq.broker import MessageProxy
from psycopg_pool import PoolTimeout

from .._util import first_line, redact
from ..errors import DatabaseUnavailable, SchemaNotReady

logger = logging.getLogger("dramatiq_reliable.workflows")

T = TypeVar("T")

#: How long a finished child or step is written again before its message is failed.
DEFAULT_WRITE_TIMEOUT_MS = 30_000
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 2.0
#: Errors a later try may not meet: Postgres down or restarting, a pool out of connections, a
#: table missing until a migration or a rename is undone.
_RETRIED = (psycopg.Error, PoolTimeout, SchemaNotReady)


def write_until(write: Callable[[], T], *, timeout_ms: int, what: str) -> T:
    """Run ``write`` (one whole transaction) until it succeeds or ``timeout_ms`` has passed.

    Raises the last error once the next pause would end past the deadline.
    """
    deadline = time.monotonic() + timeout_ms / 1000
    pause = _FIRST_PAUSE_S
    while True:
        try:
            return write()
        except _RETRIED as error:
            if time.monotonic() + pause >= deadline:
                raise
            logger.warning(
                "%s failed (%s: %s); trying again in %d ms",
                what,
                type(error).__name__,
                redact(first_line(error)),
                pause * 1000,
            )
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)


def left_to_commit(conn: psycopg.Connection[Any]) -> bool:
    """Whether the error just raised left the job's transaction unable to commit.

    Then ``Idempotency``'s commit fails and decides, as for any job whose commit failed (a
    serialization failure retried, a broken connection retried as an unknown outcome).  Any
    other error would let the job commit without its mark, so the caller fails the message.

    The connection decides, not the error's type: the next stage's send wraps the driver's error
    (``OutboxWriteError``), and a connection lost there (a Postgres restart, a network cut) must
    be retried like one lost in the mark itself, not failed into the dead letters.  A connection
    that still looks healthy (the error came from elsewhere) could commit, so it still fails.
    """
    return conn.closed or conn.broken or conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR


def dead_unrecorded(message: MessageProxy, error: BaseException, *, what: str) -> None:
    """Log, naming the fix, a death that could not be written after the message was nacked."""
    logger.error(
        "%s: message %r (%s) died, but its death could not be written: %s: %s; the message is in the dead "
        "letters, replay it once Postgres is reachable (it runs again and is counted once)",
        what,
        message.message_id,
        message.actor_name,
        type(error).__name__,
        redact(first_line(error)),
    )


class FailedClosed:
    """The messages this process failed because their mark could not be written.

    Their nack follows in the consumer thread; ``after_nack`` must not record them as dead
    (their actor succeeded), so it asks :meth:`take`.
    """

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def fail(self, message: MessageProxy, error: BaseException, *, what: str, timeout_ms: int | None) -> None:
        """Fail ``message`` (nacked into the dead letters, not acked) and log why, naming the fix.

        ``timeout_ms`` is how long a write on a connection of its own was tried; ``None`` for a
        write in the job's transaction, which ``Idempotency`` then rolls back (the message failed).
        """
        how = "in the job's transaction (rolled back)" if timeout_ms is None else f"for {timeout_ms} ms"
        fix = (
            "replay it once the error is fixed"
            if timeout_ms is None
            else "replay it once Postgres is reachable (the actor runs again and is counted once), or add Idempotency "
            "in transactional mode so the mark commits with the job"
        )
        failure = DatabaseUnavailable(
            f"{what}: the actor of message {message.message_id!r} ({message.actor_name}) returned, but its mark could "
            f"not be written {how}: {type(error).__name__}: {redact(first_line(error))}; the message was failed, not "
            f"acked, so it is kept in the dead letters: {fix}"
        )
        failure.__cause__ = error
        with self._lock:
            self._ids.add(str(message.message_id))
        message.stuff_exception(failure)
        message.fail()
        logger.error("%s", failure)

    def take(self, message: MessageProxy) -> bool:
        """Whether ``message`` was failed here (forgotten once asked)."""
        with self._lock:
            if str(message.message_id) in self._ids:
                self._ids.discard(str(message.message_id))
                return True
            return False
