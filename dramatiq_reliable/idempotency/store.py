"""Processed-job keys in Postgres: the one home of every statement on ``processed_jobs``.

Both modes run the same two statements from here.  Transactional mode claims the key as the
first statement of the job's own transaction (:func:`claim_key`, then :func:`read_key` on a
conflict).  Record mode, with or without ``Idempotency(store=...)``, goes through
:class:`PostgresIdempotencyStore`: each step is one autocommit statement, tried again on a
fresh connection after a connection-class error (a socket the pool kept across a Postgres
restart) until ``connection_timeout_ms`` has passed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.rows import class_row, dict_row

from .. import _sql, events
from .._checks import check_int, check_ms
from ..classify import is_connection_failure
from ..database import Database, DatabaseLike
from ..jobs.attempts import purge_attempts
from ..schema import IDEMPOTENCY_VERSION, JOBS_VERSION, current_version, ensure_ready
from ._connections import autocommit
from .events import IdempotencyKeysPurged
from .protocol import StoredKey

__all__ = ["PostgresIdempotencyStore", "purge_expired"]

_T = TypeVar("_T")

#: The parameters of the key statements: actor_name, job_key, payload_hash, message_id, retention_s.
KeyParams = dict[str, Any]

# Pauses between tries on fresh connections: a reset socket fails in microseconds, so the first
# retry is quick; a server that is restarting gets up to a second between tries.
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 1.0


def claim_key(conn: psycopg.Connection[Any], schema: str, params: KeyParams) -> bool:
    """Insert the key (or take over an expired one) on ``conn``; ``False``: another run holds it."""
    cursor = conn.cursor(row_factory=dict_row)
    return cursor.execute(_sql.rendered("idempotency_claim", schema), params).fetchone() is not None


def read_key(conn: psycopg.Connection[Any], schema: str, params: KeyParams) -> StoredKey | None:
    """The unexpired stored run of the key, or ``None``."""
    cursor = conn.cursor(row_factory=class_row(StoredKey))
    return cursor.execute(_sql.rendered("idempotency_lookup", schema), params).fetchone()


def on_fresh_connections(database: Database, timeout_s: float, work: Callable[[psycopg.Connection[Any]], _T]) -> _T:
    """``work(conn)`` on a pooled autocommit connection, again on a fresh one after a
    connection-class error, until ``timeout_s`` has passed; then the last error is raised."""
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    while True:
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            with database.connection(timeout_ms=remaining_ms) as conn, autocommit(conn):
                return work(conn)
        except psycopg.Error as error:
            if not is_connection_failure(error) or time.monotonic() + pause >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)


def purge_expired(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA, batch_size: int = 5000) -> int:
    """Delete expired keys in batches of ``batch_size``; return how many were deleted.

    Each batch is its own short transaction, so a large backlog never holds long locks.  The
    ``dramatiq-reliable idempotency purge`` command and :func:`make_purge_actor` call this.
    Expired failure records (``job_attempts``, see :mod:`dramatiq_reliable.jobs.attempts`) go
    in the same pass, on a schema migrated far enough to have them; they are not counted.
    """
    schema_name = _sql.validate_schema(schema)
    check_int("batch_size", batch_size, minimum=1, fix="e.g. batch_size=5000")
    owned = not isinstance(database, Database)
    database = Database.of(database)
    started = time.perf_counter()
    total = 0
    with contextlib.ExitStack() as stack:
        if owned:
            stack.callback(database.close)
        conn = stack.enter_context(database.connection())
        ensure_ready(conn, schema=schema_name, required=IDEMPOTENCY_VERSION, feature="idempotency")
        conn.rollback()
        with autocommit(conn):
            while True:
                deleted = conn.execute(
                    _sql.query("idempotency_purge", schema_name), {"batch_size": batch_size}
                ).rowcount
                total += deleted
                if deleted < batch_size:
                    break
            if (current_version(conn, schema=schema_name) or 0) >= JOBS_VERSION:
                purge_attempts(conn, schema_name, batch_size=batch_size)
    events.emit(IdempotencyKeysPurged(total, schema_name, (time.perf_counter() - started) * 1000))
    return total


class PostgresIdempotencyStore:
    """Record-mode keys in the ``processed_jobs`` table.

    The middleware uses one of these for record mode on its own database; pass one as
    ``Idempotency(store=...)`` to keep record-mode keys in another database, or use it to read
    and purge keys.

    Parameters:
      database: where the table lives (a URL, a pool or a ``Database``).
      schema: the schema of the table.
      connection_timeout_ms: how long a lookup or record keeps trying on fresh connections;
        default the pool's timeout.
    """

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        connection_timeout_ms: int | None = None,
    ) -> None:
        check_ms("connection_timeout_ms", connection_timeout_ms, minimum=1, allow_none=True, fix="e.g. 10000")
        self._owned = not isinstance(database, Database)
        self.database = Database.of(database)
        self.schema = _sql.validate_schema(schema)
        self.connection_timeout_ms = connection_timeout_ms
        self._ready = False
        self._lock = threading.Lock()

    def _timeout_s(self) -> float:
        if self.connection_timeout_ms is not None:
            return self.connection_timeout_ms / 1000
        return float(self.database.pool.timeout)

    def _ensure_ready(self, conn: psycopg.Connection[Any]) -> None:
        if not self._ready:
            with self._lock:
                ensure_ready(conn, schema=self.schema, required=IDEMPOTENCY_VERSION, feature="idempotency")
                self._ready = True

    def _run(self, work: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        def checked(conn: psycopg.Connection[Any]) -> _T:
            self._ensure_ready(conn)
            return work(conn)

        try:
            return on_fresh_connections(self.database, self._timeout_s(), checked)
        except psycopg.errors.UndefinedTable:
            self._ready = False  # dropped under us: check again, and say 'migrate', next time
            raise

    def lookup(self, *, actor_name: str, key: str) -> StoredKey | None:
        params = {"actor_name": actor_name, "job_key": key}
        return self._run(lambda conn: read_key(conn, self.schema, params))

    def record(self, *, actor_name: str, key: str, payload_hash: bytes, message_id: str, retention_s: float) -> bool:
        # An autocommit INSERT whose reply was lost and is sent again finds its own row and
        # returns False: harmless, the key is stored.
        params = {
            "actor_name": actor_name,
            "job_key": key,
            "payload_hash": payload_hash,
            "message_id": message_id,
            "retention_s": retention_s,
        }
        return self._run(lambda conn: claim_key(conn, self.schema, params))

    def check_ready(self) -> None:
        with self.database.connection() as conn:
            ensure_ready(conn, schema=self.schema, required=IDEMPOTENCY_VERSION, feature="idempotency")

    def purge_expired(self) -> int:
        return purge_expired(self.database, schema=self.schema)

    def describe(self) -> str:
        """Where the keys are, for error messages (no credentials)."""
        return f"schema {self.schema!r}"

    def close(self) -> None:
        """Close the pool if this store created it."""
        if self._owned:
            self.database.close()
