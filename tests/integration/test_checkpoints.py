"""Checkpoints on real Postgres: a window is handed out once, advanced only by a commit, repeated after a failure."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql
from support import server_pid

from dramatiq_reliable import CheckpointError, SchemaNotReady, WorkerRelay, _sql, checkpoint, job_connection, schema
from dramatiq_reliable.idempotency import Idempotency
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, tzinfo=UTC)


def _stored(db: psycopg.Connection[Any], schema: str, name: str) -> tuple[Any, ...] | None:
    query = sql.SQL("SELECT watermark_at, watermark_id, message_id FROM {} WHERE name = %s").format(
        sql.Identifier(schema, "checkpoints")
    )
    return db.execute(query, (name,)).fetchone()


def _run(url: str, schema: str, name: str, initial: Any, *, advance: Any = None) -> tuple[Any, Any]:
    """One run on a connection of its own that commits at the end: returns (since, until)."""
    with psycopg.connect(url) as conn, checkpoint(name, initial=initial, conn=conn, schema=schema) as window:
        if advance is not None:
            window.advance(to=advance)
        return window.since, window.until


@pytest.mark.pooler
def test_the_first_run_starts_at_initial_and_a_committed_run_moves_the_watermark_to_until(database_url, db_schema, db):
    since, until = _run(database_url, db_schema, "orders-sync", T0)
    assert since == T0
    assert until > T0
    assert _stored(db, db_schema, "orders-sync") == (until, None, None)
    since2, until2 = _run(database_url, db_schema, "orders-sync", T0)
    assert since2 == until  # the second run starts where the first ended: nothing skipped, nothing repeated
    assert until2 >= until


def test_an_error_in_the_block_or_a_rollback_after_it_leaves_the_watermark_alone(database_url, db_schema, db):
    _run(database_url, db_schema, "orders-sync", T0, advance=T0)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(RuntimeError), checkpoint("orders-sync", initial=T0, conn=conn, schema=db_schema):
            raise RuntimeError("the job failed half way")
        conn.rollback()
        with conn.transaction():
            with checkpoint("orders-sync", initial=T0, conn=conn, schema=db_schema) as window:
                assert window.since == T0
            raise psycopg.Rollback()  # the job's transaction ends without commit, after the block succeeded
    assert _stored(db, db_schema, "orders-sync") == (T0, None, None)


@pytest.mark.pooler
def test_two_overlapping_runs_do_not_share_a_window_the_second_waits(database_url, db_schema, db):
    _run(database_url, db_schema, "orders-sync", T0, advance=T0)
    first_in, first_may_finish, windows = threading.Event(), threading.Event(), {}

    def first() -> None:
        with (
            psycopg.connect(database_url) as conn,
            checkpoint("orders-sync", initial=T0, conn=conn, schema=db_schema) as window,
        ):
            windows["first"] = (window.since, window.until)
            first_in.set()
            first_may_finish.wait(30)

    def second() -> None:
        windows["second"] = _run(database_url, db_schema, "orders-sync", T0)

    one = threading.Thread(target=first)
    one.start()
    assert first_in.wait(30)
    two = threading.Thread(target=second)
    two.start()
    waiting = sql.SQL("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE {}").format(
        sql.Literal(f'%"{db_schema}".checkpoints%')
    )
    try:
        wait_for(lambda: db.execute(waiting).fetchone()[0] == 1, message="the second run did not wait on the row lock")
        assert "second" not in windows
    finally:
        first_may_finish.set()
    one.join(30)
    two.join(30)
    assert windows["first"][0] == T0
    assert windows["second"][0] == windows["first"][1]  # the second run starts after the first one's window


def test_an_integer_checkpoint_keeps_its_watermark_until_the_job_reports_the_last_id(database_url, db_schema, db):
    assert _run(database_url, db_schema, "ids", 0) == (0, None)
    assert _stored(db, db_schema, "ids") == (None, 0, None)
    assert _run(database_url, db_schema, "ids", 0, advance=42) == (0, None)
    assert _run(database_url, db_schema, "ids", 0) == (42, None)
    assert _stored(db, db_schema, "ids") == (None, 42, None)


def test_a_checkpoint_refuses_another_type_than_it_holds_and_moving_backwards(database_url, db_schema, db):
    _run(database_url, db_schema, "ids", 0, advance=42)
    with pytest.raises(CheckpointError, match=r"holds an integer watermark \(42\) but initial is a datetime"):
        _run(database_url, db_schema, "ids", T0)
    with pytest.raises(CheckpointError, match="cannot move backwards from 42 to 41"):
        _run(database_url, db_schema, "ids", 0, advance=41)
    _run(database_url, db_schema, "stamps", T0, advance=T0 + dt.timedelta(hours=1))
    with pytest.raises(CheckpointError, match="holds a timestamp watermark"):
        _run(database_url, db_schema, "stamps", 0)
    with pytest.raises(CheckpointError, match="cannot move backwards"):
        _run(database_url, db_schema, "stamps", T0, advance=T0)
    assert _stored(db, db_schema, "ids") == (None, 42, None)
    assert _stored(db, db_schema, "stamps") == (T0 + dt.timedelta(hours=1), None, None)


def test_a_retry_after_a_commit_whose_outcome_is_unknown_repeats_the_window(database_url, db_schema, db):
    _run(database_url, db_schema, "ids", 0, advance=10)
    conn = psycopg.connect(database_url)
    try:
        conn.execute("SELECT 1")  # the job's transaction is open: the checkpoint block is a savepoint in it
        with checkpoint("ids", initial=0, conn=conn, schema=db_schema) as window:
            window.advance(to=20)
        # The connection dies before COMMIT reaches the server: the caller cannot tell whether it landed.
        db.execute("SELECT pg_terminate_backend(%s)", (server_pid(conn),))
        # Directly: OperationalError. Behind PgBouncer the pooler answers the COMMIT with the
        # server's FATAL and an error of its own, which psycopg reports as InternalError.
        with pytest.raises((psycopg.OperationalError, psycopg.InternalError)):
            conn.commit()
    finally:
        conn.close()
    assert _run(database_url, db_schema, "ids", 0, advance=20) == (10, None)  # the retry gets 10..20 again
    assert _stored(db, db_schema, "ids") == (None, 20, None)


def test_a_closed_connection_or_a_failed_transaction_is_refused_with_the_fix(database_url, db_schema):
    conn = psycopg.connect(database_url)
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1 / 0")
    with pytest.raises(CheckpointError, match="transaction has failed; roll it back"):
        _open_on(conn, db_schema)
    conn.close()
    with pytest.raises(CheckpointError, match="closed connection; pass an open one"):
        _open_on(conn, db_schema)


def _open_on(conn: psycopg.Connection[Any], schema: str, *, transactions: bool = False) -> None:
    with checkpoint("ids", initial=0, conn=conn, schema=schema, transactions=transactions):
        pass


def test_without_the_schema_migrated_the_error_says_to_migrate(database_url, unmigrated_schema):
    for transactions in (False, True):
        with (
            pytest.raises(SchemaNotReady, match=rf"run 'dramatiq-reliable migrate --schema {unmigrated_schema}'"),
            psycopg.connect(database_url) as conn,
        ):
            _open_on(conn, unmigrated_schema, transactions=transactions)


def test_inside_a_transactional_job_the_watermark_commits_with_the_job_and_a_failed_job_keeps_it(
    broker, queue_name, worker, db, db_schema
):
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    effects = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (since bigint, upto bigint)").format(effects))

    @dramatiq.actor(queue_name=queue_name, broker=broker, max_retries=0)
    def sync(upto: int, fail: bool) -> None:
        with checkpoint("ids", initial=0) as window:
            job_connection().execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(effects), (window.since, upto))
            window.advance(to=upto)
        if fail:
            raise RuntimeError("the job failed after its checkpoint block")

    worker.start()
    sync.send(5, False)
    wait_for(lambda: _stored(db, db_schema, "ids") and _stored(db, db_schema, "ids")[1] == 5)
    failed = sync.send(9, True)
    done = sync.send(7, False)
    wait_for(lambda: _stored(db, db_schema, "ids")[1] == 7, message="the third run never committed")
    rows = db.execute(sql.SQL("SELECT since, upto FROM {} ORDER BY upto").format(effects)).fetchall()
    assert rows == [(0, 5), (5, 7)]  # the failed run's write and watermark rolled back together
    assert _stored(db, db_schema, "ids") == (None, 7, done.message_id)
    assert failed.message_id != done.message_id


def _as_version(database_url: str, schema_name: str, version: int) -> None:
    """Migrations 1..version only: a schema an older release left."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute(schema._header(schema_name))
        for migration in schema.migrations()[:version]:
            conn.execute(_sql.compose(migration.text, schema_name))
            conn.execute(schema._record(schema_name, migration))


