"""The relay: moves committed outbox rows to RabbitMQ, and marks them only after RabbitMQ confirmed.

One pass claims a batch of rows with ``SELECT ... FOR UPDATE SKIP LOCKED`` inside a
transaction, publishes them with pipelined publisher confirms, then marks (or deletes) the
confirmed rows and commits.  A crash anywhere before that commit leaves the rows unpublished
and a later pass publishes them again with the same ``message_id``: delivery into RabbitMQ is
at least once, never zero.

Producers' inserts send the relay nothing (see :mod:`.wake`): after a pass that published it
passes again at once; after an empty one it sleeps a short, growing, jittered delay up to
``poll_interval_ms``, probing the outbox between sleeps.  It also holds a ``LISTEN``
connection, so an explicit :func:`~.wake.wake_relays` ends a sleep at once, and listens again
after a dropped connection.  With RabbitMQ unreachable it keeps the rows, backs off without
counting attempts against them, and drains when RabbitMQ returns.  A row that fails on its own
(a nack, an unroutable or oversized message) gets ``attempts`` and ``last_error`` and waits,
backing off, while the others go through.

Run it as a process (``dramatiq-reliable relay``) or inside every worker process with the
:class:`WorkerRelay` middleware; any number of relays may run at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import psycopg
from dramatiq.broker import Broker
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from .. import _sql, events, partitions, schema
from .._checks import check_bool, check_choice, check_int, check_ms
from .._util import first_line as _first_line
from .._util import redact
from ..backing import postgres_backed
from ..database import Database, DatabaseLike
from ..dedupe import purge_dedupe_keys
from ..errors import BrokerUnavailable, ConfigurationError, SchemaNotReady
from ..pooler import listen_target
from . import wake
from .events import OutboxBatchPublished, OutboxBrokerUnavailable, OutboxPublished, OutboxRowFailed, RelayedMessage
from .long_jobs import LeaseReaper
from .publisher import Publication, Publisher, PublishOutcome
from .queues import QueueSettings, QueueType

__all__ = [
    "OnPublished",
    "Relay",
    "RelayOptions",
    "RelayPass",
    "WorkerRelay",
]

logger = logging.getLogger("dramatiq_reliable.outbox.relay")

_MAX_ERROR_CHARS = 2000
# Postgres's integer: the outbox's attempts column, and statement_timeout in milliseconds.
# max_attempts=None claims rows below it: a bound no row reaches.
_INT_MAX = 2**31 - 1
_WAIT_SLICE_S = 0.2


@dataclasses.dataclass(frozen=True)
class RelayPass:
    """What one pass did: rows published and rows that failed on their own."""

    published: int
    failed: int
    #: Rows claimed but left for the next pass by ``max_batch_bytes``.
    deferred: int = 0

    @property
    def claimed(self) -> int:
        return self.published + self.failed + self.deferred


#: What the relay does with a row once RabbitMQ confirmed it.
OnPublished = Literal["mark", "delete"]


@dataclasses.dataclass(frozen=True)
class RelayOptions:
    """How a relay runs, validated once, where it is built; kept as ``relay.options``.

    The defaults written here are the defaults of the keyword arguments of :class:`Relay`,
    :meth:`Relay.from_broker`, :class:`WorkerRelay` and
    :func:`~dramatiq_reliable.testing.drain_outbox`.  See :class:`Relay` for each field.
    """

    batch_size: int = 500
    poll_interval_ms: int = 250
    on_published: OnPublished = "mark"
    retention_ms: int | None = 24 * 3600 * 1000
    purge_interval_ms: int = 60_000
    confirm_timeout_ms: int = 30_000
    backoff_min_ms: int = 200
    backoff_max_ms: int = 30_000
    row_backoff_max_ms: int = 300_000
    listen: bool = True
    max_batch_bytes: int = 4 * 1024 * 1024
    max_attempts: int | None = 25
    statement_timeout_ms: int = 30_000
    listen_database: DatabaseLike | None = None

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, minimum=1, maximum=_INT_MAX)
        check_ms("poll_interval_ms", self.poll_interval_ms, minimum=1)
        check_choice("on_published", self.on_published, ("mark", "delete"))
        check_ms("retention_ms", self.retention_ms, allow_none=True, fix="None keeps published rows")
        check_ms("purge_interval_ms", self.purge_interval_ms, minimum=1)
        check_ms("confirm_timeout_ms", self.confirm_timeout_ms, minimum=1)
        check_ms("backoff_min_ms", self.backoff_min_ms, minimum=1)
        check_ms("backoff_max_ms", self.backoff_max_ms, minimum=self.backoff_min_ms)
        check_ms("row_backoff_max_ms", self.row_backoff_max_ms, minimum=1)
        check_bool("listen", self.listen)
        check_int("max_batch_bytes", self.max_batch_bytes, minimum=1)
        check_int("max_attempts", self.max_attempts, minimum=1, maximum=_INT_MAX, allow_none=True)
        # Postgres holds statement_timeout as an int of milliseconds.
        check_ms("statement_timeout_ms", self.statement_timeout_ms, minimum=1, maximum=_INT_MAX)


class Relay:
    """Forwards outbox rows to RabbitMQ.  Build it with :meth:`from_broker` in most apps.

    Parameters:
      rabbitmq_url: RabbitMQ URL (or ``parameters``: pika connection parameters).
      database: where the outbox lives: a URL, a ``psycopg_pool.ConnectionPool`` or a
        :class:`~dramatiq_reliable.Database`.
      schema: the Postgres schema of the tables.
      max_priority: as for ``RabbitmqBroker``: the queues are declared with it, so it must
        match the workers' setting (:meth:`from_broker` takes the broker's).
      queue_type / queue_types / delivery_limit: as for ``OutboxBroker``, for the same reason.
      batch_size: rows claimed and published per pass.
      poll_interval_ms: the idle ceiling: the longest sleep between probes of an idle outbox,
        and so the longest a row committed after a long idle waits for this relay.  After an
        empty pass the relay sleeps about 1 ms, a quarter longer each time (jittered) up to
        this; each sleep ends with one probe of the outbox (one index lookup), so an idle
        relay costs about ``1000 / (0.75 * poll_interval_ms)`` queries a second.
      on_published: ``"mark"`` sets ``published_at`` (rows kept for ``retention_ms``, handy
        for audits) or ``"delete"`` removes rows as soon as they are confirmed.
      retention_ms: how long published rows are kept; ``None`` keeps them until purged by hand.
      purge_interval_ms: how often the relay purges rows past retention.
      confirm_timeout_ms: how long to wait for RabbitMQ's confirms of a batch.  Rows confirmed
        by then are marked; each unconfirmed row gets an attempt counted and backs off (unless
        RabbitMQ turns out to be unreachable: then no row is charged).
      backoff_min_ms / backoff_max_ms: the wait after RabbitMQ or Postgres was unreachable.
      row_backoff_max_ms: the longest wait of a row that keeps failing on its own.
      listen: hold a ``LISTEN`` connection, so :func:`~dramatiq_reliable.outbox.wake_relays`
        ends an idle sleep at once; the probes between sleeps run on it.  ``False`` (PgBouncer
        in transaction mode) holds no connection: explicit wake-ups are not heard, and each
        idle step runs a pass through the pool instead of a probe.  Either way the relay finds
        new rows by itself within ``poll_interval_ms``.
      max_batch_bytes: a pass stops adding rows once their bodies reach this many bytes (a
        first row larger than that goes alone), so one large row cannot make the small rows
        beside it wait for its transfer.  The rows left out go in the next pass, also in
        :meth:`drain`.
      max_attempts: after this many failed attempts a row is no longer claimed (the poison
        path): it stays in the outbox, counted as failing, with its ``last_error``, until
        ``dramatiq-reliable outbox retry`` resets it.  ``None`` retries forever.
      statement_timeout_ms: server-side bound of each of the relay's own statements; its
        transaction is also closed by Postgres if it idles past ``confirm_timeout_ms`` plus this.
      listen_database: a direct Postgres URL (or Database) for the ``LISTEN`` connection when
        ``database`` is behind a transaction pooler; without it the relay detects the pooler and polls.

    Every option is keyword-only, validated once by :class:`RelayOptions` (a
    :class:`~dramatiq_reliable.errors.ConfigurationError` naming the option), and kept as
    ``relay.options``; a misspelt one is Python's ``TypeError`` naming it.
    """

    def __init__(
        self,
        *,
        rabbitmq_url: str | None = None,
        parameters: Any = None,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        max_priority: int | None = None,
        queue_type: QueueType = "classic",
        queue_types: Mapping[str, QueueType] | None = None,
        delivery_limit: int | None = 20,
        batch_size: int = RelayOptions.batch_size,
        poll_interval_ms: int = RelayOptions.poll_interval_ms,
        on_published: OnPublished = RelayOptions.on_published,
        retention_ms: int | None = RelayOptions.retention_ms,
        purge_interval_ms: int = RelayOptions.purge_interval_ms,
        confirm_timeout_ms: int = RelayOptions.confirm_timeout_ms,
        backoff_min_ms: int = RelayOptions.backoff_min_ms,
        backoff_max_ms: int = RelayOptions.backoff_max_ms,
        row_backoff_max_ms: int = RelayOptions.row_backoff_max_ms,
        listen: bool = RelayOptions.listen,
        max_batch_bytes: int = RelayOptions.max_batch_bytes,
        max_attempts: int | None = RelayOptions.max_attempts,
        statement_timeout_ms: int = RelayOptions.statement_timeout_ms,
        listen_database: DatabaseLike | None = RelayOptions.listen_database,
    ) -> None:
        import pika

        if (rabbitmq_url is None) == (parameters is None):
            raise ConfigurationError("pass exactly one of rabbitmq_url= and parameters= to Relay")
        self.options = RelayOptions(
            batch_size=batch_size,
            poll_interval_ms=poll_interval_ms,
            on_published=on_published,
            retention_ms=retention_ms,
            purge_interval_ms=purge_interval_ms,
            confirm_timeout_ms=confirm_timeout_ms,
            backoff_min_ms=backoff_min_ms,
            backoff_max_ms=backoff_max_ms,
            row_backoff_max_ms=row_backoff_max_ms,
            listen=listen,
            max_batch_bytes=max_batch_bytes,
            max_attempts=max_attempts,
            statement_timeout_ms=statement_timeout_ms,
            listen_database=listen_database,
        )
        self.max_priority: int | None = check_int("max_priority", max_priority, minimum=1, maximum=255, allow_none=True)
        queues = QueueSettings(
            queue_type=queue_type,
            queue_types=dict(queue_types or {}),
            max_priority=max_priority,
            delivery_limit=delivery_limit,
        )
        self.schema = _sql.validate_schema(schema)
        self.database = Database.of(database)
        self.batch_size = self.options.batch_size
        self.poll_interval_s = self.options.poll_interval_ms / 1000
        self.on_published = self.options.on_published
        self.retention_ms = self.options.retention_ms
        self.purge_interval_s = self.options.purge_interval_ms / 1000
        self.reaper = LeaseReaper(self.database, self.schema)  # long jobs whose worker died
        self.backoff_min_s = self.options.backoff_min_ms / 1000
        self.backoff_max_s = self.options.backoff_max_ms / 1000
        self.row_backoff_max_s = self.options.row_backoff_max_ms / 1000
        self.listen = self.options.listen
        if parameters is None:
            parameters = [pika.URLParameters(u) for u in str(rabbitmq_url).split(";")]
            parameters = parameters[0] if len(parameters) == 1 else parameters
        self.publisher = Publisher(parameters, confirm_timeout_ms=self.options.confirm_timeout_ms, queues=queues)
        self._stop = threading.Event()
        self._checked_schema = False
        self._listener: psycopg.Connection[Any] | None = None
        # The idle sleep in progress, in seconds (None while passing): tests and debuggers read it.
        self._sleeping_s: float | None = None
        self._mark = "outbox_mark_published"  # outbox_move_published once partitions are enabled

    @classmethod
    def from_broker(
        cls,
        broker: Broker,
        *,
        batch_size: int = RelayOptions.batch_size,
        poll_interval_ms: int = RelayOptions.poll_interval_ms,
        on_published: OnPublished = RelayOptions.on_published,
        retention_ms: int | None = RelayOptions.retention_ms,
        purge_interval_ms: int = RelayOptions.purge_interval_ms,
        confirm_timeout_ms: int = RelayOptions.confirm_timeout_ms,
        backoff_min_ms: int = RelayOptions.backoff_min_ms,
        backoff_max_ms: int = RelayOptions.backoff_max_ms,
        row_backoff_max_ms: int = RelayOptions.row_backoff_max_ms,
        listen: bool = RelayOptions.listen,
        max_batch_bytes: int = RelayOptions.max_batch_bytes,
        max_attempts: int | None = RelayOptions.max_attempts,
        statement_timeout_ms: int = RelayOptions.statement_timeout_ms,
        listen_database: DatabaseLike | None = RelayOptions.listen_database,
    ) -> Relay:
        """A relay that shares ``broker``'s RabbitMQ parameters, pool, schema and queue settings.

        The options are :class:`Relay`'s; where the relay publishes and what it reads come
        from the broker, so the relay always declares the queues as its workers do.
        """
        backed = _outbox_broker(broker)
        if backed is None:
            raise ConfigurationError(
                f"Relay.from_broker() needs a broker that sends through the outbox to RabbitMQ (OutboxBroker), "
                f"got {type(broker).__name__!r}; build your broker with dramatiq_reliable.OutboxBroker"
            )
        return cls(
            parameters=backed.parameters,
            database=backed.database,
            schema=backed.schema,
            max_priority=backed.queues.max_priority,
            queue_type=backed.queues.queue_type,
            queue_types=backed.queues.queue_types,
            delivery_limit=backed.queues.delivery_limit,
            batch_size=batch_size,
            poll_interval_ms=poll_interval_ms,
            on_published=on_published,
            retention_ms=retention_ms,
            purge_interval_ms=purge_interval_ms,
            confirm_timeout_ms=confirm_timeout_ms,
            backoff_min_ms=backoff_min_ms,
            backoff_max_ms=backoff_max_ms,
            row_backoff_max_ms=row_backoff_max_ms,
            listen=listen,
            max_batch_bytes=max_batch_bytes,
            max_attempts=max_attempts,
            statement_timeout_ms=statement_timeout_ms,
            listen_database=listen_database,
        )

    # -- one pass --------------------------------------------------------------------------

    def drain_once(self) -> RelayPass:
        """Claim one batch, publish it, record the outcome and commit.

        Raises ``BrokerUnavailable`` when RabbitMQ cannot be reached (after marking the rows it
        confirmed before the connection went, if any; no attempt is counted against the rest),
        and psycopg errors when Postgres cannot.
        """
        batch = self._claim()
        return RelayPass(0, 0) if batch is None else self._pass(batch)

    def _pass(self, batch: _Batch) -> RelayPass:
        """Publish ``batch``, record the outcome, commit and report, all on this thread."""
        outcome = self._publish(batch)
        batch.finish(self, outcome)
        self._report(batch, outcome)
        if outcome.unavailable is not None:
            raise outcome.unavailable
        return batch.result(outcome)

    def _claim(self) -> _Batch | None:
        """Lock the next rows in a transaction left open on a pooled connection (``None``: no rows)."""
        started = time.perf_counter()
        options = self.options
        with contextlib.ExitStack() as stack:
            conn = stack.enter_context(self.database.connection())
            stack.enter_context(conn.transaction())
            # Our own transaction: bound it server-side (it idles while RabbitMQ confirms) and
            # keep the claim on its index whatever the statistics say.
            conn.execute(
                _sql.query("outbox_relay_local", self.schema),
                {
                    "statement_timeout": str(options.statement_timeout_ms),
                    "idle_timeout": str(_idle_timeout_ms(options)),
                },
            )
            if not self._checked_schema:
                schema.ensure_ready(conn, schema=self.schema, required=schema.OUTBOX_VERSION, feature="outbox")
                self._checked_schema = True
            claimed = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("outbox_claim", self.schema),
                    {"batch_size": self.batch_size, "max_attempts": options.max_attempts or _INT_MAX},
                )
                .fetchall()
            )
            if not claimed:
                return None
            publications = [
                Publication(
                    key=row["id"],
                    routing_key=row["queue_name"],
                    body=bytes(row["body"]),
                    message_id=row["message_id"],
                    priority=row["priority"],
                )
                for row in _within_bytes(claimed, options.max_batch_bytes)
            ]
            return _Batch(stack.pop_all(), conn, len(claimed), publications, started)
        raise AssertionError("unreachable")  # pragma: no cover - the block returns

    def _publish(self, batch: _Batch) -> PublishOutcome:
        """Publish ``batch``; on any error its transaction rolls back (no row is touched) and it propagates."""
        batch.publish_started_ns = time.time_ns()
        try:
            return self.publisher.publish(batch.publications)
        except BaseException as error:
            batch.abort(error)
            raise
        finally:
            batch.publish_ended_ns = time.time_ns()

    def _report(self, batch: _Batch, outcome: PublishOutcome) -> None:
        """Tell listeners what a committed pass did."""
        if outcome.confirmed:
            duration_ms = (batch.committed_at - batch.started) * 1000
            events.emit(OutboxPublished(len(outcome.confirmed), self.schema, duration_ms))
        if events.has_listeners():
            confirmed = set(outcome.confirmed)
            relayed = tuple(
                RelayedMessage(p.message_id, p.routing_key, p.body, outcome.failed.get(p.key))
                for p in batch.publications
                if p.key in confirmed or p.key in outcome.failed
            )
            events.emit(OutboxBatchPublished(self.schema, batch.publish_started_ns, batch.publish_ended_ns, relayed))

    def _record_failures(
        self,
        conn: psycopg.Connection[Any],
        publications: list[Publication],
        failed: dict[int, str],
        timed_out: set[int],
    ) -> None:
        attempts: dict[int, int] = {}
        # A row that outlasted the confirm timeout cost the relay that long: it waits at least
        # as long before its next try, so the rows behind it get most of the relay's time.
        confirm_s = self.options.confirm_timeout_ms / 1000
        for ids, base_s in (
            ([i for i in failed if i not in timed_out], self.backoff_min_s),
            ([i for i in failed if i in timed_out], max(self.backoff_min_s, confirm_s)),
        ):
            if not ids:
                continue
            recorded = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("outbox_record_failure", self.schema),
                    {
                        "ids": ids,
                        "errors": [failed[i][:_MAX_ERROR_CHARS] for i in ids],
                        "base_s": base_s,
                        "max_s": max(self.row_backoff_max_s, base_s),
                    },
                )
                .fetchall()
            )
            attempts.update((row["id"], row["attempts"]) for row in recorded)
        by_key = {publication.key: publication for publication in publications}
        for row_id, reason in failed.items():
            error = reason[:_MAX_ERROR_CHARS]
            publication = by_key[row_id]
            count = attempts.get(row_id, 0)
            events.emit(OutboxRowFailed(row_id, publication.message_id, publication.routing_key, count, error))
            if self.options.max_attempts is not None and count >= self.options.max_attempts:
                logger.error(
                    "outbox row %d (message %s, queue %r) failed %d times and is no longer relayed: %s; fix the "
                    "cause, then run 'dramatiq-reliable outbox retry' (or delete the row)",
                    row_id,
                    publication.message_id,
                    publication.routing_key,
                    count,
                    error,
                )

    def drain(self) -> int:
        """Run passes until the backlog is empty (or the relay is stopped); return rows published.

        A pass that claimed a full batch, or that ``max_batch_bytes`` cut short (rows left for
        later, however few), is not the end of the backlog: another pass follows.  Under a
        backlog a helper thread claims the next batch while RabbitMQ confirms the one in hand,
        and records that one's outcome while the next is published, so Postgres round trips
        overlap the publishing instead of adding to it.  Each batch keeps its own transaction:
        a row is marked only after its confirm, as in :meth:`drain_once`.  A backlog that fits
        in one pass is drained on the calling thread alone, with no helper thread started.
        """
        if self._stop.is_set():
            return 0
        batch = self._claim()
        if batch is None:
            return 0
        if not self._more_after(batch):
            return self._pass(batch).published
        return self._drain_overlapped(batch)

    def _more_after(self, batch: _Batch) -> bool:
        """Whether rows may wait after ``batch``: it claimed a full batch, or left rows for later.

        A batch that ``max_batch_bytes`` cut short locked rows it did not publish: they are the
        backlog's next rows however few were claimed.
        """
        full_or_cut = batch.claimed >= self.batch_size or batch.deferred > 0
        return full_or_cut and not self._stop.is_set()

    def _drain_overlapped(self, first: _Batch) -> int:
        """:meth:`drain` under a backlog: Postgres work on a helper thread, publishing on this one.

        The helper runs one task at a time, in order: the claim of batch N+1 (started before
        batch N is published), then batch N's marks and commit (after N's confirms), then the
        claim of N+2, and so on.  At most two batches hold a connection at once.
        """
        total = 0
        batch: _Batch | None = first
        ahead: Future[_Batch | None] | None = None
        finishing: tuple[Future[None], _Batch, PublishOutcome] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dramatiq-reliable-relay-db") as helper:
            try:
                while batch is not None:
                    more = self._more_after(batch)
                    # Rows a batch left for later (max_batch_bytes) stay locked until it commits: claim
                    # after that commit, so they go out next, as without the helper.
                    overlap = more and not batch.deferred
                    ahead = helper.submit(self._claim) if overlap else None
                    outcome = self._publish(batch)
                    done = helper.submit(batch.finish, self, outcome)
                    if more and not overlap:
                        ahead = helper.submit(self._claim)
                    previous, finishing = finishing, (done, batch, outcome)
                    if previous is not None:
                        total += self._settle(*previous)
                    if outcome.unavailable is not None:
                        raise outcome.unavailable
                    batch = ahead.result() if ahead is not None else None
                    ahead = None
                if finishing is not None:
                    total += self._settle(*finishing)
                    finishing = None
            except BaseException:
                # Whatever failed, batches claimed ahead roll back (untouched, claimed again later)
                # and a batch whose commit is under way is waited for and reported.
                if ahead is not None:
                    helper.submit(_abandon, ahead).result()
                if finishing is not None:
                    try:
                        self._settle(*finishing)
                    except Exception:
                        logger.warning("outbox relay could not record a batch's outcome", exc_info=True)
                raise
        return total

    def _settle(self, done: Future[None], batch: _Batch, outcome: PublishOutcome) -> int:
        """Wait for ``batch``'s commit, report it, and return the rows it published."""
        done.result()
        self._report(batch, outcome)
        return len(outcome.confirmed)

    def purge(self, *, older_than_ms: int | None = None, batch_size: int = 5000) -> int:
        """Delete published rows older than ``older_than_ms`` (default: ``retention_ms``); maintain partitions."""
        if older_than_ms is None:
            if self.retention_ms is None:
                raise ConfigurationError(
                    "this relay keeps published rows (retention_ms=None); pass older_than_ms= to purge()"
                )
            older_than_ms = self.retention_ms
        self._mark = partitions.maintain_for_relay(self.database, schema=self.schema)  # drops expired ones too
        return purge_published(self.database, schema=self.schema, older_than_ms=older_than_ms, batch_size=batch_size)

    # -- the loop --------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return after the batch in hand; safe from signal handlers."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Relay until :meth:`stop` is called.

        Never raises: outages of Postgres or RabbitMQ, and a schema not migrated yet (a worker
        booted before a rolling deploy's migration), are logged and waited out with backoff.
        """
        failures = 0
        # Consecutive idle steps: the backoff between probes grows with it, a pass that
        # publishes resets it.
        idle_step = 0
        next_purge = time.monotonic()
        logger.info("outbox relay started on schema %r", self.schema)
        try:
            while not self._stop.is_set():
                try:
                    if self.listen and self._listener is None:
                        self._listener = self._open_listener()
                    published = self.drain()
                    if failures:
                        logger.warning("outbox relay recovered after %d failed attempts", failures)
                    failures = 0
                    if self.retention_ms is not None and time.monotonic() >= next_purge:
                        self.purge()
                        purge_dedupe_keys(self.database, schema=self.schema)
                        next_purge = time.monotonic() + self.purge_interval_s
                    published += self.reaper.if_due()  # requeued rows are published on the next pass
                    if published:
                        # Rows arrive in runs: the next ones are probably committed already.
                        idle_step = 0
                        continue
                    idle_step = self._wait(idle_step)
                except BrokerUnavailable as error:
                    failures += 1
                    delay = self._backoff(failures)
                    events.emit(OutboxBrokerUnavailable(str(error), int(delay * 1000)))
                    self._stop.wait(delay)
                except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as error:
                    failures += 1
                    delay = self._backoff(failures)
                    logger.warning(
                        "outbox relay cannot reach Postgres (%s: %s); retrying in %.1fs",
                        type(error).__name__,
                        redact(_first_line(error)),
                        delay,
                    )
                    self._close_listener()
                    self._stop.wait(delay)
                except SchemaNotReady as error:
                    # A worker may boot before a rolling deploy ran its migrations: keep checking.
                    failures += 1
                    delay = self._backoff(failures)
                    logger.error("outbox relay waiting for the schema: %s; checking again in %.1fs", error, delay)
                    self._checked_schema = False
                    self._close_listener()
                    self._stop.wait(delay)
                except Exception:
                    # Never die quietly: a relay that stops leaves work stranded in the outbox.
                    failures += 1
                    delay = self._backoff(failures)
                    logger.exception("outbox relay failed unexpectedly; retrying in %.1fs", delay)
                    self._close_listener()
                    self._stop.wait(delay)
        finally:
            self._close_listener()
            self.publisher.close()
            logger.info("outbox relay stopped")

    def _backoff(self, failures: int) -> float:
        ceiling = min(self.backoff_max_s, self.backoff_min_s * 2 ** min(failures - 1, 20))
        return random.uniform(ceiling / 2, ceiling)

    def _open_listener(self) -> psycopg.Connection[Any] | None:
        try:
            target = listen_target(self.database, self.options.listen_database, who="outbox relay")
        except ConfigurationError as error:
            logger.error("%s; the relay polls instead", error)
            target = None
        if target is None:  # behind a transaction pooler: listen=False from now on
            self.listen = False
            return None
        conn = target.connect(autocommit=True)
        try:
            conn.execute(
                _sql.query("outbox_waiter_timeout", self.schema),
                {"statement_timeout": str(self.options.statement_timeout_ms)},
            )
            conn.execute(_sql.query("outbox_listen", self.schema, channel=wake.channel(self.schema)))
        except BaseException:
            conn.close()
            raise
        return conn

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:  # pragma: no cover - closing a broken connection
                logger.debug("error closing the LISTEN connection", exc_info=True)
            self._listener = None

    def _wait(self, step: int) -> int:
        """Sleep until rows may be claimable; return the idle step to resume the backoff from.

        Sleeps grow from about 1 ms to ``poll_interval_ms`` (jittered, so relays that went
        idle together do not probe in lockstep), each followed by a probe of the outbox, and
        end early when the probe said a delayed row falls due sooner, so a delay is published
        within milliseconds of its due time, never a poll interval late.  A
        NOTIFY (:func:`~.wake.wake_relays`) ends the wait at once and resets the backoff; a
        probe that sees rows ends it without a reset, so rows another relay holds locked (or
        that fail on their own) do not make this one spin.
        """
        due_in_s: float | None = None
        while not self._stop.is_set():
            delay_s = wake.idle_delay_s(step, ceiling_s=self.poll_interval_s, first_s=wake.FIRST_IDLE_S)
            if due_in_s is not None and due_in_s < delay_s:
                # A delayed row falls due first: wake for it, not a poll interval later.
                delay_s = max(due_in_s, wake.FIRST_IDLE_S)
            step += 1
            if self._sleep(delay_s):
                return 0
            if self._stop.is_set() or self.reaper.if_due():
                return step
            due_in_s = self._probe()
            if due_in_s is not None and due_in_s <= 0:
                return step
        return step

    def _sleep(self, delay_s: float) -> bool:
        """Sleep ``delay_s``; ``True`` if a NOTIFY ended it early (``stop()`` also ends it)."""
        deadline = time.monotonic() + delay_s
        self._sleeping_s = delay_s
        try:
            while not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if self._listener is None:
                    self._stop.wait(min(remaining, _WAIT_SLICE_S))
                    continue
                # Short slices keep stop() responsive; a notify ends the wait at once.
                for _ in self._listener.notifies(timeout=min(remaining, _WAIT_SLICE_S), stop_after=1):
                    return True
            return False
        finally:
            self._sleeping_s = None

    def _probe(self) -> float | None:
        """Seconds until the next row falls due (0 or less: a pass would find rows; ``None``: no
        row waits): one autocommit query on the LISTEN connection.

        Without one (``listen=False``) the pass itself is the probe (``0``).
        """
        if self._listener is None:
            return 0.0
        row = (
            self._listener.cursor(row_factory=dict_row)
            .execute(_sql.query("outbox_probe", self.schema), {"max_attempts": self.options.max_attempts or _INT_MAX})
            .fetchone()
        )
        return None if row is None or row["due_in_s"] is None else float(row["due_in_s"])


class _Batch:
    """Claimed rows, locked by a transaction left open on a pooled connection until finished.

    ``finish`` records the outcome and commits; ``abort`` rolls back.  Either may run on
    another thread than the claim, never at the same time as any other use of the batch.
    """

    def __init__(
        self,
        stack: contextlib.ExitStack,
        conn: psycopg.Connection[Any],
        claimed: int,
        publications: list[Publication],
        started: float,
    ) -> None:
        self._stack = stack
        self.conn = conn
        #: Rows locked, those left for later by ``max_batch_bytes`` included.
        self.claimed = claimed
        #: The leading rows within ``max_batch_bytes``: what this batch publishes.
        self.publications = publications
        #: Rows locked but left for the next pass by ``max_batch_bytes``.
        self.deferred = claimed - len(publications)
        self.started = started
        self.committed_at = started
        self.publish_started_ns = 0
        self.publish_ended_ns = 0

    def finish(self, relay: Relay, outcome: PublishOutcome) -> None:
        """Mark (or delete) the confirmed rows, charge the failed ones, commit."""
        try:
            if outcome.confirmed:
                done = "outbox_delete_published" if relay.on_published == "delete" else relay._mark
                self.conn.execute(_sql.query(done, relay.schema), {"ids": outcome.confirmed})
            if outcome.failed:
                relay._record_failures(self.conn, self.publications, outcome.failed, outcome.timed_out)
        except BaseException as error:
            self.abort(error)
            raise
        self._stack.close()
        self.committed_at = time.perf_counter()

    def abort(self, error: BaseException) -> None:
        """Roll back: every claimed row is left as it was."""
        self._stack.__exit__(type(error), error, error.__traceback__)

    def result(self, outcome: PublishOutcome) -> RelayPass:
        # Rows left out by max_batch_bytes count as claimed: drain() goes on to the next pass.
        return RelayPass(len(outcome.confirmed), len(outcome.failed), self.deferred)


def _idle_timeout_ms(options: RelayOptions) -> int:
    """How long Postgres lets a claim's transaction idle: the confirms (twice, the one-by-one
    retry of a channel error) and a statement, within Postgres's integer of milliseconds."""
    return min(_INT_MAX, 2 * options.confirm_timeout_ms + options.statement_timeout_ms)


