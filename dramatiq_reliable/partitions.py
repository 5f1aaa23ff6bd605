"""Partitioned tables: published outbox rows kept in time partitions and dropped whole, never deleted row by row.

Why a history table and not a partitioned outbox.  The relay's claim and an idle relay's probe
walk the partial indexes of the unpublished rows; they must stay as small as the backlog, and
every producer's ``INSERT`` must keep hitting one plain table.  Partitioning the outbox itself
would force ``published_at`` (NULL while a row waits) into its primary key and turn each mark
into a cross-partition row move.  So the outbox stays as it is, and once a schema is enabled the
rows a relay confirms move to ``outbox_published``, a table partitioned by range on
``published_at``, in the statement and transaction that would have marked them: a row is in
exactly one of the two tables at any instant, and the hot table holds only what waits.  A relay
that ran :func:`maintain_for_relay` moves them itself (``DELETE ... INSERT``, about the work of
the ``UPDATE`` it replaces); a statement trigger (migration 16) moves what any other statement
marks (an older relay in a rolling deploy, ``drain_outbox``), paying for the ``UPDATE`` as well.

Retention detaches (``CONCURRENTLY``) and drops whole partitions whose upper bound is past
retention, so every row in a dropped partition had expired; partitions are made ``ahead``
intervals in advance as plain tables and attached (a SHARE UPDATE EXCLUSIVE lock, which never
blocks a relay's insert).  If maintenance falls behind the clock, rows stay in the outbox,
marked, exactly as without partitions, and the next maintenance moves them: the trigger swallows
"no partition for this row", and the relay's own move checks ``covered_until`` (the end of the
newest partition, kept by maintenance) first.  A relay never fails a publish over retention.

Why only the outbox.  ``PostgresBroker`` deletes a row when it is acked, so its table holds no
finished rows to partition (only dead ``.XQ`` rows, few and purged by :mod:`.postgres.retention`).
Processed-job keys must stay unique for their whole retention: a partitioned unique index must
include the partition key, so a key in a partition by ``expires_at`` would no longer conflict
with the same key in another partition, and the claim's ``ON CONFLICT`` would let a duplicate
run.  Dead letters change state (dead, replayed, discarded) and are unique per dead message.
Both keep their batched deletes; partitioning them needs a guard for uniqueness first.

Opt-in: :func:`enable` (``dramatiq-reliable partitions enable``) makes the partitions for the
retention window, installs the trigger and then moves the published rows in short batches
while relays run: no downtime, and relays of any version keep working (they only mark).
:func:`maintain` runs from every relay's housekeeping (each ``purge_interval_ms``), and from
``dramatiq-reliable partitions maintain`` for a cron job.

>>> enable(database, schema="app", interval_ms=86_400_000, retention_ms=7 * 86_400_000)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import _sql
from . import schema as schema_module
from ._checks import MAX_MS, check_int, check_ms
from ._util import first_line
from .database import Database, DatabaseLike
from .errors import ConfigurationError

__all__ = ["PartitionInfo", "PartitionStatus", "disable", "enable", "maintain", "partition_status"]

logger = logging.getLogger("dramatiq_reliable.partitions")

#: The one table partitioned today (see the module docstring for why the others are not).
OUTBOX_HISTORY = "outbox_published"
#: A partition a day: one DROP a day, and a day's rows is a size autovacuum never has to visit.
DEFAULT_INTERVAL_MS = 86_400_000
#: Three intervals made ahead: maintenance may miss two runs before rows stay in the outbox.
DEFAULT_AHEAD = 3
#: The relay's own default retention of published rows.
DEFAULT_RETENTION_MS = 86_400_000
#: Narrower partitions than a minute would be thousands of tables a day.
_MIN_INTERVAL_MS = 60_000
#: At most this many partitions ahead or kept: every partition is a table the planner opens.
_MAX_PARTITIONS = 1000
#: How long one maintenance run may hold the lease before another maintainer takes over.
_LEASE_S = 300.0
#: The migration that made the tables.
_VERSION = 16
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class PartitionInfo:
    """One partition: its table name and the ``[lower, upper)`` range of ``published_at`` it holds."""

    name: str
    lower: dt.datetime
    upper: dt.datetime


@dataclasses.dataclass(frozen=True)
class PartitionStatus:
    """What :func:`maintain` did (or :func:`partition_status` sees): enabled, made, dropped, moved."""

    enabled: bool
    interval_ms: int = 0
    ahead: int = 0
    retention_ms: int = 0
    partitions: tuple[PartitionInfo, ...] = ()
    created: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    moved: int = 0
    #: Published rows still in the outbox (written while no partition held them, or not moved yet).
    left_in_outbox: int = 0
    #: Set when another maintainer held the lease and this run did nothing.
    skipped: bool = False

    @property
    def covered_until(self) -> dt.datetime | None:
        """The end of the newest partition: publishes after it stay in the outbox."""
        return self.partitions[-1].upper if self.partitions else None


def _check(interval_ms: Any, ahead: Any, retention_ms: Any) -> None:
    check_ms(
        "interval_ms",
        interval_ms,
        minimum=_MIN_INTERVAL_MS,
        maximum=MAX_MS,
        fix="a partition spans a positive interval of at least a minute, e.g. one day, interval_ms=86400000",
    )
    check_int("ahead", ahead, minimum=1, maximum=_MAX_PARTITIONS, fix="e.g. ahead=3 partitions made in advance")
    check_ms("retention_ms", retention_ms, fix="e.g. 7 days, retention_ms=604800000")
    if retention_ms // interval_ms > _MAX_PARTITIONS:
        raise ConfigurationError(
            f"retention_ms={retention_ms!r} keeps more than {_MAX_PARTITIONS} partitions of "
            f"interval_ms={interval_ms!r}; choose a wider interval_ms"
        )


def enable(
    database: DatabaseLike,
    *,
    schema: str = _sql.DEFAULT_SCHEMA,
    interval_ms: int = DEFAULT_INTERVAL_MS,
    ahead: int = DEFAULT_AHEAD,
    retention_ms: int = DEFAULT_RETENTION_MS,
    batch_size: int = 5000,
) -> PartitionStatus:
    """Partition the published outbox rows of ``schema``; safe while producers and relays run.

    In order: record the settings, make the partitions from ``now - retention_ms`` to ``ahead``
    intervals past now, install the trigger (from its commit on, marked rows move), then move
    the published rows already kept, ``batch_size`` per transaction.  Published rows older than
    the retention window stay for the relay's row purge, which deletes them as before.  Running
    it again is harmless; it changes ``ahead`` and ``retention_ms`` but refuses another
    ``interval_ms`` (the partitions made have their width).
    """
    _check(interval_ms, ahead, retention_ms)
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    _sql.validate_schema(schema)
    with _opened(database) as db:
        return _enable(db, schema, interval_ms, ahead, retention_ms, batch_size)


def _enable(
    database: Database, schema: str, interval_ms: int, ahead: int, retention_ms: int, batch_size: int
) -> PartitionStatus:
    with database.connection() as conn, conn.transaction():
        _ready(conn, schema)
        row = (
            conn.cursor(row_factory=dict_row)
            .execute(
                _sql.query("partitions_configure", schema),
                {
                    "table_name": OUTBOX_HISTORY,
                    "interval_ms": interval_ms,
                    "ahead": ahead,
                    "retention_ms": retention_ms,
                },
            )
            .fetchone()
        )
        if row is None or int(row["interval_ms"]) != interval_ms:
            kept = None if row is None else int(row["interval_ms"])
            raise ConfigurationError(
                f"the partitions of {schema!r}.{OUTBOX_HISTORY!r} span interval_ms={kept!r}, not {interval_ms!r}; "
                "enable again with the same interval_ms (or disable, let the partitions expire, and enable anew)"
            )
    status = maintain(database, schema=schema, batch_size=batch_size, _install=True)
    logger.info("partitions enabled on %r.%r: %d partitions", schema, OUTBOX_HISTORY, len(status.partitions))
    return status


def disable(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA) -> None:
    """Stop moving published rows: they stay in the outbox again, purged row by row.

    The partitions and their rows are left as they are (readers still see them); drop them by
    hand once they expired.
    """
    _sql.validate_schema(schema)
    with _opened(database) as db, db.connection() as conn, conn.transaction():
        _ready(conn, schema)
        conn.execute(_sql.query("partitions_untrigger", schema))
        conn.execute(
            sql.SQL("DELETE FROM {}.partitioned_tables WHERE table_name = %(t)s").format(sql.Identifier(schema)),
            {"t": OUTBOX_HISTORY},
        )


def maintain(
    database: DatabaseLike,
    *,
    schema: str = _sql.DEFAULT_SCHEMA,
    batch_size: int = 5000,
    _install: bool = False,
) -> PartitionStatus:
    """Make the partitions due ahead, drop those past retention, move rows left in the outbox.

    Does nothing (``enabled=False``) on a schema that was never enabled, so every relay can call
    it.  One maintainer at a time: a run that finds another's lease returns ``skipped=True``.
    Each statement commits on its own (a detach ``CONCURRENTLY`` cannot run in a transaction).
    """
    _sql.validate_schema(schema)
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    with _opened(database) as db, db.autocommit() as conn:
        version = schema_module.current_version(conn, schema=schema)
        if version is None or version < _VERSION:
            # A relay of this version on a schema not migrated yet: nothing can be enabled there.
            return PartitionStatus(enabled=False)
        cursor = conn.cursor(row_factory=dict_row)
        lease = cursor.execute(
            _sql.query("partitions_lease", schema), {"table_name": OUTBOX_HISTORY, "lease_s": _LEASE_S}
        ).fetchone()
        if lease is None:
            settings = _settings(conn, schema)
            if settings is None:
                return PartitionStatus(enabled=False)
            return dataclasses.replace(partition_status(db, schema=schema), skipped=True)
        covered_until = None
        try:
            status = _maintain(conn, schema, lease, batch_size, install=_install)
            covered_until = status.covered_until
            return status
        finally:
            conn.execute(
                _sql.query("partitions_release", schema), {"table_name": OUTBOX_HISTORY, "covered_until": covered_until}
            )


def maintain_for_relay(database: DatabaseLike, *, schema: str) -> str:
    """:func:`maintain`, then the statement a relay marks confirmed rows with until it runs again.

    ``outbox_move_published`` moves them to the history itself once partitions are enabled (the
    trigger's way pays for an UPDATE as well); ``outbox_mark_published`` otherwise.
    """
    try:
        enabled = maintain(database, schema=schema).enabled
    except psycopg.Error as error:
        if isinstance(error, psycopg.InterfaceError) or (
            isinstance(error, psycopg.OperationalError) and not error.sqlstate
        ):
            raise  # Postgres unreachable: the relay's own outage handling waits it out
        # Anything else (a role that may not create tables, a lock timeout) must not stop the
        # relay publishing: it marks in place, the safe way, and says why at every purge.
        logger.error(
            "partition maintenance of schema %r failed: %s; published rows are marked in place until it succeeds "
            "(run 'dramatiq-reliable partitions maintain' to see the whole error)",
            schema,
            first_line(error),
        )
        return "outbox_mark_published"
    return "outbox_move_published" if enabled else "outbox_mark_published"


def partition_status(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA) -> PartitionStatus:
    """The settings and partitions of ``schema``'s partitioned outbox history, read only."""
    _sql.validate_schema(schema)
    with _opened(database) as db, db.connection() as conn, conn.transaction():
        settings = _settings(conn, schema)
        if settings is None:
            return PartitionStatus(enabled=False)
        return PartitionStatus(
            enabled=True,
            interval_ms=int(settings["interval_ms"]),
            ahead=int(settings["ahead"]),
            retention_ms=int(settings["retention_ms"]),
            partitions=tuple(info for info, pending in _partitions(conn, schema) if not pending),
            left_in_outbox=_left_in_outbox(conn, schema),
        )


@contextlib.contextmanager
def _opened(database: DatabaseLike) -> Iterator[Database]:
    """``database`` as a :class:`Database`; a pool this call made from a URL is closed after it."""
    made = Database.of(database)
    try:
        yield made
    finally:
        if made is not database and made.owned:
            made.close()


def _ready(conn: psycopg.Connection[Any], schema: str) -> None:
    schema_module.ensure_ready(conn, schema=schema, required=_VERSION, feature="partitioned tables")


def _settings(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any] | None:
    _ready(conn, schema)
    return (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("partitions_settings", schema), {"table_name": OUTBOX_HISTORY})
        .fetchone()
    )


