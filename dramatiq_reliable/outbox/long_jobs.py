"""Long jobs: a job longer than RabbitMQ's ``consumer_timeout`` runs under a Postgres lease.

RabbitMQ closes a consumer's channel when one of its deliveries stays unacked for longer than
``consumer_timeout`` (30 minutes by default, fixed on Amazon MQ) and delivers everything the
channel held again.  A job longer than that is then delivered a second time while it still runs:
another thread takes the copy (``Idempotency`` makes it wait and skip, but the thread is tied
up), the worker's consumer restarts, and every other message it had prefetched comes back too.

Raising the timeout is not always possible, and a per-queue timeout needs RabbitMQ 3.12+, so
the job is taken off RabbitMQ instead.  When a worker starts a long job, :class:`LongJobs`:

1. writes a lease row (the message body, its owner, an expiry) to Postgres and commits it;
2. acks the RabbitMQ delivery at once, on the channel that delivered it;
3. extends the lease every ``heartbeat_ms`` while the job runs;
4. deletes the row when the job ends, in the job's own transaction when ``Idempotency`` runs it
   transactionally (done-ness and the end of the lease commit together), else right after.

If the worker dies (``kill -9``, a lost machine) nothing extends the lease, and when it runs
out a relay (every relay, in its own process or inside a worker) moves the row back to the
outbox in one statement: the job runs again, the message is never lost and never in two places.
A second delivery of a message whose lease is live is acked and skipped, so the job never runs
twice at once (as long as its worker reaches Postgres at least once per ``lease_ms``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware, SkipMessage, TimeLimit
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from .. import _sql, schema
from .._checks import check_bool, check_ms
from .._util import first_line
from ..backing import backing_of
from ..database import Database, DatabaseLike
from ..errors import ActorOptionError, ConfigurationError, SchemaNotReady
from ..idempotency.context import current_running
from .consumer import ack_now

__all__ = [
    "DEFAULT_CONSUMER_TIMEOUT_MS",
    "LeaseReaper",
    "LongJobs",
    "leased_jobs",
    "reap_expired_leases",
    "warn_if_too_long",
]

logger = logging.getLogger("dramatiq_reliable.outbox")

#: RabbitMQ's default ``consumer_timeout`` since 3.8.15 (and Amazon MQ's, which cannot change it).
DEFAULT_CONSUMER_TIMEOUT_MS = 1_800_000

_OWNER = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _time_limit_ms(broker: Broker, actor: dramatiq.Actor[Any, Any]) -> float | None:
    """The actor's ``time_limit`` (its own, else the ``TimeLimit`` middleware's); ``None`` without one."""
    limit = actor.options.get("time_limit")
    if limit is None:
        for middleware in broker.middleware:
            if isinstance(middleware, TimeLimit):
                limit = middleware.time_limit
    return float(limit) if isinstance(limit, (int, float)) and not isinstance(limit, bool) else None


def _long_jobs_of(broker: Broker) -> LongJobs | None:
    return next((m for m in broker.middleware if isinstance(m, LongJobs)), None)


def warn_if_too_long(broker: Broker, actor: dramatiq.Actor[Any, Any], *, consumer_timeout_ms: int) -> bool:
    """Log a warning when ``actor`` may run past ``consumer_timeout_ms`` without a lease; whether it did.

    ``OutboxBroker`` calls this for every actor it declares, so the warning shows when the worker
    imports the actors (and in any process that does).
    """
    limit = _time_limit_ms(broker, actor)
    if limit is None or limit <= consumer_timeout_ms:
        return False
    long_jobs = _long_jobs_of(broker)
    if long_jobs is not None and long_jobs.is_long_running(broker, actor):
        return False
    why = "the broker has no LongJobs middleware" if long_jobs is None else "the actor has long_running=False"
    logger.warning(
        "actor %r may run for %d ms (time_limit), longer than RabbitMQ's consumer_timeout (%d ms), and %s: "
        "RabbitMQ would close the worker's channel under it and deliver it again while it runs; add "
        "LongJobs() to the broker's middleware (after Idempotency), lower time_limit, or raise the server's "
        "consumer_timeout and pass it as OutboxBroker(consumer_timeout_ms=...)",
        actor.actor_name,
        limit,
        consumer_timeout_ms,
        why,
    )
    return True


class _Heartbeat:
    """The leases this process holds and the thread that extends them."""

    def __init__(self, owner: LongJobs) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, message_id: str, token: int) -> None:
        with self._lock:
            self._held[message_id] = token
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="dramatiq-reliable-long-jobs", daemon=True)
                self._thread.start()

    def token(self, message_id: str) -> int | None:
        with self._lock:
            return self._held.get(message_id)

    def forget(self, message_id: str) -> int | None:
        with self._lock:
            return self._held.pop(message_id, None)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def beat(self) -> list[str]:
        """Extend every lease held now; the message ids whose lease was lost."""
        with self._lock:
            held = dict(self._held)
        if not held:
            return []
        owner = self._owner
        with owner.database.autocommit() as conn:
            rows = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("job_lease_heartbeat", owner.schema),
                    {"message_ids": list(held), "tokens": list(held.values()), "lease_s": owner.lease_ms / 1000},
                )
                .fetchall()
            )
        kept = {row["message_id"] for row in rows}
        lost = [message_id for message_id in held if message_id not in kept and self.token(message_id) is not None]
        for message_id in lost:
            logger.warning(
                "the lease of long job %r was lost (no heartbeat reached Postgres for %d ms, so a relay may have "
                "put it back in the outbox); the job may run again elsewhere",
                message_id,
                owner.lease_ms,
            )
            self.forget(message_id)
        return lost

    def _run(self) -> None:
        while not self._stop.wait(self._owner.heartbeat_ms / 1000):
            try:
                self.beat()
            except (psycopg.Error, PoolTimeout) as error:
                logger.warning(
                    "long-job heartbeat failed (%s: %s); the jobs run again elsewhere if this lasts past the lease "
                    "(%d ms)",
                    type(error).__name__,
                    first_line(error),
                    self._owner.lease_ms,
                )
            except Exception:
                logger.exception("long-job heartbeat failed")


class LongJobs(Middleware):
    """Run long jobs under a Postgres lease, acked on RabbitMQ as soon as they start.

    Which actors: those with ``long_running=True``, and, unless they say
    ``long_running=False``, those whose ``time_limit`` exceeds the server's ``consumer_timeout``
    (the broker's ``consumer_timeout_ms``, 30 minutes by default).  Other actors are untouched.

    Put it after ``Idempotency`` in the middleware list (and before ``ClassifiedRetries``, which
    stays last): the job's key is then claimed first, and the lease ends in the job's
    transaction.  It needs the schema at version 9 (``dramatiq-reliable migrate``) and a relay
    (a ``WorkerRelay`` in the workers, or the relay process) to requeue the jobs of dead workers.

    Parameters:
      lease_ms: how long a lease lasts without a heartbeat: how soon the job of a killed worker
        runs again (plus up to a second for a relay to notice).
      heartbeat_ms: how often the worker extends its leases; well under ``lease_ms``, so one
        missed heartbeat (a Postgres blip) costs nothing.
      database, schema: where the leases live; by default the broker's.

    While the job runs, RabbitMQ no longer holds it: a failure is retried or dead-lettered by
    the other middleware as usual (through the outbox and ``DeadLetters``), but RabbitMQ's
    ``.XQ`` gets no copy.

    >>> broker = OutboxBroker(url=..., database=..., middleware=[                 # doctest: +SKIP
    ...     *build_middleware(), Idempotency(), LongJobs(), ClassifiedRetries()])
    >>> @dramatiq.actor(long_running=True, time_limit=3 * 3600_000)               # doctest: +SKIP
    ... def rebuild_index(): ...
    """

    def __init__(
        self,
        *,
        lease_ms: int = 60_000,
        heartbeat_ms: int = 10_000,
        database: DatabaseLike | None = None,
        schema: str | None = None,
    ) -> None:
        self.lease_ms = check_ms("lease_ms", lease_ms, minimum=1000)
        self.heartbeat_ms = check_ms("heartbeat_ms", heartbeat_ms, minimum=100)
        if heartbeat_ms * 2 > lease_ms:
            raise ConfigurationError(
                f"heartbeat_ms ({heartbeat_ms!r}) must be at most half of lease_ms ({lease_ms!r}), so one missed "
                "heartbeat does not end a lease; lower heartbeat_ms or raise lease_ms"
            )
        self._own_database = Database.of(database) if database is not None else None
        self._schema = schema
        self._target: tuple[Database, str] | None = None
        self._heartbeat = _Heartbeat(self)
        self._ready = False

    @property
    def actor_options(self) -> set[str]:
        return {"long_running"}

    @property
    def database(self) -> Database:
        assert self._target is not None, "LongJobs is used before it was added to a broker"
        return self._target[0]

    @property
    def schema(self) -> str:
        assert self._target is not None, "LongJobs is used before it was added to a broker"
        return self._target[1]

    def _bind(self, broker: Broker) -> None:
        if self._target is None:
            backing = backing_of(
                broker, needed_by="LongJobs", database=self._own_database, schema=self._schema, error=ActorOptionError
            )
            if backing.sends_to != "outbox":
                raise ActorOptionError(
                    f"LongJobs is for RabbitMQ brokers that send through the outbox (OutboxBroker), not "
                    f"{type(broker).__name__}; remove it: PostgresBroker already holds running jobs under a lease "
                    "and no consumer_timeout applies"
                )
            self._target = (backing.database, backing.schema)

    def is_long_running(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> bool:
        """Whether ``actor``'s jobs run under a lease: its ``long_running``, else its time limit decides."""
        option = actor.options.get("long_running")
        if option is not None:
            return bool(option)
        limit = _time_limit_ms(broker, actor)
        timeout = getattr(broker, "consumer_timeout_ms", DEFAULT_CONSUMER_TIMEOUT_MS)
        return limit is not None and isinstance(timeout, int) and limit > timeout

    # -- hooks ----------------------------------------------------------------------------------

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        self._bind(broker)
        if "long_running" in actor.options:
            check_bool(
                f"actor {actor.actor_name!r}: long_running", actor.options["long_running"], error=ActorOptionError
            )

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        if not self.is_long_running(broker, broker.get_actor(message.actor_name)):
            return
        self._bind(broker)
        token = secrets.randbits(62)
        try:
            row = self._take(message, token)
        except (psycopg.Error, PoolTimeout, SchemaNotReady) as error:
            # Fail open, as plain Dramatiq: the job runs on its unacked delivery, which RabbitMQ
            # keeps (and may deliver again past consumer_timeout), so nothing is lost.
            logger.warning(
                "long job %r (%s) runs without a lease: %s: %s; RabbitMQ keeps its delivery meanwhile",
                message.message_id,
                message.actor_name,
                type(error).__name__,
                first_line(error),
            )
            return
        if row is None:
            # Another worker runs it under a live lease: this copy is acked and skipped.
            logger.warning(
                "message %r (%s) is already running under another worker's lease; skipping this delivery",
                message.message_id,
                message.actor_name,
            )
            raise SkipMessage(f"long job {message.message_id!r} already runs elsewhere")
        self._heartbeat.hold(message.message_id, token)
        # The lease is committed: RabbitMQ can let go of the delivery before consumer_timeout.
        if not ack_now(message):
            logger.info(
                "long job %r: its delivery could not be acked early (its channel closed); RabbitMQ delivers it "
                "again and that copy is skipped while this lease lives",
                message.message_id,
            )

    def _take(self, message: MessageProxy, token: int) -> dict[str, Any] | None:
        """Write and commit the lease of ``message``; ``None`` when another worker holds a live one."""
        with self.database.autocommit() as conn:
            if not self._ready:
                # Once per process: a schema does not go back to an older version.
                schema.ensure_ready(conn, schema=self.schema, required=schema.LONG_JOBS_VERSION, feature="long jobs")
                self._ready = True
            return (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("job_lease_take", self.schema),
                    {
                        "message_id": message.message_id,
                        "queue_name": message.queue_name,
                        "actor_name": message.actor_name,
                        "body": message.encode(),
                        "priority": message.options.get("broker_priority"),
                        "owner": _OWNER,
                        "token": token,
                        "lease_s": self.lease_ms / 1000,
                    },
                )
                .fetchone()
            )

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        token = self._heartbeat.token(message.message_id)
        if token is None or exception is not None:
            return
        running = current_running.get()
        if running is not None and running.message is message and running.conn is not None:
            # Transactional Idempotency commits next: the job's key and the end of its lease
            # commit together, so no crash can leave a done job with a lease to requeue.
            running.conn.execute(
                _sql.query("job_lease_release", self.schema), {"message_id": message.message_id, "token": token}
            )

    def after_ack(self, broker: Broker, message: MessageProxy) -> None:
        self._release(message)

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        self._release(message)

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        # After, not before: a graceful stop waits for running jobs, whose leases must live on
        # meanwhile, or a relay would requeue a job that is still running.
        self._heartbeat.stop()

    def _release(self, message: MessageProxy) -> None:
        """End the lease after the job (a no-op when the job's transaction already did)."""
        token = self._heartbeat.forget(message.message_id)
        if token is None:
            return
        try:
            with self.database.autocommit() as conn:
                conn.execute(
                    _sql.query("job_lease_release", self.schema), {"message_id": message.message_id, "token": token}
                )
        except (psycopg.Error, PoolTimeout) as error:
            logger.warning(
                "could not end the lease of long job %r (%s: %s); a relay requeues it when the lease runs out",
                message.message_id,
                type(error).__name__,
                first_line(error),
            )


