"""Order per key: jobs with the same ``order_key`` run one at a time, in send order, on every worker.

**At send time** the job gets its place in its key's sequence: a row in ``order_jobs`` written
in the sender's transaction, from a ``before_enqueue`` hook (the send path itself is untouched).
Senders of one key take a per-key lock until they commit, so the sequence is the order of their
commits; inside one transaction it is the order of the ``send()`` calls.  A send with nothing
bound opens a short transaction of its own for the row and the message together, so neither is
written without the other (a place whose message never came would hold the key for ever).

**At consume time** only the head of a key (its lowest place) runs, under a lease on its own
``order_jobs`` row that a heartbeat renews. On a ``PostgresBroker`` the take is made when the
consumer claims its batch (:meth:`OrderedKeys.take_claimed`), so no worker thread waits for it. A
job delivered before its turn is *parked*: its body is kept on its row and the delivery acked, so
nothing spins through the queue; the head's completion deletes its row and sends the next job again
(with its priority), in the same transaction. Completions are written in batches, as acks are. Other
keys are never held up. A failed head stays the head: a retry keeps its place and the key waits for
it; a head that dies (a dead letter) parks its key until the dead letter is replayed (the replay
runs as the head) or discarded (the heartbeat's sweep frees the key). A killed worker's lease lapses
after ``lease_ms`` and the sweep hands the key on.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import SkipMessage
from dramatiq.worker import WorkerThread
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from .. import _sql, events
from .._util import first_line, redact
from ..binding import ambient_connection, bind, bound_connection, check_joinable
from ..database import Database, DatabaseLike
from ..errors import ActorOptionError, DatabaseUnavailable
from ..idempotency._connections import autocommit
from ..postgres.claims import ClaimListeners
from ._keyed import (
    DEFAULT_LEASE_MS,
    KeyedMiddleware,
    check_key_option,
    derive_key,
    fail_closed,
    not_migrated,
    one_statement,
    parked_body,
    parked_priority,
    parked_queue,
)

__all__ = ["ORDER_SEQ_OPTION", "OrderParked", "OrderedKeys", "order_waiting"]

logger = logging.getLogger("dramatiq_reliable.flow.order")

#: The message option holding the job's place in its key's sequence (retries and replays keep it).
ORDER_SEQ_OPTION = "order_seq"
# The note a take at claim time leaves on a PostgresBroker's message (postgres/claims.py).
_NOTE = "order"
# How many keys one heartbeat frees.
_SWEEP_LIMIT = 100


@dataclasses.dataclass(frozen=True)
class OrderParked(events.Event):
    """A job was delivered before its turn (or while its key's head runs) and waits in Postgres."""

    name = "order.parked"
    actor_name: str
    message_id: str
    key: str
    seq: int


@dataclasses.dataclass
class _Head:
    key: str
    seq: int
    token: int
    message_id: str
    #: Sent again while it ran (a retry, a postponement): its row must stay.
    requeued: bool = False


_current: contextvars.ContextVar[_Head | None] = contextvars.ContextVar("dramatiq_reliable_order", default=None)
# Transactions a send opened for itself (nothing was bound), closed by after_enqueue(_failed).
_own: contextvars.ContextVar[tuple[str, contextlib.ExitStack] | None] = contextvars.ContextVar(
    "dramatiq_reliable_order_send", default=None
)


class OrderedKeys(KeyedMiddleware[_Head]):
    """Jobs of one ``order_key`` run one at a time, in send order; other keys run alongside.

    Actor option:
      order_key: a callable over the actor's arguments giving the key, e.g.
        ``lambda account_id, *_: f"account-{account_id}"``.

    A key function that raises or gives no usable string fails closed: at send time the send
    raises :class:`~dramatiq_reliable.ActorOptionError` naming the actor (nothing is written);
    a delivered message of an ordered actor that carries no place (sent by a process without
    this middleware) is not run but dead-lettered, so a replay can give it one.  ``order_key``
    cannot be combined with a ``dedupe_key`` (a duplicate writes no message, and its place would
    hold the key for ever).

    Parameters:
      database, schema: where the tables live; default the broker's (an ``OutboxBroker`` or a
        ``PostgresBroker``: a woken message is sent again as a row of its outbox or queue table).
      lease_ms: how long a running head's lease outlives a holder that stopped renewing it (a
        killed worker); the heartbeat renews every ``lease_ms / 3``.

    Add it after ``Singleton`` and
    :class:`ConcurrencyLimit` (they may postpone a message it lets run) and before
    ``Idempotency``:

    >>> broker.add_middleware(OrderedKeys())  # doctest: +SKIP
    """

    label = "OrderedKeys"
    option = "order_key"
    renew_query = "order_renew"

    def __init__(
        self, *, database: DatabaseLike | None = None, schema: str | None = None, lease_ms: int = DEFAULT_LEASE_MS
    ) -> None:
        super().__init__(database=database, schema=schema, lease_ms=lease_ms)
        # Releases waiting for the statement in flight (see _flush_releases).
        self._releasing = threading.Lock()
        self._pending: list[tuple[_Head, bool]] = []
        self._flushing = False
        # While a worker runs: the thread writing releases, so no worker thread waits for one.
        self._releaser: _Releaser | None = None
        # A PostgresBroker's claim listener, registered at the first worker boot (see take_claimed).
        self._claim_listener: _TakeAtClaim | None = None
        # Takes waiting for the statement in flight (see _run_take).
        self._taking = threading.Lock()
        self._queued: list[_Waiter] = []
        self._busy = False

    @property
    def actor_options(self) -> set[str]:
        return {"order_key"}

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        if check_key_option(actor, "order_key", "lambda account_id, *_: f'account-{account_id}'") is None:
            return
        if actor.options.get("dedupe_key") is not None:
            raise ActorOptionError(
                f"actor {actor.actor_name!r} has both order_key and dedupe_key; a deduplicated send writes no message "
                "and its place would hold the key for ever: remove one of them"
            )
        self._check_position(broker)
        self.database_for(broker)

    # -- sending ------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        held = _current.get()
        if held is not None and held.message_id == message.message_id:
            held.requeued = True
        if ORDER_SEQ_OPTION in message.options:
            return  # a retry, a postponement or a replay: it keeps its place
        derive = self._derive_of(broker, message.actor_name)
        if derive is None:
            return
        key = derive_key(derive, "order_key", message)
        if message.options.get("dedupe_key") is not None:
            raise ActorOptionError(
                f"message {message.message_id!r} of actor {message.actor_name!r} has an order_key and a dedupe_key; "
                "send it without dedupe_key"
            )
        database, schema, _ = self.database_for(broker)
        conn = bound_connection() or ambient_connection(database)
        if conn is None:
            if getattr(broker, "on_unbound", "autocommit") == "error" and not _in_worker():
                return  # the send itself raises NotBound, naming the fix
        else:
            check_joinable(conn, database, actor_name=message.actor_name)
        try:
            if conn is None:
                conn = self._open_own(database, message.message_id)
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.rendered("order_send", schema),
                    {
                        "lock": f"dramatiq_reliable.order:{schema}:{key}",
                        "key": key,
                        "message_id": message.message_id,
                        "actor_name": message.actor_name,
                    },
                )
                .fetchone()
            )
        except psycopg.errors.DeadlockDetected as error:
            # Two senders each hold a key the other waits for: the cause is their send order,
            # not the connection, so the message says so (still a DatabaseUnavailable: a
            # worker's retry of the job that sent it succeeds once the other commits).
            raise DatabaseUnavailable(
                f"could not record the place of message {message.message_id!r} of actor {message.actor_name!r} in "
                f"order key {key!r}: this transaction and another each hold a key the other waits for (ordered jobs "
                "of the same keys sent in opposite orders), and Postgres rolled this transaction back; retry the "
                "transaction, and send each transaction's ordered jobs sorted by key so it cannot happen again"
            ) from error
        except (psycopg.Error, PoolTimeout) as error:
            # A MiddlewareError (DatabaseUnavailable is one): Dramatiq swallows any other error of
            # a before-hook, and the message would be sent without its place.
            raise not_migrated(error, schema, "OrderedKeys") or DatabaseUnavailable(
                f"could not record the place of message {message.message_id!r} of actor {message.actor_name!r} in "
                f"order key {key!r}: {type(error).__name__}: {redact(first_line(error))}; the message was not sent, "
                "check the database connection and retry the transaction"
            ) from error
        assert row is not None
        message.options[ORDER_SEQ_OPTION] = int(row["seq"])

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        self._close_own(message.message_id, None)

    def after_enqueue_failed(
        self, broker: Broker, message: Message[Any], delay: int | None, *, exception: BaseException
    ) -> None:
        self._close_own(message.message_id, exception)

    def _open_own(self, database: Database, message_id: str) -> psycopg.Connection[Any]:
        stack = contextlib.ExitStack()
        try:
            conn = stack.enter_context(database.connection())
            stack.enter_context(conn.transaction())
            stack.enter_context(bind(conn))
        except BaseException:
            stack.close()
            raise
        _own.set((message_id, stack))
        return conn

    @staticmethod
    def _close_own(message_id: str, error: BaseException | None) -> None:
        own = _own.get()
        if own is None or own[0] != message_id:
            return
        _own.set(None)
        if error is None:
            own[1].close()  # commits: the place and the message together
        else:
            own[1].__exit__(type(error), error, error.__traceback__)

    def _derive_of(self, broker: Broker, actor_name: str) -> Any:
        try:
            return broker.get_actor(actor_name).options.get("order_key")
        except ActorNotFound:
            return None

    # -- running ------------------------------------------------------------------------------

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        self._check_position(broker)

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        super().after_worker_boot(broker, worker)
        if self._heartbeat is not None:  # an ordered actor is declared
            releaser = _Releaser(lambda: self._flush_releases(broker))
            with self._releasing:
                self._releaser = releaser
            releaser.start()
            claims = getattr(broker, "claims", None)
            if isinstance(claims, ClaimListeners) and self._claim_listener is None:  # once, however often it boots
                self._claim_listener = _TakeAtClaim(self, broker)
                claims.add(self._claim_listener)

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        # Jobs still running when the worker stops release on their own thread, as without a worker.
        with self._releasing:
            releaser, self._releaser = self._releaser, None
        if releaser is not None:
            releaser.stop()
        super().before_worker_shutdown(broker, worker)

    def _check_position(self, broker: Broker) -> None:
        # A MiddlewareError (ActorOptionError is one) is the only kind Dramatiq lets out of a hook.
        mine = broker.middleware.index(self) if self in broker.middleware else -1
        for index, other in enumerate(broker.middleware):
            if index > mine >= 0 and type(other).__name__ in ("Singleton", "ConcurrencyLimit"):
                raise ActorOptionError(
                    f"{type(other).__name__} comes after OrderedKeys in the broker's middleware: a message it parks "
                    "or postpones would lose its place; add OrderedKeys after it"
                )

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _current.set(None)
        if self._derive_of(broker, message.actor_name) is None:
            return
        if ORDER_SEQ_OPTION not in message.options:
            error = ActorOptionError(
                f"message {message.message_id!r} of actor {message.actor_name!r} has no place in its order_key's "
                "sequence (it was sent by a process without OrderedKeys); it was not run: add OrderedKeys to the "
                "sender's broker and replay the dead letter"
            )
            fail_closed(message, error)
        row = _claim_note(message)  # taken when its batch was claimed (a PostgresBroker)
        if row is None:
            params = self._take_params(broker, message)
            row = self._take(broker, "order_take", params, f"look up message {message.message_id!r}")
        elif row["outcome"] == "run":
            self._held.drop(message_id=message.message_id)  # now this thread's
        if row["outcome"] == "unknown":
            raise SkipMessage(f"message {message.message_id!r} is done already (its place is gone); a redelivery")
        if row["outcome"] == "parked":
            events.emit(OrderParked(message.actor_name, message.message_id, row["key"], int(row["seq"])))
            raise SkipMessage(f"order key {row['key']!r}: not its turn; the message was parked")
        head = _Head(row["key"], int(row["seq"]), int(row["token"]), message.message_id)
        self._held.hold(head)
        _current.set(head)

    def _take_params(self, broker: Broker, message: MessageProxy) -> dict[str, Any]:
        _, schema, resend = self.database_for(broker)
        return {
            "lock_prefix": _lock_prefix(schema),
            "message_id": message.message_id,
            "owner": self.owner,
            "lease_ms": self.lease_ms,
            "queue_name": parked_queue(message),
            "body": parked_body(message),
            "priority": parked_priority(message),
            # On a PostgresBroker the ack is a later synchronous commit that flushes the take too.
            "async": resend["target"] == "queue",
        }

    def take_claimed(self, broker: Broker, messages: Sequence[MessageProxy]) -> list[MessageProxy]:
        """Take the ordered messages of a batch a ``PostgresBroker`` consumer just claimed, in one
        statement on the consumer's thread, and leave each answer on its message.

        Why: a worker thread otherwise waits a round trip for its take before each ordered job;
        measured, that wait was over half of a worker thread's time in an ordered drain.  A lease
        taken here is renewed by the heartbeat like a running job's until a worker thread has the
        message; a message given back unprocessed, or skipped or failed before this middleware saw
        it, lets its lease go at once (:meth:`_let_go`).  A key another transaction holds is not
        waited for: that message is taken by its worker thread, as without a claim.

        Returns the messages settled here, which the consumer acks without handing them to a
        worker thread: those delivered before their turn (parked by this take, as a worker
        thread's take would have parked them) and redeliveries of finished jobs.  In an ordered
        drain nearly every first delivery is one of those.
        """
        ordered = [
            message
            for message in messages
            if ORDER_SEQ_OPTION in message.options and self._derive_of(broker, message.actor_name) is not None
        ]
        if not ordered:
            return []
        database, schema, _ = self.database_for(broker)
        rows = _take_many(database, schema, [self._take_params(broker, message) for message in ordered])
        settled: list[MessageProxy] = []
        for message, row in zip(ordered, rows, strict=True):
            if row["outcome"] == "run":
                lease = _Head(row["key"], int(row["seq"]), int(row["token"]), message.message_id)
                self._held.hold(lease, message_id=message.message_id)
                message.notes[_NOTE] = row
            elif row["outcome"] == "parked":
                events.emit(OrderParked(message.actor_name, message.message_id, row["key"], int(row["seq"])))
                settled.append(message)
            elif row["outcome"] == "unknown":
                settled.append(message)  # done already: a redelivery
        return settled

    def _let_go(self, broker: Broker, message: MessageProxy) -> None:
        """Release a lease taken at claim time for a message that will not run under it (given back,
        or stopped by another middleware first): the job keeps its place and runs when it comes
        back (done=False)."""
        row = _claim_note(message)
        if row is None or row["outcome"] != "run":
            return
        self._held.drop(message_id=message.message_id)
        self._queue_release(broker, _Head(row["key"], int(row["seq"]), int(row["token"]), message.message_id), False)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        self._let_go(broker, message)  # failed in an earlier middleware's before-hook
        # A failure keeps the job at the head: its retry (or its dead letter's replay) runs next.
        self._release(broker, message, done=exception is None)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._let_go(broker, message)  # skipped by an earlier middleware's before-hook
        # Skipped after it took the key: cancelled or a duplicate is done; sent again is not.
        head = _current.get()
        self._release(broker, message, done=head is not None and not head.requeued and not message.failed)

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        if self._derive_of(broker, message.actor_name) is None:
            return
        database, schema, _ = self.database_for(broker)
        try:
            with database.connection() as conn, autocommit(conn):
                conn.execute(
                    _sql.rendered("order_dead", schema), {"message_id": message.message_id, "owner": self.owner}
                )
        except Exception:
            logger.warning("could not mark message %s dead in its key's order", message.message_id, exc_info=True)

    def _run_take(self, database: Database, schema: str, query: str, params: dict[str, Any]) -> dict[str, Any]:
        """Takes are written in groups, as commits are: a worker thread that asks while another
        thread's take is in flight waits for it, then the first of those waiting writes all of
        theirs in one statement (one round trip, one commit, one WAL flush on an OutboxBroker).

        A grouped take does not wait for a key another transaction holds: that one is taken
        again alone.  A group that holds some keys' locks therefore never waits for another's,
        and two groups cannot deadlock.
        """
        me = _Waiter(params)
        with self._taking:
            self._queued.append(me)
            lead = not self._busy
            self._busy = True
        if not lead:
            me.done.wait()
            if not me.lead:
                return me.outcome(database, schema, query)
        with self._taking:
            group, self._queued = self._queued, []
        try:
            if len(group) == 1:
                rows = [one_statement(database, _sql.rendered(query, schema), params)]
            else:
                rows = _take_many(database, schema, [waiter.params for waiter in group])
        except BaseException as error:
            for waiter in group:
                waiter.error = error
        else:
            for waiter, row in zip(group, rows, strict=True):
                waiter.row = row
        with self._taking:
            if self._queued:
                self._queued[0].lead = True  # the next group's writer
                self._queued[0].done.set()
            else:
                self._busy = False
        for waiter in group:
            if waiter is not me:
                waiter.done.set()
        return me.outcome(database, schema, query)

    def _release(self, broker: Broker, message: MessageProxy, *, done: bool) -> None:
        head = _current.get()
        if head is None or head.message_id != message.message_id:
            return
        _current.set(None)
        self._held.drop()
        self._queue_release(broker, head, done)

    def _queue_release(self, broker: Broker, head: _Head, done: bool) -> None:
        with self._releasing:
            self._pending.append((head, done))
            if self._flushing:
                return  # the thread whose release is in flight writes this one next
            self._flushing = True
            if self._releaser is not None:
                self._releaser.wake()
                return
        self._flush_releases(broker)

    def _flush_releases(self, broker: Broker) -> None:
        """Write every pending release, a batch per statement, until none is left.

        Releases are batched as the broker's acks are, and in a worker they are written by a
        thread of their own (:class:`_Releaser`): a worker thread hands its release over and goes
        on to its next job (Dramatiq then acks the delivery) instead of waiting for a statement;
        the worker threads of an ordered drain spent about a third of their time waiting for
        releases.  A key so stays held for one statement longer at most.  A release not written
        (a batch that failed, a process killed after the ack) leaves its lease to lapse, and the
        sweep sends the head again: a duplicate run at worst, which ``Idempotency`` skips, as
        for a release lost in a Postgres crash.
        """
        database, schema, resend = self.database_for(broker)  # known since the take
        while True:
            with self._releasing:
                batch, self._pending = self._pending, []
                if not batch:
                    self._flushing = False
                    return
            batch.sort(key=lambda item: item[0].key)  # stable: one key's releases keep their order
            params = {
                "lock_prefix": _lock_prefix(schema),
                "keys": [head.key for head, _ in batch],
                "seqs": [head.seq for head, _ in batch],
                "tokens": [head.token for head, _ in batch],
                "dones": [done for _, done in batch],
                **resend,
            }
            try:
                one_statement(database, _sql.rendered("order_release_many", schema), params)
            except Exception:
                keys = sorted({head.key for head, _ in batch})
                logger.warning(
                    "could not free order key(s) %r; they lapse after %d ms", keys, self.lease_ms, exc_info=True
                )

    def sweep(self, broker: Broker) -> int:
        """Free the keys of killed workers, of discarded dead heads and of cancelled jobs; returns how
        many heads were sent again."""
        _, schema, _ = self.database_for(broker)
        return self._sweep(broker, "order_sweep", {"lock_prefix": _lock_prefix(schema), "limit": _SWEEP_LIMIT})


