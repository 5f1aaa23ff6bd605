"""The middleware both ``Batches`` and ``Workflows`` are: mark each finished member, or fail closed.

A batch's child and a workflow's step finish the same way: the after-hook writes "this one is
done" in the job's transaction when ``Idempotency`` bound one, else on a connection of its own,
tried again and then failed into the dead letters (see ``_failclosed``); a death is written
alone from ``after_nack``.  Only the write itself differs (a count that may ride on the job's
COMMIT, or a mark that sends the next stage), so that is all a subclass supplies, in
:meth:`MarkingMiddleware._mark`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from .._checks import check_ms
from ..backing import backing_of
from ..binding import bound_connection
from ..database import Database
from ..outbox.wake import channel
from ._failclosed import DEFAULT_WRITE_TIMEOUT_MS, FailedClosed, dead_unrecorded, left_to_commit

#: Where a batch's or workflow's rows live and where the messages it sends later go: the
#: database, the schema, and the ``target``/``channel`` parameters of the SQL that sends them.
Target = tuple[Database, str, dict[str, str]]


def target(broker: Broker, needed_by: str) -> Target:
    """The :data:`Target` of ``broker``; raises ``ConfigurationError`` naming ``needed_by`` if it is not backed."""
    backing = backing_of(broker, needed_by=needed_by)
    return backing.database, backing.schema, {"target": backing.sends_to, "channel": channel(backing.schema)}


class MarkingMiddleware(Middleware):
    """Call :meth:`_mark` once a member (a batch's child, a workflow's step) finishes or dies.

    Subclasses set the class attributes that name what they mark, and write the mark in
    :meth:`_mark`; the hooks, the fail-closed path and the per-broker target cache are here.
    """

    #: The message option naming the batch or workflow a message belongs to.
    option: ClassVar[str]
    #: ``"batch"`` or ``"workflow"``: how log lines and errors name the one a message belongs to.
    kind: ClassVar[str]
    #: ``"child"`` or ``"step"``: how the ``write_timeout_ms`` error names a member.
    member: ClassVar[str]
    #: The middleware's name, as ``ConfigurationError`` names it for a broker with no Postgres.
    needed_by: ClassVar[str]
    #: Logged at worker boot when the middleware comes before ``Idempotency`` (so it writes late).
    comes_first: ClassVar[str]
    #: The subclass's module logger, which the ``comes_first`` warning goes to.
    logger: ClassVar[logging.Logger]

    def __init__(self, *, write_timeout_ms: int = DEFAULT_WRITE_TIMEOUT_MS) -> None:
        self.write_timeout_ms = check_ms(
            "write_timeout_ms",
            write_timeout_ms,
            minimum=1,
            fix=f"e.g. 30_000; past it the {self.member}'s message is failed",
        )
        self._targets: dict[int, Target] = {}
        self._lock = threading.Lock()
        self._failed_closed = FailedClosed()

    def _target_of(self, broker: Broker) -> Target:
        with self._lock:
            if id(broker) not in self._targets:
                self._targets[id(broker)] = target(broker, self.needed_by)
            return self._targets[id(broker)]

    def _mark(
        self, broker: Broker, message: MessageProxy, *, dead: bool, result: Any, conn: psycopg.Connection[Any] | None
    ) -> None:
        """Write that ``message``'s member finished (or died) in ``conn``'s transaction, or on a connection of its own."""
        raise NotImplementedError

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        # A message another hook failed without raising is nacked: its after_nack marks it dead.
        if exception is None and not message.failed and self.option in message.options:
            conn = bound_connection()
            what = f"{self.kind} {message.options[self.option]!r}"
            if conn is not None:
                try:
                    self._mark(broker, message, dead=False, result=result, conn=conn)
                except Exception as error:
                    if left_to_commit(conn):
                        raise  # the job's commit fails, and it is retried or dead-lettered
                    # The job would commit without its mark (or a workflow's mark without the next
                    # stage, a send refused by a before_enqueue hook): fail it, and Idempotency rolls it back.
                    self._failed_closed.fail(message, error, what=what, timeout_ms=None)
                return
            try:
                self._mark(broker, message, dead=False, result=result, conn=None)
            except Exception as error:
                # Dramatiq would log this and ack the message: the batch or workflow would wait for ever.
                self._failed_closed.fail(message, error, what=what, timeout_ms=self.write_timeout_ms)

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        # The worker gave up on it: its job transaction rolled back, so the death is recorded alone.
        if self.option in message.options and not self._failed_closed.take(message):
            try:
                self._mark(broker, message, dead=True, result=None, conn=None)
            except Exception as error:
                # Nacked already: nothing to fail.  The batch or workflow waits until its dead letter is replayed.
                dead_unrecorded(message, error, what=f"{self.kind} {message.options[self.option]!r}")

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        names = [type(m).__name__ for m in broker.middleware]
        if (
            "Idempotency" in names
            and self in broker.middleware
            and names.index("Idempotency") > broker.middleware.index(self)
        ):
            self.logger.warning(self.comes_first)