def _partitions(conn: psycopg.Connection[Any], schema: str) -> list[tuple[PartitionInfo, bool]]:
    parent = sql.Identifier(schema, OUTBOX_HISTORY).as_string(conn)
    rows = conn.cursor(row_factory=dict_row).execute(_sql.query("partitions_list", schema), {"parent": parent})
    return [(PartitionInfo(r["name"], r["lower"], r["upper"]), bool(r["detach_pending"])) for r in rows]


def _left_in_outbox(conn: psycopg.Connection[Any], schema: str) -> int:
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(
            sql.SQL("SELECT count(*) AS n FROM {}.outbox WHERE published_at IS NOT NULL").format(sql.Identifier(schema))
        )
        .fetchone()
    )
    return int(row["n"]) if row else 0


def _ddl(file: str, schema: str, **values: Any) -> sql.Composed:
    """A DDL file with identifiers quoted and partition bounds as literals (DDL takes no parameters)."""
    identifiers = {k: sql.Identifier(v) for k, v in values.items() if isinstance(v, str)}
    literals = {k: sql.Literal(v) for k, v in values.items() if not isinstance(v, str)}
    return sql.SQL(_sql.read(file)).format(schema=sql.Identifier(schema), **identifiers, **literals)


def _floor(instant: dt.datetime, interval_ms: int) -> dt.datetime:
    """The start of the partition holding ``instant``: partitions are aligned on the Unix epoch, in UTC."""
    elapsed_ms = (instant - _EPOCH) // dt.timedelta(milliseconds=1)
    return _EPOCH + dt.timedelta(milliseconds=elapsed_ms - elapsed_ms % interval_ms)