class _TakeAtClaim:
    """The claim listener of a ``PostgresBroker`` (see :meth:`OrderedKeys.take_claimed`)."""

    def __init__(self, middleware: OrderedKeys, broker: Broker) -> None:
        self._middleware = middleware
        self._broker = broker

    def claimed(self, messages: Sequence[MessageProxy]) -> list[MessageProxy]:
        return self._middleware.take_claimed(self._broker, messages)

    def given_back(self, messages: Sequence[MessageProxy]) -> None:
        for message in messages:
            self._middleware._let_go(self._broker, message)


def _claim_note(message: MessageProxy) -> dict[str, Any] | None:
    """The take made when ``message`` was claimed, taken off it (each is used once), or ``None``."""
    notes = getattr(message, "notes", None)
    return notes.pop(_NOTE, None) if isinstance(notes, dict) else None


class _Releaser:
    """The thread that writes releases while a worker runs; ``stop`` returns once it wrote every
    release handed to it."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dramatiq-reliable-OrderedKeys-releases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self._flush()  # a batch that fails is logged there: its leases lapse
            except Exception:
                logger.exception("the OrderedKeys release writer failed; the leases it held lapse")
            if self._stop.is_set():
                return


class _Waiter:
    """One worker thread's take in a group: its parameters, then its row or the group's error."""

    __slots__ = ("done", "error", "lead", "params", "row")

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.done = threading.Event()
        self.lead = False
        self.row: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def outcome(self, database: Database, schema: str, query: str) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        assert self.row is not None
        if self.row["outcome"] == "busy":  # its key was locked elsewhere: taken alone, waiting for it
            return one_statement(database, _sql.rendered(query, schema), self.params)
        return self.row


def _take_many(database: Database, schema: str, group: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first = group[0]  # the same middleware: one lock prefix, owner, lease and target for all
    params = {
        "lock_prefix": first["lock_prefix"],
        "owner": first["owner"],
        "lease_ms": first["lease_ms"],
        "async": first["async"],
        "message_ids": [take["message_id"] for take in group],
        "queue_names": [take["queue_name"] for take in group],
        "bodies": [take["body"] for take in group],
        "priorities": [take["priority"] for take in group],
    }
    with database.connection() as conn, autocommit(conn):
        rows = conn.cursor(row_factory=dict_row).execute(_sql.rendered("order_take_many", schema), params).fetchall()
    if len(rows) != len(group):
        raise RuntimeError(f"{len(group)} takes gave {len(rows)} rows")
    return rows


def _lock_prefix(schema: str) -> str:
    """The advisory lock a take, release or sweep of a key holds is this prefix and the key (the
    sender's lock, held until the sender commits, is another one: a take never waits for a sender)."""
    return f"dramatiq_reliable.order-run:{schema}:"


def _in_worker() -> bool:
    return isinstance(threading.current_thread(), WorkerThread)


def order_waiting(conn: psycopg.Connection[Any], *, schema: str, limit: int = 20) -> list[dict[str, Any]]:
    """The keys with jobs waiting, dead heads first: ``key``, ``waiting``, ``head_state``, ``head_message_id``,
    ``oldest_sent_at``."""
    cursor = conn.cursor(row_factory=dict_row)
    return cursor.execute(_sql.query("order_waiting", _sql.validate_schema(schema)), {"limit": limit}).fetchall()