def reap_expired_leases(conn: psycopg.Connection[Any], schema_name: str, *, limit: int = 100) -> int:
    """Move leases that ran out back to the outbox (their worker died); the number moved.

    Relays call this; it does nothing on a schema older than version 9.
    """
    if not schema.table_exists(conn, schema_name, "job_leases"):
        return 0
    with conn.transaction():
        rows = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("job_lease_reap", schema_name), {"limit": limit})
            .fetchall()
        )
    for row in rows:
        logger.warning(
            "long job %r (%s) lost its lease (worker %s stopped extending it); requeued through the outbox (it had "
            "run %d time(s))",
            row["message_id"],
            row["actor_name"],
            row["owner"],
            row["takes"],
        )
    return len(rows)


class LeaseReaper:
    """A relay's reaper: :func:`reap_expired_leases` at most every ``interval_ms``, idle or busy.

    A relay calls :meth:`if_due` between passes and between its idle probes, so a dead worker's
    job is requeued within about a second of its lease running out, whatever the relay is doing.
    """

    def __init__(self, database: Database, schema_name: str, *, interval_ms: int = 1000) -> None:
        self.database = database
        self.schema = schema_name
        self.interval_s = check_ms("interval_ms", interval_ms, minimum=1) / 1000
        self._next = 0.0

    def if_due(self) -> int:
        """Reap now if the interval has passed; the number of jobs put back in the outbox."""
        if time.monotonic() < self._next:
            return 0
        self._next = time.monotonic() + self.interval_s
        with self.database.autocommit() as conn:
            return reap_expired_leases(conn, self.schema)


def leased_jobs(conn: psycopg.Connection[Any], schema_name: str, *, limit: int = 100) -> list[dict[str, Any]]:
    """The long jobs running now under a lease, oldest first (empty on a schema older than 9)."""
    if not schema.table_exists(conn, schema_name, "job_leases"):
        return []
    return list(
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("job_lease_list", schema_name), {"limit": limit})
        .fetchall()
    )