def test_migration_7_keeps_the_watermarks_and_code_before_it_keeps_working(database_url, unmigrated_schema, db):
    """On a version 6 schema, timestamp and id checkpoints work and transactions=True says to migrate;
    migration 7 keeps their rows, and the three kinds then live side by side."""
    _as_version(database_url, unmigrated_schema, 6)
    assert schema.current_version(db, schema=unmigrated_schema) == 6
    assert _run(database_url, unmigrated_schema, "ids", 0, advance=7) == (0, None)
    _run(database_url, unmigrated_schema, "stamps", T0, advance=T0)
    with (
        pytest.raises(SchemaNotReady, match=r"older than schema version 7; run 'dramatiq-reliable migrate --schema"),
        psycopg.connect(database_url) as conn,
    ):
        _open_on(conn, unmigrated_schema, transactions=True)
    assert schema.migrate(database_url, schema=unmigrated_schema) == [
        m.version for m in schema.migrations() if m.version >= 7
    ]
    assert _run(database_url, unmigrated_schema, "ids", 0) == (7, None)
    assert _run(database_url, unmigrated_schema, "stamps", T0)[0] == T0
    with psycopg.connect(database_url) as conn:
        with checkpoint("txids", initial=0, conn=conn, schema=unmigrated_schema, transactions=True) as window:
            assert window.since == 0 and window.until is not None and window.until > 0
        horizon = window.until
    assert db.execute(
        sql.SQL("SELECT watermark_txid FROM {} WHERE name = 'txids'").format(
            sql.Identifier(unmigrated_schema, "checkpoints")
        )
    ).fetchone() == (horizon,)
