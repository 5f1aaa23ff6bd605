"""Versioned migrations of the one Postgres schema that holds every table of this package.

Migrations are the files ``sql/migrations/NNNN_name.sql``, applied in order inside one
transaction that holds an advisory lock, so any number of processes may call :func:`migrate`
at once: the first applies, the others wait and find nothing left to do.  Teams that run
migrations through Alembic or Django print the same SQL with :func:`migration_sql`
(``dramatiq-reliable migrate --sql``) and record it in their own tool.

Every component checks, once per process, that the schema is at least at the version it needs
and raises :class:`~dramatiq_reliable.errors.SchemaNotReady` naming the command to run otherwise.
That check uses ``to_regclass`` and so never aborts the caller's transaction.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import _sql
from .errors import SchemaNotReady

__all__ = [
    "BATCH_CANCEL_VERSION",
    "BATCH_VERSION",
    "CANCEL_VERSION",
    "DEAD_LETTERS_VERSION",
    "DEDUPE_VERSION",
    "IDEMPOTENCY_VERSION",
    "JOBS_VERSION",
    "LATEST_VERSION",
    "LONG_JOBS_VERSION",
    "ORDER_CONCURRENCY_VERSION",
    "OUTBOX_VERSION",
    "QUEUE_VERSION",
    "RATE_LIMITS_VERSION",
    "SCHEDULER_VERSION",
    "SINGLETON_VERSION",
    "WORKFLOW_VERSION",
    "Migration",
    "current_version",
    "ensure_ready",
    "migrate",
    "migration_sql",
    "migrations",
]

# The schema version each part needs: the migration that created (or last changed) its tables.
# Declared here, once, next to the migrations they refer to.
# The outbox: created by 1.  Migration 6 only drops the NOTIFY trigger that taxed producers'
# commits; the code works with or without it (the trigger notifies the relays' own channel), so
# a deploy whose code lands before its migration keeps running instead of refusing every send.
OUTBOX_VERSION = 1
IDEMPOTENCY_VERSION = 2
DEAD_LETTERS_VERSION = 3
QUEUE_VERSION = 4
# Schedules, their ticks, singleton leases and checkpoints.
SCHEDULER_VERSION = 5
# Leases of long jobs (OutboxBroker's LongJobs): created by 9.
LONG_JOBS_VERSION = 9
# The failure record (job_attempts) and the message-id indexes `jobs show` reads: created by 10.
JOBS_VERSION = 10
# Dedupe at enqueue (the send_dedupe table): created by 11.
DEDUPE_VERSION = 11
# Cancellations (jobs cancel, the Cancellation middleware): created by 12.
CANCEL_VERSION = 12
# Rate limits per key (the rate_limit_buckets table of RateLimits): created by 13.
RATE_LIMITS_VERSION = 13
# Order per key and concurrency per key (flow/order.py, flow/concurrency.py): created by 14; the
# functions this code calls (a head's lease on its job row, woken jobs keep their priority) by 20.
ORDER_CONCURRENCY_VERSION = 20
# Batches and their completion callback (workflows/batch.py): created by 15.
BATCH_VERSION = 15
# Workflows: chains of steps and groups (workflows/workflow.py): created by 17.
WORKFLOW_VERSION = 17
# Cancelling a batch, and its children found by message id (workflows/status.py): created by 21.
BATCH_CANCEL_VERSION = 21
# Singleton acquires without a WAL flush of their own, guarded by an unlogged crash marker: created by 19.
SINGLETON_VERSION = 19

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclasses.dataclass(frozen=True)
class Migration:
    """One migration file: its version (the ``NNNN`` prefix), name and SQL text."""

    version: int
    name: str
    text: str


@functools.lru_cache(maxsize=1)
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with the package, in version order."""
    found = []
    folder = resources.files(__package__).joinpath("sql").joinpath("migrations")
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration versions must run 1..N without gaps, found {versions!r}")
    return tuple(found)


LATEST_VERSION = migrations()[-1].version


def migration_sql(*, schema: str = _sql.DEFAULT_SCHEMA, since: int = 0) -> str:
    """The SQL that brings ``schema`` from version ``since`` to the latest, as one script.

    It records each version in ``<schema>.migrations`` as :func:`migrate` does, so a schema
    migrated by hand and one migrated by the command are indistinguishable.  Each migration is
    a ``DO`` block guarded by that table (and :func:`migrate`'s advisory lock): the script is
    safe to run twice, on a schema already migrated it changes nothing, and a migration tool
    that records it once may replay it.
    """
    _sql.validate_schema(schema)
    parts = [_header(schema).as_string(None)]
    for migration in migrations():
        if migration.version <= since:
            continue
        parts.append(f"-- {migration.version:04d}_{migration.name}")
        parts.append(_guarded(schema, migration).as_string(None).strip())
    return "\n\n".join(parts) + "\n"