def _abandon(claim: Future[_Batch | None]) -> None:
    """Roll back a batch claimed ahead and never published (a claim that failed is ignored)."""
    try:
        batch = claim.result()
    except Exception:
        return
    if batch is not None:
        batch.abort(psycopg.Rollback())


def _within_bytes(rows: list[dict[str, Any]], max_bytes: int) -> list[dict[str, Any]]:
    """The leading rows whose bodies fit in ``max_bytes`` (always the first one)."""
    total = 0
    for index, row in enumerate(rows):
        total += int(row["size"])
        if total > max_bytes and index > 0:
            return rows[:index]
    return rows


def purge_published(database: DatabaseLike, *, schema: str, older_than_ms: int, batch_size: int = 5000) -> int:
    """Delete published outbox rows older than ``older_than_ms``, in batches; return the count."""
    database = Database.of(database)
    check_ms("older_than_ms", older_than_ms)
    check_int("batch_size", batch_size, minimum=1, maximum=_INT_MAX)
    total = 0
    while True:
        with database.connection() as conn, conn.transaction():
            deleted = conn.execute(
                _sql.query("outbox_purge", _sql.validate_schema(schema)),
                {"older_than_s": older_than_ms / 1000, "batch": batch_size},
            ).rowcount
        total += deleted
        if deleted < batch_size:
            return total


