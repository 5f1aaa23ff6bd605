"""Singleton actors across worker processes: never two runs at once, and a killed holder frees the key."""

from __future__ import annotations

import itertools
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from worker_apps import start_app, stop_app

from dramatiq_reliable import PostgresBroker
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("singleton_worker_app.py")
LEASE_MS = 3000


def _worker(
    database_url: str, schema: str, queue: str, *, stall: bool, txn: bool = False, lease_ms: int = LEASE_MS
) -> subprocess.Popen[str]:
    return start_app(
        APP,
        DATABASE_URL=database_url,
        SCHEMA=schema,
        QUEUE=queue,
        STALL="1" if stall else "0",
        TXN="1" if txn else "0",
        SINGLETON_LEASE_MS=str(lease_ms),
    )


@pytest.fixture
def runs(db: psycopg.Connection[Any], db_schema: str) -> sql.Composed:
    table = sql.Identifier(db_schema, "runs")
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id serial PRIMARY KEY, n int, pid int, "
            "started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz)"
        ).format(table)
    )
    return sql.SQL("SELECT n, pid, started_at, finished_at FROM {} ORDER BY started_at").format(table)


@pytest.fixture
def broker(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    sender = PostgresBroker(database=database_url, schema=db_schema)
    yield sender
    sender.close()


def _send(broker: PostgresBroker, queue: str, numbers: range) -> None:
    task = broker.actors.get("job") or dramatiq.actor(lambda n: None, actor_name="job", queue_name=queue, broker=broker)
    with broker.transaction():
        for n in numbers:
            task.send(n)


def test_a_singleton_sent_20_times_to_2_worker_processes_never_runs_twice_at_once(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, broker: PostgresBroker
) -> None:
    queue = f"sg_{uuid.uuid4().hex[:10]}"
    _send(broker, queue, range(20))
    workers = [_worker(database_url, db_schema, queue, stall=False) for _ in range(2)]
    try:
        wait_for(
            lambda: sum(1 for r in db.execute(runs).fetchall() if r[3] is not None) == 20,
            timeout_ms=60_000,
            message="the 20 runs did not all finish",
        )
    finally:
        for process in workers:
            stop_app(process)
    rows = db.execute(runs).fetchall()
    assert sorted(r[0] for r in rows) == list(range(20))  # each message ran once: postponed, not dropped
    for before, after in itertools.pairwise(rows):
        assert after[2] >= before[3], (
            f"run {after[0]} started at {after[2]} before run {before[0]} ended at {before[3]}"
        )


def test_a_worker_killed_while_holding_the_key_does_not_keep_it(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, broker: PostgresBroker
) -> None:
    queue = f"sg_{uuid.uuid4().hex[:10]}"
    _send(broker, queue, range(1))
    doomed = _worker(database_url, db_schema, queue, stall=True)
    try:
        wait_for(lambda: db.execute(runs).fetchall(), timeout_ms=30_000, message="the first worker never ran the job")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)
        if doomed.stdin is not None:
            doomed.stdin.close()
    # When the dead holder's lease lapses, by the database's clock: its last renewal plus
    # LEASE_MS (the heartbeat renews every LEASE_MS / 3, so that is 2 to 3 s after the kill).
    held = db.execute(
        sql.SQL("SELECT expires_at FROM {}").format(sql.Identifier(db_schema, "singleton_leases"))
    ).fetchall()
    assert len(held) == 1, "the dead holder's lease row is there"
    lapses_at = held[0][0]
    _send(broker, queue, range(1, 2))
    survivor = _worker(database_url, db_schema, queue, stall=False)
    try:
        wait_for(
            lambda: {r[0] for r in db.execute(runs).fetchall() if r[3] is not None} == {0, 1},
            timeout_ms=30_000,
            message="the key stayed held after its holder was killed",
        )
    finally:
        stop_app(survivor)
    # The next runs waited for the dead holder's lease to lapse, not less.
    assert all(r[2] >= lapses_at for r in db.execute(runs).fetchall()[1:]), "a run started before the lease lapsed"
    leases = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(db_schema, "singleton_leases")))
    assert leases.fetchone() == (0,)
    first, *later = db.execute(runs).fetchall()
    assert first[1] == doomed.pid and first[3] is None
    assert all(r[1] == survivor.pid for r in later)


def test_a_killed_worker_holding_the_key_in_its_job_transaction_frees_it_with_its_connection(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, broker: PostgresBroker
) -> None:
    # A lease of ten minutes: were the key an autocommit lease, the survivor could not take it
    # before the test times out.  It is the dead worker's transaction, gone with its connection.
    lease_ms = 600_000
    queue = f"sg_{uuid.uuid4().hex[:10]}"
    _send(broker, queue, range(1))
    doomed = _worker(database_url, db_schema, queue, stall=True, txn=True, lease_ms=lease_ms)
    try:
        wait_for(lambda: db.execute(runs).fetchall(), timeout_ms=30_000, message="the first worker never ran the job")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)
        if doomed.stdin is not None:
            doomed.stdin.close()
    _send(broker, queue, range(1, 3))
    survivor = _worker(database_url, db_schema, queue, stall=False, txn=True, lease_ms=lease_ms)
    try:
        wait_for(
            lambda: {r[0] for r in db.execute(runs).fetchall() if r[3] is not None} == {0, 1, 2},
            timeout_ms=30_000,
            message="the key stayed held after its holder was killed",
        )
    finally:
        stop_app(survivor)
    first, *later = db.execute(runs).fetchall()
    assert first[1] == doomed.pid and first[3] is None
    assert all(r[1] == survivor.pid for r in later)
    for before, after in itertools.pairwise(later):
        assert after[2] >= before[3]
    # One row, free: nothing for a heartbeat to renew or a release to delete.
    leases = db.execute(
        sql.SQL("SELECT count(*), bool_and(expires_at = '-infinity') FROM {}").format(
            sql.Identifier(db_schema, "singleton_leases")
        )
    )
    assert leases.fetchone() == (1, True)