def _guarded(schema: str, migration: Migration) -> sql.Composed:
    """``migration`` wrapped in a block that applies it (and records it) only once."""
    tag = f"{migration.version:04d}"
    body = _sql.compose(migration.text, schema).as_string(None).strip()
    for quote in (f"$apply_{tag}$", f"$migration_{tag}$"):
        if quote in body:  # a guard the migration itself uses would end the block early
            raise RuntimeError(f"migration {migration.version} contains the quote {quote!r}; rename it in the file")
    return sql.SQL(_sql.read("schema_guarded")).format(
        tag=sql.SQL(tag),
        body=sql.SQL(body),
        schema=sql.Identifier(schema),
        lock_name=sql.Literal(_lock_name(schema)),
        version=sql.Literal(migration.version),
        name=sql.Literal(migration.name),
    )


def _lock_name(schema: str) -> str:
    return f"dramatiq_reliable.migrate:{schema}"


def migrate(conninfo: str | psycopg.Connection[Any], *, schema: str = _sql.DEFAULT_SCHEMA) -> list[int]:
    """Apply every migration ``schema`` lacks and return the versions applied (maybe none).

    ``conninfo`` is a libpq URL or an open connection with no transaction in progress.  All
    pending migrations commit together or not at all.
    """
    _sql.validate_schema(schema)
    if isinstance(conninfo, psycopg.Connection):
        return _migrate(conninfo, schema)
    with psycopg.connect(conninfo) as conn:
        return _migrate(conn, schema)


def _migrate(conn: psycopg.Connection[Any], schema: str) -> list[int]:
    applied = []
    with conn.transaction():
        conn.execute(_sql.query("schema_lock", schema), {"lock_name": _lock_name(schema)})
        conn.execute(_header(schema))
        version = _version(conn, schema) or 0
        for migration in migrations():
            if migration.version > version:
                conn.execute(_sql.compose(migration.text, schema))
                conn.execute(_record(schema, migration))
                applied.append(migration.version)
    return applied


def current_version(conn: psycopg.Connection[Any], *, schema: str = _sql.DEFAULT_SCHEMA) -> int | None:
    """The schema's version, or ``None`` if it was never migrated.  Never raises on a missing table."""
    return _version(conn, _sql.validate_schema(schema))


def ensure_ready(conn: psycopg.Connection[Any], *, schema: str, required: int, feature: str) -> None:
    """Raise ``SchemaNotReady`` unless ``schema`` is at least at version ``required``."""
    version = _version(conn, schema)
    command = migrate_command(schema)
    if version is None:
        raise SchemaNotReady(
            f"the {feature} tables in schema {schema!r} do not exist; run {command!r} "
            "(or apply 'dramatiq-reliable migrate --sql' through your migration tool)"
        )
    if version < required:
        raise SchemaNotReady(
            f"schema {schema!r} is at version {version} but {feature} needs version {required}; run {command!r}"
        )


def migrate_command(schema: str) -> str:
    """The command that migrates ``schema``, for the messages that tell people to run it."""
    return "dramatiq-reliable migrate" + ("" if schema == _sql.DEFAULT_SCHEMA else f" --schema {schema}")


def _version(conn: psycopg.Connection[Any], schema: str) -> int | None:
    if not table_exists(conn, schema, "migrations"):
        return None
    row = conn.cursor(row_factory=dict_row).execute(_sql.query("schema_version", schema)).fetchone()
    return int(row["version"]) if row and row["version"] is not None else None


def table_exists(conn: psycopg.Connection[Any], schema: str, table: str) -> bool:
    """Whether ``schema.table`` exists; never aborts the caller's transaction (``to_regclass``)."""
    name = sql.Identifier(schema, table).as_string(conn)
    row = (
        conn.cursor(row_factory=dict_row).execute(_sql.query("schema_table_exists", schema), {"table": name}).fetchone()
    )
    return bool(row and row["found"])


def _header(schema: str) -> sql.Composed:
    return _sql.query("schema_header", schema)


def _record(schema: str, migration: Migration) -> sql.Composed:
    return sql.SQL(_sql.read("schema_record")).format(
        schema=sql.Identifier(schema), version=sql.Literal(migration.version), name=sql.Literal(migration.name)
    )
