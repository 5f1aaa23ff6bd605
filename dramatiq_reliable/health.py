"""Health numbers: queue depth, outbox backlog and age, dead letters, per queue, as a library.

One function, :func:`collect_health`, reads them from Postgres and RabbitMQ, and
:func:`check_health` compares a reading with :class:`Thresholds`.  Everything that shows health
reads it from here: the ``dramatiq-reliable status`` command prints it as a table or JSON (and,
with ``--check``, exits non-zero naming what crossed a line), and the
:class:`~dramatiq_reliable.Tracing` middleware turns the same reading into observable gauges
through a :class:`HealthMonitor`, which caches it for a few seconds so a metrics scrape never
hammers the database.  This module holds no command-line code.

What each number means, and why it matters:

* ``depth``: messages waiting in the queue.  Growing steadily means workers cannot keep up.
* ``delayed``: messages waiting for their time (RabbitMQ's ``<queue>.DQ``, or Postgres queue
  rows not yet due).  Delayed messages a worker has already fetched from RabbitMQ sit unacked
  in its memory, which RabbitMQ's passive declare does not count.
* ``xq``: failed messages kept by the broker (RabbitMQ's ``<queue>.XQ``, or Postgres queue rows
  kept as ``.XQ``).  Named after the queue, not "dead", so that "dead letters" means one thing:
  the rows in the dead-letter table.
* ``queue_oldest_age_s``: Postgres queues only: how long the oldest message ready to run has
  waited.  The surest sign of stopped workers (RabbitMQ does not tell a message's age over AMQP).
* ``xq_unstored``: messages in ``<queue>.XQ`` whose death has no dead-letter row (a capture
  that failed while Postgres was down): out of reach of ``replay`` until
  ``dramatiq-reliable dead-letters import-xq`` moves them.  Read only when asked for
  (``xq_unstored=True``): it fetches the ``.XQ`` bodies, unacked, and puts them back.
* ``outbox_backlog`` / ``outbox_oldest_age_s``: committed messages due and not yet published
  (the age counts from when the row fell due).  An old row is the signal of a relay that
  quietly died.
* ``outbox_scheduled``: outbox rows waiting for their due time (delayed sends, retries'
  backoff, delayed replays): they wait in Postgres, not in a worker, and are no backlog.
* ``dead_letters`` / ``dead_letters_newest_age_s``: rows in the dead-letter table not yet
  replayed, and how recent the last failure is.
* ``retries_waiting``: retries scheduled but not yet due, read from the outbox (the ones
  scheduled by older versions, sent on to ``.DQ`` at once, only where the relay keeps
  published rows, ``on_published="mark"``); the command only, as it scans.

**Where a queue's messages are.**  A queue's messages can wait in two places: rows of the
Postgres queue table (``PostgresBroker``) and messages in RabbitMQ (``OutboxBroker``, after the
relay).  Both are read, and ``depth``, ``delayed`` and ``xq`` are their **sum**, while
``in_postgres`` and ``in_rabbitmq`` (:class:`SourceCounts`) keep each place's own numbers.
Summed, not one preferred: the two places never hold the same message, so the sum is the work
waiting, which is what a threshold must see; and while a deployment moves from one broker to the
other (both hold messages for a while) each place's number says how far the move has come.  A
total is ``None`` when a place that may hold messages was not read, or could not be (its part
is unknown, not zero: RabbitMQ not read in a schema whose outbox was used, say); the other part
stays in its ``in_*`` field, and :func:`check_health` still flags a part over a limit.
In Postgres, ``depth`` counts rows ready to run and rows a worker has claimed; RabbitMQ's counts
ready messages only (its unacked deliveries are not in a passive declare).

**When RabbitMQ is read.**  :func:`collect_health` reads RabbitMQ when given a
:class:`QueueDepths`; with ``rabbitmq_only_if_used=True`` only if the schema shows RabbitMQ in use:
anything was ever written to the outbox (its id sequence was used; a relay publishes the outbox
to RabbitMQ).  A ``PostgresBroker`` deployment never writes to the outbox, so its reading does
not depend on a RabbitMQ it does not have, and its totals are the queue table's alone.  ``dramatiq-reliable status`` passes it when no
RabbitMQ URL was configured (neither ``--rabbitmq-url`` nor ``$RABBITMQ_URL``): a configured URL
is always read, and an unreachable one is an outage.  :attr:`Health.rabbitmq_skipped` says why
RabbitMQ was not read.

>>> health = collect_health(database="postgresql://app@localhost/app", queues=["orders"])  # doctest: +SKIP
>>> health.queue("orders").outbox_backlog                                                  # doctest: +SKIP
0
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
from dramatiq.common import dq_name, q_name, xq_name
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from . import _sql
from . import schema as _schema
from ._checks import MAX_QUEUE_BYTES, check_bool, check_int, check_ms
from ._util import first_line, format_age, redact
from .database import Database
from .errors import ConfigurationError, SchemaNotReady
from .flow.rate_limit import KeyState, limited_keys
from .queue_depths import QueueDepths

__all__ = [
    "Health",
    "HealthMonitor",
    "QueueHealth",
    "SourceCounts",
    "Thresholds",
    "check_health",
    "collect_health",
]

logger = logging.getLogger("dramatiq_reliable.health")

# Queues named in the dead-letter table; kept out of the SQL because that table is another
# part's and may not exist yet (it is checked for first).
_DEAD_LETTERS_TABLE = "dead_letters"


# --------------------------------------------------------------------------------------------
# The reading
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceCounts:
    """One place's counts of one queue: the Postgres queue table's, or RabbitMQ's.

    ``depth``: waiting to run (in Postgres: ready and claimed rows; in RabbitMQ: ready
    messages); ``delayed``: waiting for their time (Postgres rows not yet due, RabbitMQ's
    ``.DQ``); ``xq``: failed messages the broker keeps (``.XQ``).
    """

    depth: int = 0
    delayed: int = 0
    xq: int = 0


@dataclasses.dataclass(frozen=True)
class QueueHealth:
    """The health numbers of one queue; ``None`` where the number could not be known.

    ``depth``, ``delayed`` and ``xq`` are the sums of ``in_postgres`` and ``in_rabbitmq``, each
    ``None`` where that place was not read (see the module docstring: a total is ``None`` while
    a place that may hold messages is unknown).
    """

    queue: str
    depth: int | None = None
    delayed: int | None = None
    xq: int | None = None
    xq_unstored: int | None = None
    consumers: int | None = None
    outbox_backlog: int | None = None
    outbox_failing: int | None = None
    outbox_oldest_age_s: float | None = None
    #: Outbox rows waiting for their due time: delays kept in Postgres, not a backlog.
    outbox_scheduled: int | None = None
    dead_letters: int | None = None
    dead_letters_newest_age_s: float | None = None
    retries_waiting: int | None = None
    #: PostgresBroker queues: the age of the oldest message ready to run.
    queue_oldest_age_s: float | None = None
    #: Long jobs (``LongJobs``) running under a lease, and those of them past their lease (their
    #: worker stopped; a relay requeues them); ``None`` on a schema without leases.
    long_jobs: int | None = None
    long_jobs_expired: int | None = None
    #: The queue's rows in the Postgres queue table (``PostgresBroker``); ``None`` when not read.
    in_postgres: SourceCounts | None = None
    #: The queue's messages in RabbitMQ; ``None`` when not read (a queue RabbitMQ does not have
    #: holds nothing: zeros).
    in_rabbitmq: SourceCounts | None = None


@dataclasses.dataclass(frozen=True)
class Health:
    """One reading of every queue's numbers, and what could not be reached.

    ``postgres_error`` / ``rabbitmq_error`` hold a one-line reason (never a password) when
    that service could not be read; the numbers it would have given are then ``None``.
    ``rabbitmq_skipped`` says why RabbitMQ was not read at all (no reader given, or not in use:
    see the module docstring); it is not an error.  ``queue_sources`` names the places that may
    hold the queues' messages, whose counts make up ``depth``, ``delayed`` and ``xq``:
    ``"postgres"`` when the queue table exists, ``"rabbitmq"`` when RabbitMQ was read or may be
    in use (the outbox was used); a total is ``None`` while such a place is not read.
    ``counted`` names the numbers that were read, so a total over no queue is ``0`` where the
    service answered and ``None`` where it was skipped or down.
    """

    queues: tuple[QueueHealth, ...]
    collected_at: float
    postgres_error: str | None = None
    rabbitmq_error: str | None = None
    dead_letters_table: bool | None = None
    counted: frozenset[str] = frozenset()
    rabbitmq_skipped: str | None = None
    queue_sources: frozenset[str] = frozenset()
    #: The rate-limited keys limited now (paused by a 429, slowed, or with jobs waiting).
    rate_limits: tuple[KeyState, ...] = ()
    #: Seconds since a relay last published a row (the newest ``published_at`` kept under
    #: ``on_published="mark"``): the relay's heartbeat while messages flow.  ``None`` when no
    #: published row is kept (``on_published="delete"``, nothing published within retention).
    relay_last_publish_age_s: float | None = None

    @property
    def ok(self) -> bool:
        """Every service read answered (the thresholds are :func:`check_health`'s business)."""
        return self.postgres_error is None and self.rabbitmq_error is None

    def queue(self, name: str) -> QueueHealth:
        """The numbers of ``name`` (``.DQ``/``.XQ`` suffixes are folded into their queue)."""
        canonical = q_name(name)
        for item in self.queues:
            if item.queue == canonical:
                return item
        return QueueHealth(queue=canonical)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able form: services, queues and totals."""
        return {
            "collected_at": datetime.datetime.fromtimestamp(self.collected_at, tz=datetime.timezone.utc).isoformat(),
            "postgres": {"ok": self.postgres_error is None, "error": self.postgres_error},
            "rabbitmq": {
                "ok": self.rabbitmq_error is None,
                "error": self.rabbitmq_error,
                "skipped": self.rabbitmq_skipped,
            },
            "queue_sources": sorted(self.queue_sources),
            "dead_letters_table": self.dead_letters_table,
            "queues": [dataclasses.asdict(item) for item in self.queues],
            "totals": self.totals(),
            "rate_limits": [item.as_dict() for item in self.rate_limits],
            "relay_last_publish_age_s": self.relay_last_publish_age_s,
        }

    def totals(self) -> dict[str, Any]:
        """Sums over the queues (the oldest and newest ages are the extremes).

        A count is ``0`` when its service answered, even with no queue to add up, and ``None``
        only when it is unknown; an age is ``None`` when there is no row to be old.
        """

        def total(field: str) -> int | None:
            values: list[int] = [getattr(item, field) for item in self.queues if getattr(item, field) is not None]
            if values:
                return sum(values)
            return 0 if field in self.counted else None

        def extreme(field: str, pick: Callable[[list[float]], float]) -> float | None:
            values = [getattr(item, field) for item in self.queues if getattr(item, field) is not None]
            return pick(values) if values else None

        return {
            "depth": total("depth"),
            "delayed": total("delayed"),
            "xq": total("xq"),
            "xq_unstored": total("xq_unstored"),
            "queue_oldest_age_s": extreme("queue_oldest_age_s", max),
            "outbox_backlog": total("outbox_backlog"),
            "outbox_failing": total("outbox_failing"),
            "outbox_oldest_age_s": extreme("outbox_oldest_age_s", max),
            "outbox_scheduled": total("outbox_scheduled"),
            "dead_letters": total("dead_letters"),
            "dead_letters_newest_age_s": extreme("dead_letters_newest_age_s", min),
            "retries_waiting": total("retries_waiting"),
            "long_jobs": total("long_jobs"),
            "long_jobs_expired": total("long_jobs_expired"),
        }


# --------------------------------------------------------------------------------------------
# Collecting
# --------------------------------------------------------------------------------------------


DatabaseSource = Database | psycopg.Connection[Any] | str


def collect_health(
    *,
    database: DatabaseSource | None = None,
    schema: str = _sql.DEFAULT_SCHEMA,
    rabbitmq: QueueDepths | None = None,
    rabbitmq_only_if_used: bool = False,
    queues: Iterable[str] = (),
    discover_queues: bool = True,
    retries_waiting: bool = False,
    statement_timeout_ms: int = 5000,
    connect_timeout_ms: int = 5000,
    xq_unstored: bool = False,
    xq_scan_limit: int = 10_000,
) -> Health:
    """Read every queue's health numbers; an unreachable service is reported, not raised.

    Parameters:
      database: a :class:`~dramatiq_reliable.database.Database`, an open connection (no
        transaction in progress) or a URL; ``None`` skips Postgres.
      schema: the schema of the tables.
      rabbitmq: a :class:`QueueDepths`; ``None`` skips RabbitMQ.
      rabbitmq_only_if_used: read ``rabbitmq`` only if the schema shows RabbitMQ in use
        (anything was ever written to the outbox); otherwise, and when Postgres cannot say,
        :attr:`Health.rabbitmq_skipped` says why it was not read.  For a RabbitMQ nobody
        configured: a ``PostgresBroker`` deployment has none, and that is not an outage.
      queues: queues to report on whatever the tables hold.
      discover_queues: also report every queue found in the outbox (a full scan of the
        outbox: the command's choice, not a scrape's) and in the dead-letter table.  Queues
        with unpublished rows or Postgres queue rows are always reported.
      retries_waiting: count the retries not yet due (scans the outbox's delayed rows).
      statement_timeout_ms: a bound on each query, so a probe never hangs on a locked table.
      connect_timeout_ms: used when ``database`` is a URL.
      xq_unstored: also count, per queue, the ``.XQ`` messages with no dead-letter row (needs
        both services and the dead-letter table); at most ``xq_scan_limit`` are read per queue.

    Raises :class:`~dramatiq_reliable.errors.SchemaNotReady` when the outbox tables are missing,
    and :class:`~dramatiq_reliable.errors.ConfigurationError` for a bad argument, such as a name
    in ``queues`` that cannot be a RabbitMQ queue (empty, or too long to take its ``.DQ``/``.XQ``
    suffix).
    """
    check_ms("statement_timeout_ms", statement_timeout_ms, minimum=1, fix="e.g. statement_timeout_ms=5000")
    check_ms("connect_timeout_ms", connect_timeout_ms, minimum=1, fix="e.g. connect_timeout_ms=5000")
    check_int("xq_scan_limit", xq_scan_limit, minimum=1, fix="e.g. xq_scan_limit=10000")
    for name, value in (
        ("rabbitmq_only_if_used", rabbitmq_only_if_used),
        ("discover_queues", discover_queues),
        ("retries_waiting", retries_waiting),
        ("xq_unstored", xq_unstored),
    ):
        check_bool(name, value)
    _sql.validate_schema(schema)
    queues = list(queues)
    for name in queues:
        if not isinstance(name, str) or not is_queue_name(q_name(name)):
            raise ConfigurationError(
                f"queue name {str(name)[:60]!r} cannot be a RabbitMQ queue: give a non-empty name of at most "
                f"{MAX_QUEUE_BYTES} bytes"
            )
    rows: dict[str, dict[str, Any]] = {}
    counted: set[str] = set()
    sources: set[str] = set()
    in_postgres: dict[str, SourceCounts] = {}
    in_rabbitmq: dict[str, SourceCounts] = {}

    def entry(queue: str) -> dict[str, Any]:
        return rows.setdefault(q_name(queue), {})

    for name in queues:
        entry(name)

    postgres_error: str | None = None
    facts = _PostgresFacts()
    if database is not None:
        # The queue table is a place messages wait unless Postgres says it is not there.
        sources.add("postgres")
        try:
            with _connection(database, connect_timeout_ms) as conn:
                facts = _read_postgres(
                    conn,
                    schema=schema,
                    entry=entry,
                    in_postgres=in_postgres,
                    discover_queues=discover_queues,
                    retries_waiting=retries_waiting,
                    # Whether RabbitMQ is in use decides both whether to read it and, when it is
                    # not read, whether its part of a total is unknown or nothing.
                    outbox_used=rabbitmq is None or rabbitmq_only_if_used,
                    statement_timeout_ms=statement_timeout_ms,
                )
        except SchemaNotReady:
            raise
        except (psycopg.Error, PoolTimeout) as error:
            postgres_error = _postgres_problem(error)
        else:
            if not facts.queue_table:
                sources.discard("postgres")
            # What Postgres answered for is a number, zero included; "-" is for the unknown.
            counted |= {"outbox_backlog", "outbox_failing", "outbox_scheduled"}
            if facts.dead_letters_table:
                counted.add("dead_letters")
            if retries_waiting:
                counted.add("retries_waiting")
            if facts.long_jobs_table:
                counted |= {"long_jobs", "long_jobs_expired"}
            for values in rows.values():
                for field in counted:
                    values.setdefault(field, 0)

    rabbitmq_error: str | None = None
    rabbitmq_skipped = _rabbitmq_skipped(rabbitmq, rabbitmq_only_if_used, database, postgres_error, facts, schema)
    read_rabbitmq = rabbitmq is not None and rabbitmq_skipped is None
    # RabbitMQ holds part of the numbers when it is read, and also when it is not but may be in
    # use: then its part is unknown, not zero.  Only a schema whose outbox was never used has none.
    if read_rabbitmq or (database is not None and (postgres_error is not None or facts.outbox_used is not False)):
        sources.add("rabbitmq")
    if rabbitmq is not None and read_rabbitmq:
        import pika.exceptions

        # A name found in a table that RabbitMQ could not hold (an empty or oversized queue
        # name in a bad row) is reported with unknown depths rather than spoiling the reading.
        names = [name for name in sorted(rows) if is_queue_name(name)]
        try:
            depths = rabbitmq.read(n for name in names for n in (name, dq_name(name), xq_name(name)))
        except (pika.exceptions.AMQPError, OSError) as error:
            rabbitmq_error = rabbitmq.describe(error)
        else:
            counted.add("consumers")
            for name in names:
                ready, delayed, dead = depths.get(name), depths.get(dq_name(name)), depths.get(xq_name(name))
                # A queue RabbitMQ does not have (yet) holds nothing.
                in_rabbitmq[name] = SourceCounts(
                    depth=ready[0] if ready else 0, delayed=delayed[0] if delayed else 0, xq=dead[0] if dead else 0
                )
                entry(name)["consumers"] = ready[1] if ready else 0

    if "postgres" in sources and postgres_error is None:
        # Queues with no row in the queue table hold nothing there.
        for name in rows:
            in_postgres.setdefault(name, SourceCounts())
    if sources and postgres_error is None and rabbitmq_error is None and ("rabbitmq" not in sources or read_rabbitmq):
        counted |= {"depth", "delayed", "xq"}
    for name, values in rows.items():
        parts = [
            part.get(name)
            for part, source in ((in_postgres, "postgres"), (in_rabbitmq, "rabbitmq"))
            if source in sources
        ]
        known = [part for part in parts if part is not None]
        values["in_postgres"] = in_postgres.get(name) if "postgres" in sources else None
        values["in_rabbitmq"] = in_rabbitmq.get(name)
        if known and len(known) == len(parts):
            values["depth"] = sum(part.depth for part in known)
            values["delayed"] = sum(part.delayed for part in known)
            values["xq"] = sum(part.xq for part in known)

    if (
        xq_unstored
        and rabbitmq is not None
        and "rabbitmq" in sources
        and rabbitmq_error is None
        and database is not None
        and facts.dead_letters_table
    ):
        try:
            _count_xq_unstored(database, schema, rabbitmq, rows, xq_scan_limit, connect_timeout_ms)
        except (psycopg.Error, PoolTimeout) as error:
            postgres_error = _postgres_problem(error)
        except Exception as error:
            rabbitmq_error = rabbitmq.describe(error)
        else:
            counted.add("xq_unstored")

    return Health(
        queues=tuple(QueueHealth(queue=name, **values) for name, values in sorted(rows.items())),
        collected_at=time.time(),
        postgres_error=postgres_error,
        rabbitmq_error=rabbitmq_error,
        dead_letters_table=facts.dead_letters_table,
        counted=frozenset(counted),
        rabbitmq_skipped=rabbitmq_skipped,
        queue_sources=frozenset(sources),
        rate_limits=facts.rate_limits,
        relay_last_publish_age_s=facts.relay_last_publish_age_s,
    )


def _rabbitmq_skipped(
    rabbitmq: QueueDepths | None,
    only_if_used: bool,
    database: DatabaseSource | None,
    postgres_error: str | None,
    facts: _PostgresFacts,
    schema_name: str,
) -> str | None:
    """Why RabbitMQ is not read in this reading, or ``None`` when it is."""
    if rabbitmq is None:
        return "not asked to"
    if not only_if_used or facts.outbox_used:
        return None
    if database is None or postgres_error is not None:
        return "Postgres could not say whether the outbox is in use; give a RabbitMQ URL to read RabbitMQ anyway"
    if facts.outbox_used is None:
        return (
            f"this role may not read the id sequence of the outbox of schema {schema_name!r} to see whether it is "
            "in use; give a RabbitMQ URL to read RabbitMQ anyway"
        )
    return f"the outbox of schema {schema_name!r} was never used: no RabbitMQ in this deployment"


def _count_xq_unstored(
    database: DatabaseSource,
    schema_name: str,
    rabbitmq: QueueDepths,
    rows: dict[str, dict[str, Any]],
    limit: int,
    connect_timeout_ms: int,
) -> None:
    from .dead_letters.xq import peek_xq

    for name, values in rows.items():
        in_rabbitmq: SourceCounts | None = values.get("in_rabbitmq")
        # Only RabbitMQ's .XQ can hold a death with no row; a Postgres .XQ row is kept by the broker.
        if in_rabbitmq is None or not in_rabbitmq.xq:
            values["xq_unstored"] = 0
            continue
        keys, unreadable = peek_xq(rabbitmq.parameters, name, limit=limit)
        with _connection(database, connect_timeout_ms) as conn:
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("dead_letters_stored", schema_name),
                    {"message_ids": [key[0] for key in keys], "after_ids": [key[1] for key in keys]},
                )
                .fetchone()
            )
        values["xq_unstored"] = len(keys) - int(row["stored"] if row else 0) + unreadable


def is_queue_name(name: str) -> bool:
    """Whether ``name`` can be a RabbitMQ queue with its ``.DQ`` and ``.XQ`` (non-empty, short enough)."""
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        return False
    return 0 < size <= MAX_QUEUE_BYTES


def _postgres_problem(error: BaseException) -> str:
    """One line saying why Postgres could not be read, with any password masked."""
    text = redact(first_line(error))
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(error, PoolTimeout) or sqlstate is None or sqlstate.startswith("08"):
        return f"cannot reach Postgres: {text}"
    return f"Postgres refused the health queries: {text} (SQLSTATE {sqlstate})"


@contextlib.contextmanager
def _connection(database: DatabaseSource, connect_timeout_ms: int) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(database, Database):
        with database.connection() as conn:
            yield conn
    elif isinstance(database, psycopg.Connection):
        yield database
    else:
        # No prepared statements: one reading runs the same query per queue, and behind PgBouncer
        # in transaction mode a prepared statement belongs to a server process, not to this connection.
        with psycopg.connect(
            database, connect_timeout=max(1, round(connect_timeout_ms / 1000)), prepare_threshold=None
        ) as conn:
            yield conn


@dataclasses.dataclass(frozen=True)
class _PostgresFacts:
    """What a Postgres reading learnt about the schema, besides the numbers."""

    dead_letters_table: bool | None = None
    queue_table: bool = False
    #: Whether anything was ever written to the outbox; ``None`` when not asked or not readable.
    outbox_used: bool | None = None
    long_jobs_table: bool = False
    rate_limits: tuple[KeyState, ...] = ()
    relay_last_publish_age_s: float | None = None


def _read_postgres(
    conn: psycopg.Connection[Any],
    *,
    schema: str,
    entry: Callable[[str], dict[str, Any]],
    in_postgres: dict[str, SourceCounts],
    discover_queues: bool,
    retries_waiting: bool,
    outbox_used: bool,
    statement_timeout_ms: int,
) -> _PostgresFacts:
    """Fill in the outbox, queue-table and dead-letter numbers; say which tables exist."""
    with conn.transaction():
        # SET LOCAL: the bound ends with this transaction, leaving a pooled connection as it was.
        _sql.set_local_timeouts(conn, statement_timeout_ms=int(statement_timeout_ms))
        _ensure_outbox(conn, schema)
        # By name, whatever row factory the app gave its connection.
        rows = conn.cursor(row_factory=dict_row)
        if discover_queues:
            for row in rows.execute(_sql.query("status_outbox_queues", schema)).fetchall():
                entry(row["queue_name"]).setdefault("outbox_backlog", 0)
        for row in rows.execute(_sql.query("status_outbox_backlog", schema)).fetchall():
            values = entry(row["queue_name"])
            values["outbox_backlog"] = (values.get("outbox_backlog") or 0) + int(row["backlog"])
            values["outbox_failing"] = (values.get("outbox_failing") or 0) + int(row["failing"])
            values["outbox_scheduled"] = (values.get("outbox_scheduled") or 0) + int(row["scheduled"])
            if row["oldest_age_s"] is not None:  # None: every row of the queue is scheduled
                age = round(float(row["oldest_age_s"]), 3)
                values["outbox_oldest_age_s"] = max(values.get("outbox_oldest_age_s") or 0.0, age)
        if retries_waiting:
            counts = _retries_waiting(conn, schema)
            for queue_name, count in counts.items():
                entry(queue_name)["retries_waiting"] = count
        queue_table = _read_postgres_queues(conn, schema, entry, in_postgres)
        used = None
        if outbox_used:
            table = sql.Identifier(schema, "outbox").as_string(conn)
            found = rows.execute(_sql.query("table_used", schema), {"table": table}).fetchone()
            used = None if found is None or found["used"] is None else bool(found["used"])
        exists = _schema.table_exists(conn, schema, _DEAD_LETTERS_TABLE)
        if exists:
            for row in rows.execute(_sql.query("status_dead_letters", schema)).fetchall():
                if not discover_queues and not row["dead"]:
                    continue
                values = entry(row["queue_name"])
                values["dead_letters"] = (values.get("dead_letters") or 0) + int(row["dead"])
                if row["newest_age_s"] is not None:
                    age = round(float(row["newest_age_s"]), 3)
                    previous = values.get("dead_letters_newest_age_s")
                    values["dead_letters_newest_age_s"] = age if previous is None else min(previous, age)
        long_jobs = _schema.table_exists(conn, schema, "job_leases")
        if long_jobs:
            for row in rows.execute(_sql.query("status_long_jobs", schema)).fetchall():
                values = entry(row["queue_name"])
                values["long_jobs"] = int(row["running"])
                values["long_jobs_expired"] = int(row["expired"])
        limited = _schema.table_exists(conn, schema, "rate_limit_buckets")
        rate_limits = tuple(limited_keys(conn, schema)) if limited else ()
        # Since migration 16 published rows may live in the partitioned history instead.
        history = _schema.table_exists(conn, schema, "outbox_published")
        published = rows.execute(
            _sql.query("status_relay_published_history" if history else "status_relay_published", schema)
        ).fetchone()
        published_age = None if published is None or published["age_s"] is None else round(published["age_s"], 3)
    return _PostgresFacts(
        dead_letters_table=exists,
        queue_table=queue_table,
        outbox_used=used,
        long_jobs_table=long_jobs,
        rate_limits=rate_limits,
        relay_last_publish_age_s=published_age,
    )


def _read_postgres_queues(
    conn: psycopg.Connection[Any],
    schema_name: str,
    entry: Callable[[str], dict[str, Any]],
    in_postgres: dict[str, SourceCounts],
) -> bool:
    """PostgresBroker's queues, when the queue table exists (said by the result): their counts
    and the age of the oldest ready row."""
    from .postgres import queue as postgres_queue

    if not _schema.table_exists(conn, schema_name, "queue"):
        return False
    for counts in postgres_queue.counts(conn, schema_name):
        values = entry(counts.queue_name)
        in_postgres[q_name(counts.queue_name)] = SourceCounts(
            depth=counts.ready + counts.held, delayed=counts.delayed, xq=counts.dead
        )
        if counts.oldest_ready_s is not None:
            values["queue_oldest_age_s"] = round(counts.oldest_ready_s, 3)
    return True


def _ensure_outbox(conn: psycopg.Connection[Any], schema_name: str) -> None:
    """Raise ``SchemaNotReady`` unless the outbox tables exist (never aborts the transaction)."""
    _schema.ensure_ready(conn, schema=schema_name, required=_schema.OUTBOX_VERSION, feature="outbox")


def _retries_waiting(conn: psycopg.Connection[Any], schema_name: str) -> dict[str, int]:
    from dramatiq.errors import DecodeError
    from dramatiq.message import Message

    counts: dict[str, int] = {}
    # A server-side cursor streams the rows: the delayed backlog may be large.
    with conn.cursor(name="dramatiq_reliable_status_retries", row_factory=dict_row) as cursor:
        cursor.itersize = 1000
        cursor.execute(_sql.query("status_retries_waiting", schema_name))
        for row in cursor:
            try:
                retries = Message.decode(bytes(row["body"])).options.get("retries")
            except (DecodeError, TypeError, ValueError, AttributeError):
                continue  # not ours to judge: a body the encoder cannot read is not counted
            if isinstance(retries, int) and retries >= 1:
                queue = q_name(row["queue_name"])
                counts[queue] = counts.get(queue, 0) + 1
    return counts


def _describe(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


# --------------------------------------------------------------------------------------------
# Cached readings, for gauges
# --------------------------------------------------------------------------------------------


class HealthMonitor:
    """A :func:`collect_health` reading cached for ``ttl_ms``, for observable gauges.

    Every gauge callback of a scrape asks for the reading; the first refreshes it and the
    others get the cached one, so a scrape costs one backlog query and a few passive declares
    however many gauges read it, and a down database is asked once per ``ttl_ms``, not once per
    gauge.  Thread-safe.

    Parameters:
      database, schema: where the tables are; ``None`` skips Postgres.
      rabbitmq: a :class:`QueueDepths`; ``None`` skips RabbitMQ.
      queues: called at each refresh for the queues to report (e.g. a broker's declared queues).
      ttl_ms: how long a reading is reused.
      statement_timeout_ms: a bound on each query, so a scrape never waits on a locked table.
      retries_waiting: also count the retries not yet due (scans the outbox's delayed rows).
    """

    def __init__(
        self,
        *,
        database: DatabaseSource | None,
        schema: str = _sql.DEFAULT_SCHEMA,
        rabbitmq: QueueDepths | None = None,
        queues: Callable[[], Iterable[str]] = tuple,
        ttl_ms: int = 10_000,
        statement_timeout_ms: int = 2000,
        retries_waiting: bool = False,
    ) -> None:
        check_ms("ttl_ms", ttl_ms, minimum=0, fix="e.g. ttl_ms=10000")
        self.retries_waiting = check_bool("retries_waiting", retries_waiting)
        check_ms("statement_timeout_ms", statement_timeout_ms, minimum=1, fix="e.g. statement_timeout_ms=2000")
        self.database = database
        self.schema = _sql.validate_schema(schema)
        self.rabbitmq = rabbitmq
        self.queues = queues
        self.ttl_s = ttl_ms / 1000
        self.statement_timeout_ms = statement_timeout_ms
        self._lock = threading.Lock()
        self._reading: Health | None = None
        self._read_at = float("-inf")

    def get(self) -> Health | None:
        """The cached reading, refreshed when older than ``ttl_ms``; ``None`` if it cannot be read."""
        with self._lock:
            if time.monotonic() - self._read_at < self.ttl_s:
                return self._reading
            # Failed readings are cached too: a down service is asked once per ttl.
            self._read_at = time.monotonic()
            try:
                reading = collect_health(
                    database=self.database,
                    schema=self.schema,
                    rabbitmq=self.rabbitmq,
                    queues=list(self.queues()),
                    discover_queues=False,
                    retries_waiting=self.retries_waiting,
                    statement_timeout_ms=self.statement_timeout_ms,
                )
            except Exception as error:
                logger.warning("could not read the health numbers for the gauges: %s", redact(_describe(error)))
                self._reading = None
                return None
            for problem in (reading.postgres_error, reading.rabbitmq_error):
                if problem:
                    logger.warning("health gauges: %s", problem)
            self._reading = reading
            return reading

    def close(self) -> None:
        """Close the RabbitMQ connection (the next reading reopens it)."""
        if self.rabbitmq is not None:
            self.rabbitmq.close()


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Limits for :func:`check_health`, each per queue; ``None`` is no limit.

    ``max_queue_depth`` applies to a queue's messages wherever they wait (Postgres and
    RabbitMQ together); ``max_queue_age_ms`` to Postgres queues only, the one place a
    message's age can be read.
    """

    max_outbox_age_ms: int | None = None
    max_outbox_backlog: int | None = None
    max_dead_letters: int | None = None
    max_queue_depth: int | None = None
    max_xq: int | None = None
    max_xq_unstored: int | None = None
    max_queue_age_ms: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_ms"):
                check_ms(field.name, value, allow_none=True)
            else:
                check_int(field.name, value, minimum=0, allow_none=True)

    def any(self) -> bool:
        return any(value is not None for value in dataclasses.astuple(self))


def _at_least(total: int | None, *parts: SourceCounts | None, field: str) -> int | None:
    """``total``, or when it is unknown the sum of the parts that are known (a lower bound, so a
    part over a limit is reported even while the other place cannot be read)."""
    if total is not None:
        return total
    known = [getattr(part, field) for part in parts if part is not None]
    return sum(known) if known else None


def check_health(health: Health, thresholds: Thresholds) -> list[str]:
    """One line per threshold crossed (empty when all hold), naming the queue and the numbers."""
    problems: list[str] = []
    for item in health.queues:
        age = item.outbox_oldest_age_s
        if thresholds.max_outbox_age_ms is not None and age is not None and age * 1000 > thresholds.max_outbox_age_ms:
            problems.append(
                f"queue {item.queue!r}: oldest unpublished outbox row is {format_age(age)} old, over "
                f"--max-outbox-age {format_age(thresholds.max_outbox_age_ms / 1000)} (is a relay running?)"
            )
        waited = item.queue_oldest_age_s
        if (
            thresholds.max_queue_age_ms is not None
            and waited is not None
            and waited * 1000 > thresholds.max_queue_age_ms
        ):
            problems.append(
                f"queue {item.queue!r}: oldest ready message has waited {format_age(waited)}, over "
                f"--max-queue-age {format_age(thresholds.max_queue_age_ms / 1000)} (are its workers running?)"
            )
        depth = _at_least(item.depth, item.in_postgres, item.in_rabbitmq, field="depth")
        xq = _at_least(item.xq, item.in_postgres, item.in_rabbitmq, field="xq")
        for value, limit, one, many, option in (
            (
                item.outbox_backlog,
                thresholds.max_outbox_backlog,
                "unpublished outbox row",
                "unpublished outbox rows",
                "--max-outbox-backlog",
            ),
            (item.dead_letters, thresholds.max_dead_letters, "dead letter", "dead letters", "--max-dead-letters"),
            (depth, thresholds.max_queue_depth, "message waiting", "messages waiting", "--max-queue-depth"),
            (xq, thresholds.max_xq, "message in its .XQ", "messages in its .XQ", "--max-xq"),
            (
                item.xq_unstored,
                thresholds.max_xq_unstored,
                "message in its .XQ with no dead-letter row",
                "messages in its .XQ with no dead-letter row",
                "--max-xq-unstored (run 'dramatiq-reliable dead-letters import-xq')",
            ),
        ):
            if limit is not None and value is not None and value > limit:
                lower, where = _where(item, option)
                problems.append(
                    f"queue {item.queue!r}: {lower}{value} {one if value == 1 else many}{where}, over {option} {limit}"
                )
    if thresholds.max_dead_letters is not None and health.dead_letters_table is False:
        problems.append(
            "the dead-letter table does not exist, so --max-dead-letters cannot be checked; "
            "run 'dramatiq-reliable migrate'"
        )
    return problems


def _where(item: QueueHealth, option: str) -> tuple[str, str]:
    """Where a depth or .XQ count over its limit is: ``("", " (2 in Postgres, 3 in RabbitMQ)")``
    when both places hold some, ``("at least ", " (in Postgres; RabbitMQ could not be read)")``
    for a lower bound, ``("", "")`` otherwise."""
    field = {"--max-queue-depth": "depth", "--max-xq": "xq"}.get(option)
    if field is None:
        return "", ""
    parts = {"Postgres": item.in_postgres, "RabbitMQ": item.in_rabbitmq}
    if getattr(item, field) is None:
        known = " and ".join(place for place, part in parts.items() if part is not None)
        unknown = " and ".join(place for place, part in parts.items() if part is None)
        return "at least ", f" (in {known}; {unknown} could not be read)"
    counts = {place: getattr(part, field) for place, part in parts.items() if part is not None}
    if len(counts) < 2 or not all(counts.values()):
        return "", ""
    return "", " (" + ", ".join(f"{count} in {place}" for place, count in counts.items()) + ")"
