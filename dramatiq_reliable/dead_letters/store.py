"""The Postgres dead-letter store: capture, list, group, replay, discard, purge."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import psycopg
from dramatiq.broker import Broker
from dramatiq.common import q_name
from psycopg import sql
from psycopg.rows import class_row, dict_row

from .. import _sql, events, schema
from .._checks import check_bool, check_choice, check_ms, check_queue_name
from ..backing import SENDS_TO, backing_of, postgres_backed
from ..binding import bound_connection
from ..database import Database, DatabaseLike
from ..errors import ConfigurationError
from ..outbox.wake import wake_relays
from .analysis import Failure, _clean_text
from .connect import write_within
from .cursor import decode_cursor, encode_cursor
from .records import (
    _DEFAULT_BATCH,
    _MAX_ERROR_MESSAGE_CHARS,
    DEFAULT_REPLAY_MAX_AGE_MS,
    DEFAULT_RETENTION_MS,
    RESET_OPTIONS,
    UNSET,
    DeadLetter,
    DeadLetterCount,
    DeadLetterFilter,
    DeadLetterGroup,
    DeadLetterPage,
    DeadLettersDiscarded,
    DeadLettersReplayed,
    DiscardResult,
    PurgeResult,
    ReplayResult,
    State,
    notify_channel,
)
from .validators import (
    check_batch,
    check_by,
    check_filter,
    check_id,
    check_ids,
    check_limit,
    check_state,
    check_target,
    format_duration_ms,
    seconds,
)

__all__ = ["PostgresDeadLetterStore"]


@functools.lru_cache(maxsize=256)
def _query(name: str, schema_name: str) -> sql.Composed:
    """``sql/<name>.sql`` with ``{schema}`` quoted and ``{filter}`` replaced by the one shared
    filter block, ``dead_letters_filter.sql`` (its comment lines dropped: they would swallow the
    rest of the line they are composed into)."""
    text = _sql.read(name)
    if "{filter}" not in text:
        return _sql.query(name, schema_name)
    block = " ".join(line for line in _sql.read("dead_letters_filter").splitlines() if not line.startswith("--"))
    return sql.SQL(text).format(schema=sql.Identifier(schema_name), filter=sql.SQL(block.strip()))


class PostgresDeadLetterStore:
    """Reads and maintains the ``dead_letters`` table: list, show, group, replay, discard, purge.

    Parameters:
      database: where the table lives: a URL, a ``psycopg_pool.ConnectionPool`` or a
        :class:`~dramatiq_reliable.Database` to share (a broker's, say).
      schema: the Postgres schema of the tables (migrated to version 3 or later).
      replay_max_age_ms: replays of jobs first sent longer ago than this are refused unless
        forced; ``None`` never refuses.
      retention_ms: :meth:`purge` deletes dead letters whose last failure is older than this;
        ``None`` keeps them until discarded.
      batch_size: rows per transaction in bulk replays, discards and purges.
      replay_to: ``"outbox"`` (for ``OutboxBroker``: the relay publishes replays) or
        ``"queue"`` (for ``PostgresBroker``: replays become queue rows directly).

    Replays and discards run in the transaction bound with
    :func:`~dramatiq_reliable.outbox.bind` (or ``broker.transaction()``), or the one you pass as
    ``conn=``, and then commit or roll back with it; otherwise each batch commits on its own.
    """

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        replay_max_age_ms: int | None = DEFAULT_REPLAY_MAX_AGE_MS,
        retention_ms: int | None = DEFAULT_RETENTION_MS,
        batch_size: int = _DEFAULT_BATCH,
        replay_to: Literal["outbox", "queue"] = "outbox",
    ) -> None:
        self.replay_to = check_choice("replay_to", replay_to, SENDS_TO)
        check_ms("replay_max_age_ms", replay_max_age_ms, allow_none=True, fix="e.g. 7 days = 604800000")
        check_ms("retention_ms", retention_ms, allow_none=True, fix="e.g. 30 days = 2592000000")
        check_batch(batch_size)
        self.schema = _sql.validate_schema(schema)
        self.channel = notify_channel(self.schema)
        self.replay_max_age_ms = replay_max_age_ms
        self.retention_ms = retention_ms
        self.batch_size = batch_size
        self._owned = not isinstance(database, Database)
        self.database = Database.of(database)
        self._ready = False

    @classmethod
    def from_broker(cls, broker: Broker, **options: Any) -> PostgresDeadLetterStore:
        """A store on a Postgres-backed ``broker``'s pool and schema, replaying where its sends go."""
        if postgres_backed(broker) is None:
            raise ConfigurationError(
                f"PostgresDeadLetterStore.from_broker() needs a Postgres-backed broker (OutboxBroker or "
                f"PostgresBroker), got {type(broker).__name__!r}; build PostgresDeadLetterStore(database=...) instead"
            )
        backing = backing_of(broker, needed_by="PostgresDeadLetterStore", schema=options.pop("schema", None))
        options.setdefault("replay_to", backing.sends_to)
        return cls(database=backing.database, schema=backing.schema, **options)

    def close(self) -> None:
        """Close the pool if this store created it."""
        if self._owned:
            self.database.close()

    def __enter__(self) -> PostgresDeadLetterStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- connections ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self, conn: psycopg.Connection[Any] | None) -> Iterator[psycopg.Connection[Any]]:
        """The caller's transaction on ``conn``, or a pooled one that commits on exit.

        On a non-autocommit ``conn`` with no transaction open yet, the first statement opens
        the caller's transaction and committing it stays the caller's job, as with ``bind()``;
        ``conn.transaction()`` there would commit on exit.  Inside an open transaction a
        savepoint wraps the statements; on an autocommit connection a transaction does.
        """
        if conn is not None:
            if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self._check_ready(conn)
                yield conn
                return
            with conn.transaction():
                self._check_ready(conn)
                yield conn
            return
        with self.database.connection() as pooled, pooled.transaction():
            self._check_ready(pooled)
            yield pooled

    def check_ready(self) -> None:
        """Raise ``SchemaNotReady`` unless the dead-letter table exists (at worker boot)."""
        with self.database.connection() as conn:
            self._check_ready(conn)

    def _check_ready(self, conn: psycopg.Connection[Any]) -> None:
        if not self._ready:
            required = schema.QUEUE_VERSION if self.replay_to == "queue" else schema.DEAD_LETTERS_VERSION
            schema.ensure_ready(conn, schema=self.schema, required=required, feature="dead letters")
            self._ready = True

    def _query(self, name: str) -> sql.Composed:
        return _query(name, self.schema)

    # -- capture -------------------------------------------------------------------------------

    def save(self, failure: Failure, *, timeout_ms: int) -> DeadLetter:
        """Write (or refresh) the dead letter of ``failure``; see :func:`.connect.write_within`."""

        def insert(conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
            self._check_ready(conn)
            cursor = conn.cursor(row_factory=dict_row)
            return cursor.execute(self._query("dead_letters_capture"), failure.params(self.channel)).fetchone()

        # The statement timeout bounds lock waits (a concurrent replay of the same message) and
        # the retries bound an outage: either way the nack waits at most about timeout_ms.
        row = write_within(self.database, self.schema, timeout_ms, insert)
        assert row is not None
        return DeadLetter(
            id=row["id"],
            message_id=failure.message_id,
            queue_name=failure.queue_name,
            actor_name=failure.actor_name,
            error_type=failure.error_type,
            error_message=failure.error_message,
            attempts=failure.attempts,
            reason=failure.reason,
            http_status=failure.http_status,
            fingerprint=failure.fingerprint,
            culprit=failure.culprit,
            state="dead",
            sent_at=row["sent_at"],
            first_failed_at=row["first_failed_at"],
            last_failed_at=row["last_failed_at"],
            worker_host=socket.gethostname(),
            worker_pid=os.getpid(),
            captures=row["captures"],
            message=json.loads(failure.message_json),
            traceback=failure.traceback,
            retry_decision=failure.retry_decision,
        )

    def save_imported(self, failure: Failure, *, after_id: int) -> int | None:
        """Insert a dead letter moved from ``.XQ`` unless its death has a row; its id, or ``None``."""
        with self._transaction(None) as conn:
            params = {**failure.params(self.channel), "after_id": after_id}
            row = conn.cursor(row_factory=dict_row).execute(self._query("dead_letters_import"), params).fetchone()
        return int(row["id"]) if row else None

    # -- reading -------------------------------------------------------------------------------

    def get(self, dead_letter_id: int) -> DeadLetter | None:
        """One dead letter with its message, traceback and retry decision, in any state."""
        check_id(dead_letter_id)
        with self._transaction(None) as conn:
            # Columns map to DeadLetter's fields by name, never by position.
            cursor = conn.cursor(row_factory=class_row(DeadLetter))
            return cursor.execute(self._query("dead_letters_get"), {"id": dead_letter_id}).fetchone()

    def list(
        self,
        *,
        where: DeadLetterFilter | None = None,
        state: State | None = "dead",
        limit: int = 50,
        cursor: str | None = None,
    ) -> DeadLetterPage:
        """Dead letters newest first (by last failure), ``limit`` at a time.

        ``state=None`` lists every state.  Pagination is keyset-based: a page costs the same
        however deep it is, and rows that die meanwhile do not shift the pages.
        """
        where = check_filter(where)
        check_state(state)
        check_limit(limit)
        before_at, before_id = decode_cursor(cursor)
        params = {**where.params(), "state": state, "before_at": before_at, "before_id": before_id, "limit": limit}
        with self._transaction(None) as conn:
            # prepare=False: planned with the actual values, so unused filters fold away.
            rows = conn.cursor(row_factory=class_row(DeadLetter))
            items = tuple(rows.execute(self._query("dead_letters_list"), params, prepare=False).fetchall())
        next_cursor = encode_cursor(items[-1].last_failed_at, items[-1].id) if len(items) == limit else None
        return DeadLetterPage(items, next_cursor)

    def count(
        self, *, where: DeadLetterFilter | None = None, ids: Sequence[int] | None = None, state: State | None = "dead"
    ) -> int:
        """How many dead letters match (state ``dead`` by default)."""
        check_state(state)
        return self._count(None, check_filter(where), check_ids(ids), state, None)["total"]

    def _count(
        self,
        conn: psycopg.Connection[Any] | None,
        where: DeadLetterFilter,
        ids: Sequence[int] | None,
        state: State | None,
        max_age_ms: int | None,
    ) -> dict[str, int]:
        """``total`` rows matching, ``too_old`` of them past ``max_age_ms``, ``upto`` the highest id."""
        params = {**where.params(), "ids": ids, "state": state, "max_age_s": seconds(max_age_ms)}
        with self._transaction(conn) as tx:
            cursor = tx.cursor(row_factory=dict_row)
            row = cursor.execute(self._query("dead_letters_count"), params, prepare=False).fetchone()
        assert row is not None
        return {name: int(row[name]) for name in ("total", "too_old", "upto")}

    def replay_preview(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        force: bool = False,
        max_age_ms: int | None = UNSET,
    ) -> tuple[int, int]:
        """What :meth:`replay` with the same arguments would find: (dead letters matching, how
        many of them it would refuse as too old).  For confirmation prompts."""
        if max_age_ms is UNSET:
            max_age_ms = self.replay_max_age_ms
        check_ms("max_age_ms", max_age_ms, allow_none=True, fix="or pass force=True")
        check_bool("force", force)
        where = check_filter(where)
        counted = self._count(None, where, check_ids(ids), "dead", None if force else max_age_ms)
        return counted["total"], counted["too_old"]

    def stats(self, *, where: DeadLetterFilter | None = None, limit: int = 20) -> tuple[DeadLetterGroup, ...]:
        """Dead letters grouped by fingerprint, biggest group first."""
        where = check_filter(where)
        check_limit(limit)
        with self._transaction(None) as conn:
            cursor = conn.cursor(row_factory=class_row(DeadLetterGroup))
            query = self._query("dead_letters_stats")
            return tuple(cursor.execute(query, {**where.params(), "limit": limit}, prepare=False).fetchall())

    def counts(self) -> tuple[DeadLetterCount, ...]:
        """Dead letters (state ``dead``) by actor and error type, biggest first: for status
        pages, alert rules and metrics gauges."""
        with self._transaction(None) as conn:
            cursor = conn.cursor(row_factory=class_row(DeadLetterCount))
            return tuple(cursor.execute(self._query("dead_letters_counts")).fetchall())

    # -- replay and discard --------------------------------------------------------------------

    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        queue_name: str | None = None,
        delay_ms: int | None = None,
        force: bool = False,
        max_age_ms: int | None = UNSET,
        by: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayResult:
        """Send dead letters again, through the outbox, and mark them replayed.

        Pick rows with ``ids=``, ``where=`` (``DeadLetterFilter()`` for all) or both (their
        intersection).  Each replayed message keeps its ``message_id`` (one logical job from
        end to end; it never committed an idempotency key, since it failed) and its options,
        except :data:`RESET_OPTIONS`, so it starts with a fresh retry budget;
        ``options["replay_of"]`` records the dead letter's id, when the job was first sent,
        and how many times it was replayed.  ``queue_name`` sends it to another queue (same
        actor), ``delay_ms`` delays it.

        The outbox row and the state change are one statement, so they commit together: a
        replay is never lost, and a row is replayed at most once (only rows still ``dead`` are
        picked, under a row lock).  Jobs first sent more than ``max_age_ms`` ago (default: the
        store's ``replay_max_age_ms``) are left dead unless ``force=True``.

        The messages reach RabbitMQ when the relay publishes them (``WorkerRelay`` or
        ``dramatiq-reliable relay``).  ``progress(done, total)`` is called after each batch.
        """
        started = time.perf_counter()
        id_list, where = check_target(ids, where, "replay")
        check_queue_name("queue_name", queue_name, allow_none=True)
        if queue_name is not None and queue_name != q_name(queue_name):
            raise ConfigurationError(
                f"queue_name must be a queue's canonical name (not its .DQ or .XQ), got {queue_name!r}"
            )
        check_ms("delay_ms", delay_ms, allow_none=True, fix="e.g. delay_ms=60000 for one minute")
        check_bool("force", force)
        if max_age_ms is UNSET:
            max_age_ms = self.replay_max_age_ms
        check_ms("max_age_ms", max_age_ms, allow_none=True, fix="or pass force=True")
        age_limit = None if force else max_age_ms
        handled_by = check_by(by)
        bound = conn if conn is not None else bound_connection()

        before = self._states(bound, id_list, age_limit) if id_list is not None else {}
        counted = self._count(bound, where, id_list, "dead", age_limit)
        total, too_old, upto = counted["total"], counted["too_old"], counted["upto"]
        params = {
            **where.params(),
            "ids": id_list,
            "upto_id": upto,
            "max_age_s": seconds(age_limit),
            "to_queue": queue_name,
            "delay_ms": delay_ms,
            "handled_by": handled_by,
            "reset_options": list(RESET_OPTIONS),
            "batch": self.batch_size,
        }
        statement = "dead_letters_replay" if self.replay_to == "outbox" else "queue_replay"
        replayed = self._batches(statement, params, bound, total - too_old, progress) if upto else 0
        problems = self._problems(bound, id_list, before, "replayed", age_limit) if id_list is not None else {}
        events.emit(
            DeadLettersReplayed(
                count=replayed,
                too_old=too_old,
                schema=self.schema,
                queue_name=queue_name,
                delay_ms=delay_ms,
                handled_by=handled_by,
                duration_ms=(time.perf_counter() - started) * 1000,
            )
        )
        return ReplayResult(replayed, too_old, problems)

    def discard(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        note: str | None = None,
        by: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DiscardResult:
        """Mark dead letters discarded, on purpose: they stay (with ``note``, who and when) for
        the audit trail until :meth:`purge`.  Rows are picked as for :meth:`replay`."""
        id_list, where = check_target(ids, where, "discard")
        if note is not None and not isinstance(note, str):
            raise ConfigurationError(f"note must be a string or None, got {type(note).__name__!r}")
        handled_by = check_by(by)
        bound = conn if conn is not None else bound_connection()
        before = self._states(bound, id_list, None) if id_list is not None else {}
        counted = self._count(bound, where, id_list, "dead", None)
        total, upto = counted["total"], counted["upto"]
        params = {
            **where.params(),
            "ids": id_list,
            "upto_id": upto,
            "handled_by": handled_by,
            "note": _clean_text(note)[:_MAX_ERROR_MESSAGE_CHARS] if note else None,
            "batch": self.batch_size,
        }
        discarded = self._batches("dead_letters_discard", params, bound, total, progress) if upto else 0
        problems = self._problems(bound, id_list, before, "discarded", None) if id_list is not None else {}
        events.emit(DeadLettersDiscarded(count=discarded, schema=self.schema, handled_by=handled_by, note=note))
        return DiscardResult(discarded, problems)

    def _batches(
        self,
        name: str,
        params: dict[str, Any],
        conn: psycopg.Connection[Any] | None,
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> int:
        # Keyset batches on (last_failed_at, id), the order of the filters' indexes, up to the
        # highest id counted beforehand: each batch is short, its own transaction unless the
        # caller's, and rows that die meanwhile are left alone.
        done = 0
        after_at: datetime.datetime | None = None
        after_id = 0
        while True:
            with self._transaction(conn) as tx:
                cursor = tx.cursor(row_factory=dict_row)
                batch = {**params, "after_at": after_at, "after_id": after_id}
                row = cursor.execute(self._query(name), batch, prepare=False).fetchone()
                if name == "dead_letters_replay" and row is not None and row["handled"]:
                    # One NOTIFY per batch, delivered with its commit: idle relays publish the
                    # replay at once.  Producers' inserts send none (see outbox/wake.py).
                    wake_relays(tx, schema=self.schema)
            assert row is not None
            handled = int(row["handled"])
            done += handled
            if progress is not None and handled:
                progress(done, max(total, done))
            # total came from the count: stopping there saves a last scan that finds nothing.
            if handled < self.batch_size or row["last_id"] is None or done >= total:
                return done
            after_at, after_id = row["last_failed_at"], int(row["last_id"])

    def _states(
        self, conn: psycopg.Connection[Any] | None, ids: Sequence[int], max_age_ms: int | None
    ) -> dict[int, tuple[str, bool]]:
        with self._transaction(conn) as tx:
            cursor = tx.cursor(row_factory=dict_row)
            params = {"ids": ids, "max_age_s": seconds(max_age_ms)}
            rows = cursor.execute(self._query("dead_letters_states"), params).fetchall()
        return {int(row["id"]): (row["state"], bool(row["too_old"])) for row in rows}

    def _problems(
        self,
        conn: psycopg.Connection[Any] | None,
        ids: Sequence[int],
        before: Mapping[int, tuple[str, bool]],
        done_state: str,
        age_limit: int | None,
    ) -> dict[int, str]:
        after = self._states(conn, ids, None)
        problems: dict[int, str] = {}
        for dead_letter_id in ids:
            if dead_letter_id not in before:
                problems[dead_letter_id] = "not found"
            elif before[dead_letter_id][0] != "dead":
                problems[dead_letter_id] = f"already {before[dead_letter_id][0]}"
            elif after.get(dead_letter_id, ("",))[0] == done_state:
                continue
            elif before[dead_letter_id][1]:
                age = format_duration_ms(age_limit or 0)
                problems[dead_letter_id] = f"first sent more than {age} ago; pass force to replay it, or discard it"
            else:
                problems[dead_letter_id] = (
                    "not handled: it does not match the filter, or a concurrent replay or discard held it"
                )
        return problems

    # -- retention -----------------------------------------------------------------------------

    def purge(
        self,
        *,
        older_than_ms: int | None = UNSET,
        handled_older_than_ms: int | None = 0,
        batch: int | None = None,
    ) -> PurgeResult:
        """Delete handled rows and dead rows past retention, in short batches.

        ``older_than_ms`` (default: the store's ``retention_ms``; ``None`` keeps them): dead
        rows whose last failure is older.  ``handled_older_than_ms`` (default 0, all of them;
        ``None`` keeps them): replayed and discarded rows handled longer ago.
        """
        if older_than_ms is UNSET:
            older_than_ms = self.retention_ms
        check_ms("older_than_ms", older_than_ms, allow_none=True, fix="e.g. 30 days = 2592000000")
        check_ms("handled_older_than_ms", handled_older_than_ms, allow_none=True, fix="0 purges every handled row")
        size = self.batch_size if batch is None else check_batch(batch)
        dead = self._purge("dead_letters_purge_dead", older_than_ms, size) if older_than_ms is not None else 0
        handled = (
            self._purge("dead_letters_purge_handled", handled_older_than_ms, size)
            if handled_older_than_ms is not None
            else 0
        )
        return PurgeResult(dead, handled)

    def _purge(self, name: str, older_than_ms: int, batch: int) -> int:
        total = 0
        while True:
            with self._transaction(None) as conn:
                deleted = conn.execute(
                    self._query(name), {"older_than_s": older_than_ms / 1000, "batch": batch}
                ).rowcount
            total += deleted
            if deleted < batch:
                return total
