"""Rate limits across worker processes: one bucket for the fleet, and a 429 pauses every worker."""

from __future__ import annotations

import importlib.util
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

APP = Path(__file__).with_name("rate_limit_worker_app.py")
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "flow_control.py"
RATE = 20
#: How late a postponed job may start after its slot: an idle consumer polls for rows whose eta
#: passed every poll_interval_ms (20 ms in the app) and a worker thread takes it within
#: worker_timeout (100 ms in worker_apps), so calls may bunch by that much.
POLL_S = 0.1


@pytest.fixture
def calls(db: psycopg.Connection[Any], db_schema: str) -> sql.Composed:
    table = sql.Identifier(db_schema, "calls")
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id serial PRIMARY KEY, n int, pid int, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(table)
    )
    return sql.SQL("SELECT n, pid, extract(epoch FROM at)::float8 AS at FROM {} ORDER BY at").format(table)


@pytest.fixture
def sender(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    yield broker
    broker.close()


@pytest.fixture
def workers(database_url: str, db_schema: str) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    queue = f"rl_{uuid.uuid4().hex[:10]}"
    processes = [
        start_app(APP, DATABASE_URL=database_url, SCHEMA=db_schema, QUEUE=queue, RATE=str(RATE), BURST="1")
        for _ in range(2)
    ]
    try:
        yield queue, processes
    finally:
        for process in processes:
            stop_app(process)


def _send(broker: PostgresBroker, queue: str, numbers: range) -> None:
    task = broker.actors.get("call") or dramatiq.actor(
        lambda n: None, actor_name="call", queue_name=queue, broker=broker
    )
    with broker.transaction():
        for n in numbers:
            task.send(n)


def _busiest_second(times: list[float]) -> int:
    """The benchmark's count of the most calls in any one-second window, so both measure alike."""
    spec = importlib.util.spec_from_file_location("flow_control_benchmark", BENCHMARK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    most: int = module.busiest_second(times)
    return most


def test_two_worker_processes_share_one_limit(
    db: psycopg.Connection[Any], calls: sql.Composed, sender: PostgresBroker, workers: tuple[str, list[Any]]
) -> None:
    queue, processes = workers
    _send(sender, queue, range(60))
    rows = wait_for(
        lambda: (found := db.execute(calls).fetchall()) and len(found) >= 60 and found,
        timeout_ms=30_000,
        message="the 60 calls did not all run",
    )
    times = [row[2] for row in rows]
    assert sorted(row[0] for row in rows) == list(range(60))  # postponed, never dropped nor doubled
    assert {row[1] for row in rows} == {p.pid for p in processes}  # both processes took part
    # burst 1: a second holds at most RATE + 1 grants, and a poll's worth of late starts.
    assert _busiest_second(times) <= RATE + 1 + int(RATE * POLL_S)
    # 60 calls at 20/s take (60 - 1) / 20 seconds at least: the limit held them back.
    assert times[-1] - times[0] >= (60 - 1) / RATE - 0.05


def test_a_429_pauses_the_key_for_every_worker_until_retry_after(
    db: psycopg.Connection[Any],
    db_schema: str,
    calls: sql.Composed,
    sender: PostgresBroker,
    workers: tuple[str, list[Any]],
) -> None:
    queue, processes = workers
    _send(sender, queue, range(-1, 0))
    paused = sql.SQL(
        "SELECT extract(epoch FROM paused_until)::float8 FROM {} WHERE key = 'api:shared' AND paused_status = 429"
    ).format(sql.Identifier(db_schema, "rate_limit_buckets"))
    paused_until = wait_for(
        lambda: (row := db.execute(paused).fetchone()) and row[0], message="the 429 did not pause the key"
    )
    [(_, saw_429, failed_at)] = db.execute(calls).fetchall()
    assert 1.9 <= paused_until - failed_at <= 3.0  # Retry-After: 2 seconds, from the failure
    _send(sender, queue, range(40))
    # The process that saw the 429 stops (gracefully: what it holds goes back), so the other one,
    # which only learnt of the pause through Postgres, runs what is left.  Without this, one
    # process could take every job after the pause (consumers that poll with a backoff favour
    # the one already busy) and prove nothing about the other.
    stop_app(next(p for p in processes if p.pid == saw_429))
    rows = wait_for(
        lambda: (found := db.execute(calls).fetchall()) and len(found) >= 41 and found,
        timeout_ms=30_000,
        message="the jobs sent during the pause did not all run after it",
    )
    later = rows[1:]
    assert sorted(row[0] for row in later) == list(range(40))
    # No process called the provider before the time it asked for.
    assert min(row[2] for row in later) >= paused_until - 0.005
    # ... and the pause was fleet-wide: the process that did not see the 429 honoured it too.
    assert {row[1] for row in later} <= {p.pid for p in processes}
    assert {row[1] for row in later} - {saw_429}, "only the process that saw the 429 ran jobs after it"
