"""Concurrency per key across worker processes: a killed holder frees its slot after the lease, and a
tenant with a backlog does not hold up a tenant with three jobs."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from worker_apps import kill_app, start_app, stop_app

from dramatiq_reliable import PostgresBroker
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("flow_worker_app.py")
LEASE_MS = 1500


def _worker(database_url: str, schema: str, queue: str, **settings: str) -> subprocess.Popen[str]:
    return start_app(
        APP, DATABASE_URL=database_url, SCHEMA=schema, QUEUE=queue, FLOW_LEASE_MS=str(LEASE_MS), **settings
    )


@pytest.fixture
def runs(db: psycopg.Connection[Any], db_schema: str) -> sql.Composed:
    table = sql.Identifier(db_schema, "runs")
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id serial PRIMARY KEY, actor text, key text, n int, pid int, outcome text, "
            "started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz)"
        ).format(table)
    )
    db.execute(sql.SQL("CREATE TABLE {} (key text, n int, fails int)").format(sql.Identifier(db_schema, "plan")))
    return sql.SQL("SELECT key, n, pid, outcome, started_at, finished_at FROM {} ORDER BY id").format(table)


@pytest.fixture
def sender(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    yield broker
    broker.close()


def _send(broker: PostgresBroker, queue: str, tenant: str, numbers: range) -> None:
    task = broker.actors.get("limited") or dramatiq.actor(
        lambda tenant, n: None, actor_name="limited", queue_name=queue, broker=broker
    )
    with broker.transaction():
        for n in numbers:
            task.send(tenant, n)


def _count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()
    return int(row[0]) if row else -1


def test_a_worker_killed_while_holding_a_slot_frees_it_after_the_lease(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, sender: PostgresBroker
) -> None:
    queue = f"cc_{uuid.uuid4().hex[:10]}"
    _send(sender, queue, "t", range(1))
    doomed = _worker(database_url, db_schema, queue, STALL="1", LIMIT="1")
    try:
        wait_for(lambda: db.execute(runs).fetchall(), timeout_ms=30_000, message="the first worker never ran job 0")
        _send(sender, queue, "t", range(1, 2))
        wait_for(lambda: _count(db, db_schema, "concurrency_parked") == 1, message="job 1 was not parked behind job 0")
    finally:
        kill_app(doomed)
    killed_at = time.monotonic()
    survivor = _worker(database_url, db_schema, queue, LIMIT="1")
    try:
        wait_for(
            lambda: {r[1] for r in db.execute(runs).fetchall() if r[3] == "ok"} == {0, 1},
            timeout_ms=30_000,
            message="the slot stayed held after its holder was killed",
        )
        # Job 1 waited for the dead holder's slot to lapse, not less.
        assert time.monotonic() - killed_at > (LEASE_MS - 500) / 1000
        # The dead holder's lapsed slot is swept by the survivor's heartbeat.
        wait_for(lambda: _count(db, db_schema, "concurrency_slots") == 0, message="the lapsed slot stayed")
    finally:
        stop_app(survivor)
    first, *later = db.execute(runs).fetchall()
    assert first[2] == doomed.pid and first[5] is None
    assert {r[2] for r in later} == {survivor.pid}
    assert _count(db, db_schema, "concurrency_parked") == 0


def test_a_tenant_with_a_backlog_does_not_starve_a_tenant_with_three_jobs(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, sender: PostgresBroker
) -> None:
    queue = f"cc_{uuid.uuid4().hex[:10]}"
    _send(sender, queue, "big", range(300))
    _send(sender, queue, "small", range(3))  # sent after the whole backlog
    workers = [_worker(database_url, db_schema, queue, LIMIT="2", WORK_MS="20") for _ in range(2)]
    try:
        wait_for(
            lambda: sum(1 for r in db.execute(runs).fetchall() if r[0] == "small" and r[3] == "ok") == 3,
            timeout_ms=30_000,
            message="the small tenant's jobs never ran",
        )
        big_done = sum(1 for r in db.execute(runs).fetchall() if r[0] == "big" and r[3] == "ok")
    finally:
        for process in workers:
            stop_app(process)
    # FIFO would run all 300 first; with the limit and parking the three ran near the start.
    assert big_done < 100, f"the small tenant waited for {big_done} of the big tenant's 300 jobs"
