"""Singleton actors: runs that share a concurrency key never overlap, whoever sent them.

A run takes a *lease row* in ``singleton_leases`` before the actor starts, on a short
autocommit statement of its own, renews it from a heartbeat thread while the actor runs and
deletes it when the run ends.  A worker that dies (SIGKILL, a lost host) stops renewing, and the
lease lapses ``lease_ms`` later.  Session advisory locks were not used: a pooled connection keeps
them after it is returned (psycopg_pool only rolls back), and PgBouncer in transaction mode hands
the session to someone else, so the lock outlives the run or belongs to a stranger.  A lease row
is a plain row written in short transactions, so it is safe behind any pool and behind PgBouncer
in session *or* transaction mode.

Every acquisition takes a new *fencing token* from the ``singleton_tokens`` sequence; the job
reads it with :func:`current_lease` and can guard its writes with it, so a run whose lease
lapsed (a long GC pause, a partitioned worker) cannot overwrite the work of its successor.

Why the acquire does not wait for the WAL flush.  Its durable commit (an fsync) was most of
what a singleton cost: about 0.35 of the same actor's throughput.  The acquire now commits with
``synchronous_commit`` off for its own transaction, and a crash can no longer let two runs
overlap unnoticed, for four reasons:

1. A live acquire is seen by every other session at once: commit visibility does not wait
   for the flush.  Only a crash of Postgres itself (or a failover, or a restore) can lose it,
   never a worker's crash; a clean restart flushes every commit first.
2. Such a crash empties the one-row UNLOGGED ``singleton_guard`` table (Postgres resets
   unlogged tables after a crash, an immediate shutdown, on a promoted standby and in a base
   backup).  The first acquire that finds the row missing starts a *quarantine*, committed
   with a flush: no key is handed out for ``lease_ms``.
3. Within the quarantine, the heartbeat (every ``lease_ms / 3``) of a run whose lease row is
   gone, or is back to the lapsed lease it had taken over, puts it back: same key and token,
   flushed, provided no live or later lease holds the key and its own lease cannot have lapsed
   yet.  So a run that outlives the crash keeps its key, as it would have with a flushed
   acquire; a run that cannot renew for ``lease_ms`` loses it, as a flushed lease would have
   lapsed by then too (``SingletonLeaseLost``, and fencing protects its writes).
4. Fencing tokens stay monotonic: a crash can make the ``singleton_tokens`` sequence give out
   again the numbers of lost acquires, so the quarantine moves it ``2**32`` ahead (with a
   flush), far past any number handed out in the few hundred milliseconds a crash can lose.

The quarantine lasts the ``lease_ms`` of the process that starts it: give every ``Singleton``
on one schema the same ``lease_ms`` (a process whose heartbeat is more than a quarantine apart,
``lease_ms / 3`` above the other's ``lease_ms``, could be too late to take its lease back).

Messages sent during a quarantine are postponed until it ends, whatever ``when_held`` says:
the key is not known to be held, so skipping or buffering would drop work.  The other writes
keep their flush: a buffered message, clearing it, the heartbeat's renewals and the
quarantine.  The release was already unflushed (a lost release leaves a lease that lapses).

The key in the job's own transaction.  When the actor runs under transactional ``Idempotency``
(ordered after this middleware, on the same database and schema) and its ``when_held`` is not
``"buffer"``, the run takes no autocommit lease: right after Idempotency claims the job's key,
in the same transaction, it locks the key's row (``FOR UPDATE SKIP LOCKED``, only a row that is
free: ``expires_at`` in the past) and takes a new token from the sequence.  The row lock is the
lease; the row itself is not written, so it stays free (``expires_at`` ``-infinity``) whatever
the job's outcome and a busy key leaves no dead row versions behind.  Why that is as safe as
the autocommit lease:

1. Exclusion between job transactions: a row lock has one holder.  A second run skips the
   locked row and settles its message per ``when_held`` (nothing waits).  The statement never
   inserts a row in the job's transaction (an uncommitted insert would make others wait): a
   key without a row gets a free one committed on a connection of its own first.
2. Exclusion against autocommit leases (a mixed fleet, actors without Idempotency): a live
   autocommit lease has ``expires_at`` in the future, so the job transaction does not take it;
   the autocommit acquire takes a row only if it can lock it at once (``SKIP LOCKED``), so a row
   held by a job transaction is held for it too, and a held-by-a-transaction key that
   ``when_held="buffer"`` cannot buffer into is postponed, not dropped.  An older worker whose
   acquire lacks that check waits for the job transaction instead of settling at once: slower,
   never overlapping.
3. Nothing to lose, nothing to release: the lock ends with the job's commit or rollback, and
   Postgres ends it when the worker's connection goes (SIGKILL, a lost host once TCP notices,
   a Postgres crash, which also aborts the job's writes).  The row is free whatever the
   outcome, so no heartbeat renews it and no release deletes it.  A worker
   whose host vanishes without closing its socket keeps the lock until Postgres notices (TCP
   keepalives or ``idle_in_transaction_session_timeout``), as it keeps its Idempotency claim.
4. Fencing tokens still grow: every acquisition takes ``nextval`` of the same sequence (never
   rolled back) whichever path takes the key, and a row's stored token only matters to the
   autocommit path's own renewals and releases.  The job transaction's
   acquire honours the crash quarantine like the autocommit one, so the sequence jump after a
   crash covers both.
5. ``when_held`` is unchanged: a held key is settled after Idempotency has rolled the job's
   transaction back and returned its connection, so a postponed copy is sent on its own and
   never rolled back with the job.

The cost is one statement in a transaction the job opens anyway, with no commit of its own: no
release, no heartbeat renewal.  ``job_transaction=False`` keeps the autocommit lease.

This module lives at the top of the package, not in ``scheduler/``: any sender's messages can be
singletons, and a worker that runs no schedules needs none of the scheduler.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, NoReturn, cast

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, SkipMessage
from psycopg import sql
from psycopg.rows import dict_row

from . import _sql, events
from ._checks import check_bool, check_ms, is_int
from ._util import first_line
from .backing import backing_of
from .binding import bind
from .database import Database, DatabaseLike
from .errors import ActorOptionError, ConfigurationError, DatabaseUnavailable, MiddlewareFailed, SchemaNotReady
from .idempotency._connections import autocommit  # the pool's connections keep their mode
from .idempotency.context import pending_in_transaction
from .idempotency.middleware import Idempotency
from .schema import SINGLETON_VERSION, ensure_ready

__all__ = [
    "WHEN_HELD",
    "Lease",
    "Singleton",
    "SingletonHeld",
    "SingletonLeaseLost",
    "SingletonReleaseFailed",
    "current_lease",
]

logger = logging.getLogger("dramatiq_reliable.singleton")

WhenHeld = Literal["skip", "retry", "buffer"]
#: What a run does when another run holds its key.
WHEN_HELD: tuple[WhenHeld, ...] = ("skip", "retry", "buffer")
DEFAULT_LEASE_MS = 30_000
DEFAULT_RETRY_DELAY_MS = 5_000
#: The message option counting postponements: kept apart from ``retries`` (and ``max_retries``).
POSTPONED_KEY = "singleton_postponed"
_OPTIONS = frozenset({"singleton", "concurrency_key", "singleton_when_held", "singleton_retry_delay_ms"})
_MAX_KEY_CHARS = 1000
# How many lapsed leases with a buffered message one heartbeat hands on.
_SWEEP_LIMIT = 100
# How far a quarantine moves the token sequence: far more acquires than a crash can lose (the
# last few hundred milliseconds of them), and room for 2**31 crashes in a bigint.
TOKEN_GAP = 1 << 32
# A lease is sure to be live for this part of lease_ms after the statement that set its expiry
# was sent: room for the two clocks running at slightly different rates.
_SURE_FRACTION = 0.9


# -- events -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SingletonHeld(events.Event):
    """A run did not start because another run holds its key; ``action`` says what became of it:
    ``"skipped"``, ``"postponed"`` (re-enqueued after ``delay_ms``) or ``"buffered"``."""

    name = "singleton.held"
    actor_name: str
    message_id: str
    key: str
    action: str
    delay_ms: int | None = None


@dataclasses.dataclass(frozen=True)
class SingletonLeaseLost(events.Event):
    """The heartbeat found the lease taken over (it lapsed): the run goes on unprotected; jobs that
    guard their writes with the fencing token are safe."""

    name = "singleton.lease_lost"
    level = logging.WARNING
    actor_name: str
    message_id: str
    key: str
    token: int


@dataclasses.dataclass(frozen=True)
class SingletonReleaseFailed(events.Event):
    """The lease could not be deleted after the run; it lapses after ``lease_ms``."""

    name = "singleton.release_failed"
    level = logging.WARNING
    actor_name: str
    message_id: str
    key: str
    error: str


# -- the job's view -----------------------------------------------------------------------------


@dataclasses.dataclass
class Lease:
    """The lease the current run holds: its key and fencing token (larger for every later holder)."""

    key: str
    token: int
    message_id: str
    actor_name: str
    #: Set by the heartbeat when another run took the key over after this lease lapsed.
    lost: bool = False
    #: Held as a row lock of the job's own transaction (transactional ``Idempotency``): it ends
    #: with that transaction and is neither renewed nor deleted.
    in_transaction: bool = False


_current: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("dramatiq_reliable_singleton", default=None)


def current_lease() -> Lease | None:
    """The lease of the singleton run on this thread, or ``None`` outside one.

    Guard a write with the token so that a run whose lease lapsed cannot undo its successor's::

        lease = current_lease()
        conn.execute("UPDATE report SET body = %s, token = %s WHERE id = 1 AND token <= %s",
                     (body, lease.token, lease.token))
    """
    return _current.get()


# -- the middleware -----------------------------------------------------------------------------


class Singleton(Middleware):
    """At most one run per concurrency key at a time, across every worker and host.

    Actor options (declared on ``@dramatiq.actor``):
      singleton: ``True`` to make the actor's name the key.
      concurrency_key: a callable taking the actor's arguments and returning the key, e.g.
        ``lambda account_id: f"sync-{account_id}"``; implies a singleton.
      singleton_when_held: ``"skip"`` (ack it unrun), ``"retry"`` (re-enqueue it after
        ``singleton_retry_delay_ms``, not counted against ``max_retries``) or ``"buffer"`` (keep
        one message in the lease row, sent when the key is released; more are skipped);
        default ``when_held``.
      singleton_retry_delay_ms: the delay of ``"retry"``; default ``retry_delay_ms``.

    No worker thread waits for a key: a held key is settled at once and the thread moves on.

    Parameters:
      database: where ``singleton_leases`` lives; omit it with an ``OutboxBroker`` or a
        ``PostgresBroker`` to share theirs (a buffered message is then sent in the release's
        transaction).
      schema: the schema of the tables; default the broker's.
      lease_ms: how long a lease outlives a holder that stopped renewing it (a killed worker);
        the heartbeat renews every ``lease_ms / 3``.
      when_held, retry_delay_ms: the defaults of the actor options above.
      job_transaction: take the key inside the job's own transaction when the actor runs under
        transactional ``Idempotency`` (placed after this middleware, on the same database and
        schema) and its ``when_held`` is not ``"buffer"``: a row lock held until the job
        commits or rolls back, no statement of its own to commit.  ``False`` keeps the
        autocommit lease for every run.

    Order of a postponed or buffered message and the ack: the copy is made durable first (an
    outbox or queue row, a RabbitMQ delay-queue publish, or the lease row's buffer) and the
    original is acked after, by ``SkipMessage``; a crash in between duplicates the message,
    never loses it.  A release deletes the lease and sends the buffered message in one
    transaction on an ``OutboxBroker``/``PostgresBroker``; on other brokers the message is sent
    first and the lease deleted after.  Postgres down while acquiring fails closed: the actor
    does not run and ``DatabaseUnavailable`` lets the retry middleware retry it.

    Put it before ``Idempotency`` (so a postponed message never claims its key):

    >>> broker.add_middleware(Singleton(), before=Idempotency)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        database: DatabaseLike | None = None,
        schema: str | None = None,
        lease_ms: int = DEFAULT_LEASE_MS,
        when_held: WhenHeld = "retry",
        retry_delay_ms: int = DEFAULT_RETRY_DELAY_MS,
        job_transaction: bool = True,
    ) -> None:
        check_bool("job_transaction", job_transaction)
        check_ms("lease_ms", lease_ms, minimum=300, fix="e.g. lease_ms=30_000, longer than a GC pause or a failover")
        check_ms("retry_delay_ms", retry_delay_ms, fix="e.g. retry_delay_ms=5_000")
        if when_held not in WHEN_HELD:
            raise ConfigurationError(
                f"when_held must be one of {WHEN_HELD!r}, got {when_held!r}; e.g. when_held='retry'"
            )
        self.schema: str | None = None if schema is None else _sql.validate_schema(schema)
        self.lease_ms = lease_ms
        self.when_held: WhenHeld = when_held
        self.retry_delay_ms = retry_delay_ms
        self.job_transaction = job_transaction
        # broker id -> the Idempotency after this middleware on the same leases' database, or None
        self._idempotency: dict[int, Idempotency | None] = {}
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._own_database = Database.of(database) if database is not None else None
        self._target: tuple[Database, str] | None = None
        self._held: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._reclaim_lock = threading.Lock()
        # id(lease) -> the monotonic time before which its row cannot have lapsed.
        self._live_until: dict[int, float] = {}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._schema_ready = False

    @property
    def actor_options(self) -> set[str]:
        return set(_OPTIONS)

    # -- configuration ------------------------------------------------------------------------

    def database_for(self, broker: Broker) -> tuple[Database, str]:
        """The database and schema the leases of ``broker``'s actors live in."""
        if self._target is None:
            backing = backing_of(
                broker, needed_by="Singleton", database=self._own_database, schema=self.schema, error=ActorOptionError
            )
            self._target = (backing.database, backing.schema)
        return self._target

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        options = actor.options
        name = actor.actor_name
        flag = options.get("singleton")
        key = options.get("concurrency_key")
        if flag is not None and not isinstance(flag, bool):
            raise ActorOptionError(
                f"actor {name!r}: singleton must be True or False, got {flag!r}; write singleton=True"
            )
        if key is not None and not callable(key):
            raise ActorOptionError(
                f"actor {name!r}: concurrency_key must be a callable taking the actor's arguments, got {key!r}; "
                "write e.g. concurrency_key=lambda account_id: f'sync-{account_id}'"
            )
        if flag is False and key is not None:
            raise ActorOptionError(f"actor {name!r} has singleton=False and a concurrency_key; remove one of them")
        when = options.get("singleton_when_held")
        if when is not None and when not in WHEN_HELD:
            raise ActorOptionError(f"actor {name!r}: singleton_when_held must be one of {WHEN_HELD!r}, got {when!r}")
        delay = options.get("singleton_retry_delay_ms")
        if delay is not None and (not is_int(delay) or delay < 0):
            raise ActorOptionError(
                f"actor {name!r}: singleton_retry_delay_ms must be an int >= 0 (milliseconds), got {delay!r}"
            )
        if not (flag or key) and (when is not None or delay is not None):
            raise ActorOptionError(
                f"actor {name!r} sets singleton_when_held or singleton_retry_delay_ms but is no singleton; "
                "add singleton=True or a concurrency_key"
            )
        if flag or key:
            self.database_for(broker)

    def key_for(self, actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy) -> str | None:
        """The concurrency key of ``message``, or ``None`` when its actor is no singleton.

        Raises :class:`ActorOptionError` when the key function fails or gives no usable key.
        """
        derive = actor.options.get("concurrency_key")
        if derive is None:
            return actor.actor_name if actor.options.get("singleton") else None
        try:
            key: object = derive(*message.args, **message.kwargs)
        except Exception as error:
            raise ActorOptionError(
                f"message {message.message_id!r} of {message.actor_name!r}: concurrency_key raised "
                f"{type(error).__name__}: {first_line(error)}; fix the key function or the arguments"
            ) from error
        if not isinstance(key, str) or not key or len(key) > _MAX_KEY_CHARS or "\x00" in key:
            raise ActorOptionError(
                f"message {message.message_id!r} of {message.actor_name!r}: concurrency_key gave {key!r}, not a "
                f"non-empty string of at most {_MAX_KEY_CHARS} characters; build keys from IDs and plain text"
            )
        return key

    # -- hooks --------------------------------------------------------------------------------

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        if any(_is_singleton(broker.get_actor(name)) for name in broker.get_declared_actors()):
            self._start_heartbeat(broker)

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _current.set(None)
        pending_in_transaction.set(None)
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return
        try:
            key = self.key_for(actor, message)
        except ActorOptionError as error:
            # A key that cannot be computed will not be computable on a retry: dead-letter it.
            logger.error("%s", error)
            message.fail()
            raise SkipMessage(str(error)) from error
        if key is None:
            return
        if self._in_job_transaction(broker, actor, message):
            # Idempotency runs it first thing in the job's transaction, right after the claim.
            pending_in_transaction.set(lambda conn: self._acquire_in_transaction(broker, conn, actor, message, key))
            return
        database, schema = self.database_for(broker)
        try:
            with database.connection() as conn, autocommit(conn):
                if not self._schema_ready:
                    ensure_ready(conn, schema=schema, required=SINGLETON_VERSION, feature="singleton actors")
                    self._schema_ready = True
                tokens = sql.Identifier(schema, "singleton_tokens").as_string(conn)
                sent_at = time.monotonic()
                row = (
                    conn.cursor(row_factory=dict_row)
                    .execute(
                        _sql.rendered("singleton_acquire", schema),
                        {
                            "key": key,
                            "tokens": tokens,
                            "message_id": message.message_id,
                            "owner": self.owner,
                            "lease_ms": self.lease_ms,
                        },
                    )
                    .fetchone()
                )
                assert row is not None  # the statement always returns one row
                if row["token"] is not None:
                    lease = Lease(key, int(row["token"]), message.message_id, message.actor_name)
                    if row["was_buffered"]:
                        # Flushed (the default): it also makes the unflushed acquire durable.
                        conn.execute(_sql.query("singleton_clear_buffer", schema), {"key": key, "token": lease.token})
                    self._hold(lease, sent_at)
                    return
                if row["quarantined"]:
                    left_ms = row["quarantine_left_ms"]
                    if left_ms is None:  # the guard row is gone: Postgres crashed since the last acquire
                        left_ms = self._start_quarantine(conn, schema, tokens)
                    self._postpone_quarantined(broker, actor, message, key, max(1, int(left_ms)))
                self._settle_held(broker, conn, schema, actor, message, key, locked=bool(row["locked"]))
        except (SkipMessage, DatabaseUnavailable, MiddlewareFailed):
            raise
        except Exception as error:
            self._acquire_failed(error, key, message)

    def _acquire_failed(self, error: Exception, key: str, message: MessageProxy) -> NoReturn:
        if isinstance(error, psycopg.Error | OSError | TimeoutError | SchemaNotReady):
            if isinstance(error, psycopg.errors.UndefinedTable | SchemaNotReady):
                self._schema_ready = False
            raise DatabaseUnavailable(
                f"Singleton could not take the lease {key!r} for message {message.message_id!r}: "
                f"{type(error).__name__}: {first_line(error)}; the actor did not run and the message will be retried "
                "once Postgres answers (run 'dramatiq-reliable migrate' if the schema is behind)"
            ) from error
        raise MiddlewareFailed(
            f"Singleton could not take the lease {key!r} for message {message.message_id!r}: "
            f"{type(error).__name__}: {first_line(error)}; the actor did not run, report this as a bug"
        ) from error

    # -- the key in the job's transaction -------------------------------------------------------

    def _in_job_transaction(self, broker: Broker, actor: dramatiq.Actor[Any, Any], message: MessageProxy) -> bool:
        """Whether this run takes its key in the job's transaction (see ``job_transaction``)."""
        if not self.job_transaction or actor.options.get("singleton_when_held", self.when_held) == "buffer":
            return False
        idempotency = self._idempotency_after(broker)
        if idempotency is None:
            return False
        try:
            job = idempotency.job_for(broker, message)
        except Exception:  # a bad key: Idempotency's own hook fails the message
            return False
        return job is not None and job.mode == "transactional"

    def _idempotency_after(self, broker: Broker) -> Idempotency | None:
        if id(broker) not in self._idempotency:
            found: Idempotency | None = None
            middleware = list(broker.middleware)
            mine = next((i for i, m in enumerate(middleware) if m is self), None)
            for later in middleware[(len(middleware) if mine is None else mine + 1) :]:
                if isinstance(later, Idempotency) and later.store is None:
                    # The lock must be in the transaction of the database holding the leases: the
                    # same pool, or two pools on the same conninfo (Singleton(database=URL) and
                    # Idempotency(database=URL) built apart), in the same schema.
                    (theirs, their_schema), (ours, our_schema) = later.database_for(broker), self.database_for(broker)
                    if their_schema == our_schema and (theirs is ours or theirs.conninfo == ours.conninfo):
                        found = later
                    break
            self._idempotency[id(broker)] = found
        return self._idempotency[id(broker)]

    def _acquire_in_transaction(
        self,
        broker: Broker,
        conn: psycopg.Connection[Any],
        actor: dramatiq.Actor[Any, Any],
        message: MessageProxy,
        key: str,
    ) -> Callable[[], None] | None:
        """Lock the key's row in the job's transaction; ``None`` when taken, else the settling step.

        Idempotency calls the step after rolling the job's transaction back, so a postponed
        copy is never sent inside it.
        """
        database, schema = self.database_for(broker)
        try:
            if not self._schema_ready:
                with database.connection() as check, autocommit(check):
                    ensure_ready(check, schema=schema, required=SINGLETON_VERSION, feature="singleton actors")
                self._schema_ready = True
            tokens = sql.Identifier(schema, "singleton_tokens").as_string(conn)
            params = {"key": key, "tokens": tokens}
            statement = _sql.rendered("singleton_acquire_txn", schema)
            cursor = conn.cursor(row_factory=dict_row)
            row = cursor.execute(statement, params).fetchone()
            assert row is not None  # the statement always returns one row
            if not row["present"] and not row["quarantined"]:
                # First run of this key here (or the autocommit path deleted its row): commit a
                # free row on a connection of its own, then lock it.
                with database.connection() as other, autocommit(other):
                    other.execute(_sql.query("singleton_free_row", schema), {"key": key, "owner": self.owner})
                row = cursor.execute(statement, params).fetchone()
                assert row is not None
        except (SkipMessage, DatabaseUnavailable, MiddlewareFailed):
            raise
        except Exception as error:
            self._acquire_failed(error, key, message)
        if row["token"] is not None:
            lease = Lease(key, int(row["token"]), message.message_id, message.actor_name, in_transaction=True)
            _current.set(lease)
            return None
        return lambda: self._settle_outside(broker, actor, message, key, row)

    def _settle_outside(
        self, broker: Broker, actor: dramatiq.Actor[Any, Any], message: MessageProxy, key: str, row: dict[str, Any]
    ) -> None:
        """A key not taken in the job's transaction, settled once that transaction is gone."""
        database, schema = self.database_for(broker)
        try:
            with database.connection() as conn, autocommit(conn):
                if row["quarantined"]:
                    left_ms = row["quarantine_left_ms"]
                    if left_ms is None:  # the guard row is gone: Postgres crashed since the last acquire
                        tokens = sql.Identifier(schema, "singleton_tokens").as_string(conn)
                        left_ms = self._start_quarantine(conn, schema, tokens)
                    self._postpone_quarantined(broker, actor, message, key, max(1, int(left_ms)))
                self._settle_held(broker, conn, schema, actor, message, key, locked=True)
        except (SkipMessage, DatabaseUnavailable, MiddlewareFailed):
            raise
        except Exception as error:
            self._acquire_failed(error, key, message)

    def _start_quarantine(self, conn: psycopg.Connection[Any], schema: str, tokens: str) -> int:
        """Put the guard row back after a crash: no key for ``lease_ms``, tokens moved on; the ms left."""
        row = (
            conn.cursor(row_factory=dict_row)
            .execute(
                _sql.query("singleton_quarantine", schema),
                {"lease_ms": self.lease_ms, "tokens": tokens, "token_gap": TOKEN_GAP},
            )
            .fetchone()
        )
        if row is not None:  # this session put the row back (another may have just done it)
            logger.warning(
                "singleton leases in schema %r are in quarantine for %d ms: Postgres lost its unlogged tables "
                "(a crash, an immediate shutdown or a failover), so acquires it had not flushed may be lost; "
                "runs started before keep their keys through their heartbeat, new runs are postponed",
                schema,
                self.lease_ms,
            )
        return self.lease_ms

    def _postpone_quarantined(
        self, broker: Broker, actor: dramatiq.Actor[Any, Any], message: MessageProxy, key: str, delay: int
    ) -> NoReturn:
        # Whatever when_held says: the key is not known to be held, so skip or buffer could drop work.
        postponed = message.options.get(POSTPONED_KEY, 0)
        message.options[POSTPONED_KEY] = (postponed if is_int(postponed) else 0) + 1
        broker.enqueue(cast("Message[Any]", message), delay=delay)
        events.emit(SingletonHeld(message.actor_name, message.message_id, key, "postponed", delay))
        raise SkipMessage(f"singleton leases are in quarantine after a Postgres crash; postponed by {delay} ms")

    def _settle_held(
        self,
        broker: Broker,
        conn: psycopg.Connection[Any],
        schema: str,
        actor: dramatiq.Actor[Any, Any],
        message: MessageProxy,
        key: str,
        *,
        locked: bool = False,
    ) -> None:
        when = actor.options.get("singleton_when_held", self.when_held)
        if when == "buffer":
            row = conn.execute(
                _sql.query("singleton_buffer", schema),
                {
                    "key": key,
                    "queue_name": message.queue_name,
                    "actor_name": message.actor_name,
                    "message_id": message.message_id,
                    "body": cast("Message[Any]", message).encode(),
                },
            ).fetchone()
            if row is None and locked:
                # Held by a job transaction: its row cannot take a buffered message (the holder
                # never reads it back), so postpone instead of dropping the message.
                self._postpone(broker, actor, message, key)
            action = "buffered" if row is not None else "skipped"
            events.emit(SingletonHeld(message.actor_name, message.message_id, key, action))
            raise SkipMessage(f"singleton key {key!r} is held; the message was {action}")
        if when == "retry":
            self._postpone(broker, actor, message, key)
        events.emit(SingletonHeld(message.actor_name, message.message_id, key, "skipped"))
        raise SkipMessage(f"singleton key {key!r} is held; the message was skipped")

    def _postpone(self, broker: Broker, actor: dramatiq.Actor[Any, Any], message: MessageProxy, key: str) -> NoReturn:
        delay = int(actor.options.get("singleton_retry_delay_ms", self.retry_delay_ms))
        postponed = message.options.get(POSTPONED_KEY, 0)
        message.options[POSTPONED_KEY] = (postponed if is_int(postponed) else 0) + 1
        # Durable first, ack after (SkipMessage): a crash in between duplicates, never loses.
        broker.enqueue(cast("Message[Any]", message), delay=delay or None)
        events.emit(SingletonHeld(message.actor_name, message.message_id, key, "postponed", delay))
        raise SkipMessage(f"singleton key {key!r} is held; the message was postponed by {delay} ms")

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        self._release(broker, message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._release(broker, message)

    # -- leases -------------------------------------------------------------------------------

    def _hold(self, lease: Lease, sent_at: float) -> None:
        with self._lock:
            self._held[threading.get_ident()] = lease
            self._live_until[id(lease)] = sent_at + self.lease_ms * _SURE_FRACTION / 1000
        _current.set(lease)

    def _release(self, broker: Broker, message: MessageProxy) -> None:
        # A request Idempotency never took (a middleware between us skipped the message) must
        # not be taken for the next message of this thread.
        pending_in_transaction.set(None)
        lease = _current.get()
        if lease is None or lease.message_id != message.message_id:
            return
        _current.set(None)
        if lease.in_transaction:
            return  # the job's commit or rollback (Idempotency's after-hook, run first) released it
        # Under the reclaim lock: a heartbeat putting this lease back waits for us or has
        # finished, so the delete below never leaves a reclaimed row behind.
        with self._reclaim_lock, self._lock:
            self._held.pop(threading.get_ident(), None)
            self._live_until.pop(id(lease), None)
        database, schema = self.database_for(broker)
        params = {"key": lease.key, "token": lease.token}
        try:
            with database.connection() as conn, autocommit(conn):
                if conn.execute(_sql.rendered("singleton_release_plain", schema), params).fetchone() is not None:
                    return
            # A message is buffered (or the lease was lost): delete and send in one transaction.
            with database.connection() as conn, conn.transaction(), bind(conn):
                row = (
                    conn.cursor(row_factory=dict_row)
                    .execute(_sql.query("singleton_release", schema), params)
                    .fetchone()
                )
                if row is not None and row["buffered_body"] is not None:
                    self._send_buffered(broker, row)
        except Exception as error:
            events.emit(
                SingletonReleaseFailed(
                    lease.actor_name, lease.message_id, lease.key, f"{type(error).__name__}: {first_line(error)}"
                )
            )

    @staticmethod
    def _send_buffered(broker: Broker, row: dict[str, Any]) -> None:
        # Inside the release's transaction, bound: on a Postgres-backed broker the send is a
        # row of that transaction, so the lease goes and the message comes in one commit.
        buffered = Message.decode(bytes(row["buffered_body"]))
        broker.enqueue(buffered)

    def _start_heartbeat(self, broker: Broker) -> None:
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(
                target=self._beat, args=(broker,), name="dramatiq-reliable-singleton", daemon=True
            )
            self._heartbeat.start()

    def _beat(self, broker: Broker) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                self.renew(broker)
                self.sweep(broker)
            except Exception:
                logger.warning("singleton heartbeat failed; leases lapse unless the next one succeeds", exc_info=True)

    def renew(self, broker: Broker) -> None:
        """Push back the expiry of every lease this process holds (the heartbeat calls it)."""
        with self._lock:
            held = list(self._held.values())
        if not held:
            return
        database, schema = self.database_for(broker)
        sent_at = time.monotonic()
        with database.connection() as conn, autocommit(conn):
            rows = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("singleton_renew", schema),
                    {"lease_ms": self.lease_ms, "keys": [h.key for h in held], "tokens": [h.token for h in held]},
                )
                .fetchall()
            )
        renewed = {row["key"] for row in rows}
        with self._reclaim_lock:
            with self._lock:
                running = {id(lease) for lease in self._held.values()}
                for lease in held:
                    if lease.key in renewed and id(lease) in running:
                        self._live_until[id(lease)] = sent_at + self.lease_ms * _SURE_FRACTION / 1000
                now = time.monotonic()
                # Gone although it cannot have lapsed yet: only a crash loses a live row.  A row
                # that may have lapsed is not put back: a successor may have run and released.
                missing = [
                    h
                    for h in held
                    if h.key not in renewed
                    and not h.lost
                    and id(h) in running
                    and now < self._live_until.get(id(h), 0.0)
                ]
            if missing:
                renewed |= self._reclaim(database, schema, missing)
        with self._lock:
            # A run that released its lease while the renewal ran is gone from _held (it is
            # dropped before the row is deleted): only leases still held here were taken over.
            running = {id(lease) for lease in self._held.values()}
        for lease in held:
            if lease.key not in renewed and not lease.lost and id(lease) in running:
                lease.lost = True
                events.emit(SingletonLeaseLost(lease.actor_name, lease.message_id, lease.key, lease.token))

    def _reclaim(self, database: Database, schema: str, missing: list[Lease]) -> set[str]:
        """Put back the rows of running leases that are gone (an acquire lost in a crash); the keys put back."""
        with database.connection() as conn, autocommit(conn):
            rows = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("singleton_reclaim", schema),
                    {
                        "owner": self.owner,
                        "lease_ms": self.lease_ms,
                        "keys": [h.key for h in missing],
                        "tokens": [h.token for h in missing],
                        "message_ids": [h.message_id for h in missing],
                    },
                )
                .fetchall()
            )
        return {row["key"] for row in rows}

    def sweep(self, broker: Broker) -> int:
        """Hand on the buffered messages of lapsed leases (a dead holder's); returns how many."""
        database, schema = self.database_for(broker)
        with database.connection() as conn, conn.transaction(), bind(conn):
            rows = (
                conn.cursor(row_factory=dict_row)
                .execute(_sql.query("singleton_sweep", schema), {"limit": _SWEEP_LIMIT})
                .fetchall()
            )
            for row in rows:
                self._send_buffered(broker, row)
        return len(rows)


def _is_singleton(actor: dramatiq.Actor[Any, Any]) -> bool:
    return bool(actor.options.get("singleton") or actor.options.get("concurrency_key"))