def _name(lower: dt.datetime) -> str:
    return f"{OUTBOX_HISTORY}_{lower.astimezone(dt.timezone.utc):%Y%m%d_%H%M%S}"


def _maintain(
    conn: psycopg.Connection[Any], schema: str, lease: dict[str, Any], batch_size: int, *, install: bool
) -> PartitionStatus:
    interval_ms, ahead, retention_ms = int(lease["interval_ms"]), int(lease["ahead"]), int(lease["retention_ms"])
    now: dt.datetime = lease["now"]
    interval = dt.timedelta(milliseconds=interval_ms)
    horizon = now - dt.timedelta(milliseconds=retention_ms)
    existing = _partitions(conn, schema)
    dropped: list[str] = []
    for info, pending in existing:
        if info.upper > horizon:
            continue
        # Every row in it was published before upper <= now - retention: all expired.
        if not pending:
            conn.execute(_ddl("partitions_detach", schema, parent=OUTBOX_HISTORY, name=info.name))
        else:
            conn.execute(_ddl("partitions_finalize", schema, parent=OUTBOX_HISTORY, name=info.name))
        conn.execute(_ddl("partitions_drop", schema, name=info.name))
        dropped.append(info.name)
    kept = [info for info, pending in existing if info.upper > horizon]
    created: list[str] = []
    lower = _floor(horizon, interval_ms)
    end = _floor(now, interval_ms) + interval * (ahead + 1)
    while lower < end:
        upper = lower + interval
        if upper > horizon and not any(p.lower < upper and lower < p.upper for p in kept):
            name = _name(lower)
            with conn.transaction():
                conn.execute(
                    _ddl("partitions_create", schema, parent=OUTBOX_HISTORY, name=name, lower=lower, upper=upper)
                )
            created.append(name)
            kept.append(PartitionInfo(name, lower, upper))
        lower = upper
    kept.sort(key=lambda p: p.lower)
    if install:
        conn.execute(_sql.query("partitions_trigger", schema))
    moved = 0
    if kept:
        while True:
            count = conn.execute(
                _sql.query("partitions_move", schema),
                {"since": kept[0].lower, "until": kept[-1].upper, "batch_size": batch_size},
            ).rowcount
            moved += count
            if count < batch_size:
                break
    if created or dropped or moved:
        logger.info(
            "partitions of %r.%r: %d made, %d dropped, %d rows moved from the outbox",
            schema,
            OUTBOX_HISTORY,
            len(created),
            len(dropped),
            moved,
        )
    return PartitionStatus(
        enabled=True,
        interval_ms=interval_ms,
        ahead=ahead,
        retention_ms=retention_ms,
        partitions=tuple(kept),
        created=tuple(created),
        dropped=tuple(dropped),
        moved=moved,
        left_in_outbox=_left_in_outbox(conn, schema),
    )