class WorkerRelay(Middleware):
    """Runs a relay thread inside every worker process, so no separate relay process is needed.

    Each worker process drains the outbox; SKIP LOCKED keeps them from publishing a row twice
    in the same pass.  The thread starts when the worker boots and stops, finishing its batch,
    when the worker shuts down.

    The options are :class:`Relay`'s, checked here, where a mistake is written (at worker boot
    Dramatiq would only log it); the RabbitMQ parameters, pool, schema and ``max_priority``
    come from the broker.

    >>> broker = OutboxBroker(url=..., database=...)        # doctest: +SKIP
    >>> broker.add_middleware(WorkerRelay())                     # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        batch_size: int = RelayOptions.batch_size,
        poll_interval_ms: int = RelayOptions.poll_interval_ms,
        on_published: OnPublished = RelayOptions.on_published,
        retention_ms: int | None = RelayOptions.retention_ms,
        purge_interval_ms: int = RelayOptions.purge_interval_ms,
        confirm_timeout_ms: int = RelayOptions.confirm_timeout_ms,
        backoff_min_ms: int = RelayOptions.backoff_min_ms,
        backoff_max_ms: int = RelayOptions.backoff_max_ms,
        row_backoff_max_ms: int = RelayOptions.row_backoff_max_ms,
        listen: bool = RelayOptions.listen,
        max_batch_bytes: int = RelayOptions.max_batch_bytes,
        max_attempts: int | None = RelayOptions.max_attempts,
        statement_timeout_ms: int = RelayOptions.statement_timeout_ms,
        listen_database: DatabaseLike | None = RelayOptions.listen_database,
    ) -> None:
        self.options = RelayOptions(
            batch_size=batch_size,
            poll_interval_ms=poll_interval_ms,
            on_published=on_published,
            retention_ms=retention_ms,
            purge_interval_ms=purge_interval_ms,
            confirm_timeout_ms=confirm_timeout_ms,
            backoff_min_ms=backoff_min_ms,
            backoff_max_ms=backoff_max_ms,
            row_backoff_max_ms=row_backoff_max_ms,
            listen=listen,
            max_batch_bytes=max_batch_bytes,
            max_attempts=max_attempts,
            statement_timeout_ms=statement_timeout_ms,
            listen_database=listen_database,
        )
        self.relay: Relay | None = None
        self._thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        if _outbox_broker(broker) is None:
            logger.error(
                "WorkerRelay needs a broker that sends through the outbox (OutboxBroker), got %s; no relay runs "
                "in this worker",
                type(broker).__name__,
            )
            return
        self.relay = Relay.from_broker(
            broker, **{f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
        )
        self._thread = threading.Thread(target=self.relay.run, name="dramatiq-reliable-relay", daemon=True)
        self._thread.start()

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self.relay is not None and self._thread is not None:
            self.relay.stop()
            # The batch in hand may wait out its confirms (twice: the one-by-one retry of a
            # channel error) and a statement: past that bound, the uncommitted claim rolls back
            # and a later pass publishes those rows again (at least once, never lost).
            options = self.relay.options
            self._thread.join(timeout=(2 * options.confirm_timeout_ms + options.statement_timeout_ms) / 1000 + 5)
            self.relay = None
            self._thread = None


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a relay built from a broker takes from it: where to publish and where the rows are."""

    parameters: Any
    queues: QueueSettings
    database: Database
    schema: str


def _outbox_broker(broker: object) -> _Source | None:
    """Where ``broker``'s sends go and are published from, if it sends to the outbox and has RabbitMQ
    parameters to publish with; else ``None``."""
    backed = postgres_backed(broker)
    if backed is None or backed.sends_to != "outbox" or not isinstance(broker, RabbitmqBroker):
        return None
    queues = getattr(broker, "queue_settings", None) or QueueSettings(max_priority=broker.max_priority)
    return _Source(broker.parameters, queues, backed.database, backed.schema)
