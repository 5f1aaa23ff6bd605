"""Consumers of Postgres queues: claims with SKIP LOCKED, each consumer waking itself.

Producers send consumers nothing: a queue insert that notified would take Postgres's
cluster-wide NOTIFY lock at commit and serialise every producer's commit with every other's
(a fifth of the commits at 1 connection and most of them at 16 before migration 18 dropped
the queue trigger, docs/performance.md; migration 6 dropped the outbox's for the same reason).  Instead each consumer polls for itself, as the outbox relay
does (:mod:`dramatiq_reliable.outbox.wake`): a claim that found rows claims again at once; an
empty one sleeps a short, slowly growing, jittered delay (about 1 ms first, a quarter longer
each time) up to the broker's ``poll_interval_ms``.  While messages flow, a committed row is
claimed within a few milliseconds whichever process or plain SQL statement inserted it; the
first row after a long idle waits at most ``poll_interval_ms``.  No wake-up can be lost for
longer than that, since the poll is the mechanism, not a fallback.  And a delayed row is
claimed when due: before a long sleep an idle consumer asks when the queue's next row falls due
and sleeps only until then (:meth:`PostgresConsumer._until_due`).

Three things end a sleep early and start the backoff again from 1 ms:

* a send by this process (``PostgresBroker`` wakes its own consumers of the queue: free, no
  round trip; a send in a transaction still to commit is found by the fast probes that follow);
* a lease given back or acked in this process (room under the prefetch);
* a ``NOTIFY`` on ``"<schema>.queue"`` heard by the broker's one ``LISTEN`` connection, with a
  queue name as payload (that queue) or an empty one (every queue): for a bulk load or an
  operator's script, which pay the commit lock once per batch (:func:`wake_consumers`).

Behind PgBouncer in transaction mode without ``listen_database`` no ``LISTEN`` is held and only
explicit notifications are lost: consumers find rows exactly as fast.

Consumers claim nothing until the broker's :class:`~.readiness.SchemaGate` finds the queue
table: on an unmigrated schema a worker logs one error and waits for the migration.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.common import q_name, xq_name
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from psycopg import sql
from psycopg_pool import PoolTimeout

from .. import _sql
from .._util import first_line
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError
from ..outbox.wake import FIRST_IDLE_S, idle_delay_s
from ..pooler import listen_target
from . import queue

if TYPE_CHECKING:
    from .broker import PostgresBroker

__all__ = ["wake_consumers"]

logger = logging.getLogger("dramatiq_reliable.postgres")

#: An idle consumer asks when the next delayed row falls due before a sleep this long or longer
#: (shorter sleeps end sooner than the probe would help).
PROBE_FROM_S = 0.02
#: Woken this long after the due time: the claim compares with its own start, a moment later.
DUE_MARGIN_S = 0.001

_DB_ERRORS = (psycopg.Error, PoolTimeout)


def channel(schema: str) -> str:
    """The NOTIFY channel the consumers of ``schema`` listen on: ``"<schema>.queue"``."""
    return f"{schema}.queue"


def wake_consumers(
    conn: psycopg.Connection[Any], *, schema: str = _sql.DEFAULT_SCHEMA, queue_name: str | None = None
) -> None:
    """Wake the idle consumers of ``queue_name`` (of every queue when ``None``) in every worker now.

    Sends never need it: a consumer finds committed rows by itself within the broker's
    ``poll_interval_ms`` (milliseconds while messages flow).  It is for rows written around the
    broker that should not wait out a long ``poll_interval_ms`` after an idle spell: a bulk
    load, a script's plain ``INSERT``.  Sent on ``conn``: inside a transaction it is delivered
    when that transaction commits (never if it rolls back), so call it in the transaction that
    wrote the rows, once per batch; notifying takes a server-wide lock at commit, which is the
    tax a NOTIFY per producer transaction would put on every producer.

    >>> with broker.transaction() as conn:                  # doctest: +SKIP
    ...     load_many_rows(conn)
    ...     wake_consumers(conn, schema=broker.schema, queue_name="default")
    """
    name = _sql.validate_schema(schema)
    # Consumers are registered under the canonical name: a ".DQ" name wakes its queue.
    payload = q_name(queue_name) if queue_name else ""
    conn.execute(_sql.query("queue_wake", name), {"channel": channel(name), "queue_name": payload})


class Listener:
    """The broker's one ``LISTEN`` connection, turning notifications into per-queue wake-ups.

    A notification's payload names the queue to wake; an empty one wakes every queue.
    ``on_notify`` is called before the wake-up of every notification (the broker's schema gate:
    a notification proves the queue table exists).  ``listen_database`` holds the ``LISTEN``
    connection when ``database`` is behind a transaction pooler; without it, there, no listener
    runs and the consumers poll (:func:`~dramatiq_reliable.pooler.listen_target`).
    """

    def __init__(
        self,
        database: Database,
        schema: str,
        *,
        on_notify: Callable[[], None] | None = None,
        listen_database: DatabaseLike | None = None,
    ) -> None:
        self.database = database
        self.listen_database = listen_database
        self.channel = channel(schema)
        self._on_notify = on_notify
        self._lock = threading.Lock()
        self._events: dict[str, set[threading.Event]] = collections.defaultdict(set)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()

    def register(self, queue_name: str, event: threading.Event) -> None:
        with self._lock:
            self._events[queue_name].add(event)
        self.start()

    def unregister(self, queue_name: str, event: threading.Event) -> None:
        with self._lock:
            self._events[queue_name].discard(event)

    def wake(self, queue_name: str) -> None:
        with self._lock:
            events = list(self._events.get(queue_name, ()))
        for event in events:
            event.set()

    def wake_all(self) -> None:
        with self._lock:
            events = [event for group in self._events.values() for event in group]
        for event in events:
            event.set()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dramatiq-reliable-queue-listener", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.1
        target: Database | None = None
        while not self._stop.is_set():
            try:
                if target is None:
                    target = listen_target(self.database, self.listen_database, who="PostgresBroker's queue listener")
                    if target is None:
                        return  # behind a transaction pooler: the consumers only poll
                with target.connect(autocommit=True) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    self.listening.set()
                    backoff = 0.1
                    # Rows sent while nobody listened are found by the claim that follows.
                    self.wake_all()
                    while not self._stop.is_set():
                        for notify in conn.notifies(timeout=0.5):
                            if self._on_notify is not None:
                                self._on_notify()
                            if notify.payload:
                                self.wake(notify.payload)
                            else:
                                self.wake_all()
            except psycopg.Error as error:
                self.listening.clear()
                if self._stop.is_set():
                    return
                logger.warning(
                    "queue listener lost its Postgres connection (%s: %s); consumers poll until it is back",
                    type(error).__name__,
                    first_line(error),
                )
                self.wake_all()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except ConfigurationError as error:
                logger.error("%s; the consumers poll instead", error)
                return
        self.listening.clear()


class PostgresMessage(MessageProxy):
    """A message claimed from a Postgres queue: the row it came from and the lease it is held by."""

    def __init__(self, message: Message[Any], row: queue.ClaimedRow) -> None:
        super().__init__(message)
        self.row_id = row.id
        self.lease = row.lease
        self.deliveries = row.deliveries
        #: Set when the row's fate was already written (acked in the job's transaction, or
        #: turned into its own retry): the consumer's ack then only lets go of the lease.
        self.settled = False
        #: What claim listeners learnt of this delivery when it was claimed, by listener
        #: (see :mod:`~dramatiq_reliable.postgres.claims`).
        self.notes: dict[str, Any] = {}


class PostgresConsumer(Consumer):
    """Claims up to ``prefetch`` rows of one queue at a time and hands them to Dramatiq's worker.

    Acks and nacks are called from worker threads; they write through the broker's
    :class:`~dramatiq_reliable.postgres.lease.Leases`, never through this object's state, so a
    consumer restarted after a connection error still settles the messages of the old one.
    """

    def __init__(self, broker: PostgresBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = max(1, prefetch)
        self.timeout = timeout
        self._buffer: collections.deque[PostgresMessage] = collections.deque()
        self._wake = threading.Event()
        self._token = broker._lease_tokens
        # Consecutive empty claims: the next idle sleep grows with it (see the module docstring).
        self._empty_claims = 0
        broker.listener.register(queue_name, self._wake)

    def __next__(self) -> PostgresMessage | None:
        deadline = time.monotonic() + self.timeout / 1000
        while True:
            if self._buffer:
                return self._buffer.popleft()
            self._wake.clear()
            sleep_s: float | None = None  # None: until woken (no room, or the schema is not ready)
            if self._schema_ready():
                free = self.prefetch - self.broker.leases.held_count(self.queue_name)
                if free > 0:
                    if self._claim(min(free, self.broker.claim_batch_size)):
                        self._empty_claims = 0
                        continue
                    sleep_s = idle_delay_s(
                        self._empty_claims, ceiling_s=self.broker.poll_interval_ms / 1000, first_s=FIRST_IDLE_S
                    )
                    self._empty_claims += 1
                    if sleep_s >= PROBE_FROM_S:
                        sleep_s = self._until_due(sleep_s)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._wake.wait(remaining if sleep_s is None else min(sleep_s, remaining)):
                self._empty_claims = 0  # a send or a release here: the row is near, probe fast again

    def _until_due(self, sleep_s: float) -> float:
        """``sleep_s``, or less if a delayed row falls due sooner: then just past its due time.

        Why: an idle consumer's sleep grows to ``poll_interval_ms``, and a delayed message (a
        retry's backoff, an ``eta``, a scheduler tick written ahead) sent by another process
        wakes no one, so it was claimed up to a poll interval late.  One probe before each long
        sleep (short ones are cheaper than the probe) costs an idle consumer a query per sleep.
        A row due already (locked by another consumer's claim in flight) does not shorten the
        sleep, so rows this consumer cannot take never make it spin.
        """
        try:
            with self.broker.database.autocommit() as conn:
                due_s = queue.next_due_s(conn, self.broker.schema, self.queue_name)
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as error:
            self.broker.schema_gate.lost(error)
            return sleep_s
        except _DB_ERRORS as error:
            raise ConnectionClosed(error) from error  # type: ignore[no-untyped-call]
        if due_s is None or due_s <= 0 or due_s + DUE_MARGIN_S >= sleep_s:
            return sleep_s
        return due_s + DUE_MARGIN_S

    def _schema_ready(self) -> bool:
        try:
            return self.broker.schema_gate.is_open()
        except _DB_ERRORS as error:
            raise ConnectionClosed(error) from error  # type: ignore[no-untyped-call]

    def _claim(self, limit: int) -> bool:
        lease = next(self._token)
        try:
            with self.broker.database.autocommit() as conn:
                rows = queue.claim(
                    conn,
                    self.broker.schema,
                    queue_name=self.queue_name,
                    limit=limit,
                    lease=lease,
                    lease_ms=self.broker.lease_ms,
                )
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as error:
            # Dropped while the worker ran: wait for the migration as a new worker does.
            self.broker.schema_gate.lost(error)
            return False
        except _DB_ERRORS as error:
            raise ConnectionClosed(error) from error  # type: ignore[no-untyped-call]
        if not rows:
            return False
        self.broker.leases.hold(self.queue_name, rows)
        messages = [message for message in map(self._decode, rows) if message is not None]
        if messages:
            settled = self.broker.claims.claimed(messages)
            for message in messages:
                if id(message) in settled:  # a listener dealt with it: acked unrun, as a skipped message
                    self.ack(message)
                else:
                    self._buffer.append(message)
        return True

    def _decode(self, row: queue.ClaimedRow) -> PostgresMessage | None:
        try:
            decoded = Message.decode(row.body)
        except Exception as error:
            logger.error(
                "queue row %d of %r is not a Dramatiq message (%s); moved to %r",
                row.id,
                self.queue_name,
                first_line(error),
                xq_name(self.queue_name),
            )
            self._nack_row(row.id, row.lease)
            return None
        # Delays live in available_at: the row became visible when its eta passed, so the
        # worker runs it now instead of holding it in memory, and it belongs to this queue
        # whatever delay-queue name the sender gave it.
        message = decoded.copy(queue_name=self.queue_name)
        message.options.pop("eta", None)
        return PostgresMessage(message, row)

    def ack(self, message: MessageProxy) -> None:
        if not isinstance(message, PostgresMessage):
            return
        if message.settled:
            self.broker.leases.forget(message.row_id)
            return
        self.broker.leases.ack(message.row_id, message.lease, self.queue_name)

    def nack(self, message: MessageProxy) -> None:
        if isinstance(message, PostgresMessage):
            self._nack_row(message.row_id, message.lease)

    def _nack_row(self, row_id: int, lease: int) -> None:
        try:
            with self.broker.database.autocommit() as conn:
                queue.nack(conn, self.broker.schema, row_id=row_id, lease=lease, xq_name=xq_name(self.queue_name))
        except _DB_ERRORS as error:
            # Dramatiq retries a post-process connection error until it succeeds.
            raise ConnectionClosed(error) from error  # type: ignore[no-untyped-call]
        self.broker.leases.forget(row_id)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        given = [m for m in messages if isinstance(m, PostgresMessage)]
        self.broker.claims.given_back(given)
        self._release([(m.row_id, m.lease) for m in given])

    def _release(self, held: list[tuple[int, int]]) -> None:
        if not held:
            return
        try:
            with self.broker.database.autocommit() as conn:
                queue.release(conn, self.broker.schema, held)
        except _DB_ERRORS as error:
            logger.warning(
                "could not give back %d message(s) (%s); they come back when their lease ends",
                len(held),
                type(error).__name__,
            )
        for row_id, _ in held:
            self.broker.leases.forget(row_id)

    def close(self) -> None:
        self.broker.listener.unregister(self.queue_name, self._wake)
        buffered = list(self._buffer)
        self._buffer.clear()
        self.broker.claims.given_back(buffered)
        self._release([(m.row_id, m.lease) for m in buffered])
