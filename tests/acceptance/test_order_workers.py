"""Order per key across worker processes: send order holds through a retry and a dead job, and a replay resumes it."""

from __future__ import annotations

import itertools
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

from dramatiq_reliable import DeadLetterFilter, PostgresBroker
from dramatiq_reliable.dead_letters import PostgresDeadLetterStore
from dramatiq_reliable.flow import OrderedKeys, order_waiting
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("flow_worker_app.py")


def _worker(database_url: str, schema: str, queue: str, **settings: str) -> subprocess.Popen[str]:
    return start_app(APP, DATABASE_URL=database_url, SCHEMA=schema, QUEUE=queue, **settings)


@pytest.fixture
def runs(db: psycopg.Connection[Any], db_schema: str) -> sql.Composed:
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id serial PRIMARY KEY, actor text, key text, n int, pid int, outcome text, "
            "started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz)"
        ).format(sql.Identifier(db_schema, "runs"))
    )
    db.execute(
        sql.SQL("CREATE TABLE {} (key text, n int, fails int, PRIMARY KEY (key, n))").format(
            sql.Identifier(db_schema, "plan")
        )
    )
    return sql.SQL("SELECT key, n, pid, outcome, started_at, finished_at FROM {} ORDER BY started_at").format(
        sql.Identifier(db_schema, "runs")
    )


@pytest.fixture
def sender(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    broker.add_middleware(OrderedKeys())
    yield broker
    broker.close()


def test_order_holds_across_two_workers_through_a_retry_and_a_dead_job_that_a_replay_releases(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], runs: sql.Composed, sender: PostgresBroker
) -> None:
    queue = f"ord_{uuid.uuid4().hex[:10]}"
    plan = sql.Identifier(db_schema, "plan")
    db.execute(sql.SQL("INSERT INTO {} VALUES ('a', 3, 1), ('b', 5, 99)").format(plan))  # a3 retried, b5 dies
    ordered = dramatiq.actor(
        lambda key, n: None, actor_name="ordered", queue_name=queue, broker=sender, order_key=lambda key, n: key
    )
    with sender.transaction():
        for n in range(10):
            for key in ("a", "b", "c"):
                ordered.send(key, n)
    workers = [_worker(database_url, db_schema, queue, WORK_MS="10") for _ in range(2)]
    try:

        def finished(key: str) -> list[int]:
            return [r[1] for r in db.execute(runs).fetchall() if r[0] == key and r[3] == "ok"]

        wait_for(
            lambda: finished("a") == list(range(10)) and finished("c") == list(range(10)),
            timeout_ms=60_000,
            message="keys a and c did not finish in order",
        )
        wait_for(
            lambda: [w["head_state"] for w in order_waiting(db, schema=db_schema)] == ["dead"],
            message="b's dead job did not park its key",
        )
        assert finished("b") == list(range(5))  # b6..b9 wait behind the dead b5
        (parked,) = order_waiting(db, schema=db_schema)
        assert (parked["key"], parked["waiting"]) == ("b", 5)
        db.execute(sql.SQL("UPDATE {} SET fails = 0").format(plan))
        PostgresDeadLetterStore.from_broker(sender).replay(where=DeadLetterFilter(), force=True)
        wait_for(lambda: finished("b") == list(range(10)), timeout_ms=30_000, message="the replay did not resume b")
    finally:
        for process in workers:
            stop_app(process)
    rows = db.execute(runs).fetchall()
    assert {r[2] for r in rows} == {w.pid for w in workers}, "both worker processes ran jobs"
    for key in ("a", "b", "c"):
        mine = [r for r in rows if r[0] == key]
        expected = sorted([*range(10), 3] if key == "a" else [*range(10), 5, 5] if key == "b" else range(10))
        assert [r[1] for r in mine] == expected, f"key {key} ran out of order: {[r[1] for r in mine]}"
        for before, after in itertools.pairwise(mine):
            assert after[4] >= before[5], f"{key}{after[1]} started before {key}{before[1]} ended"
    assert not order_waiting(db, schema=db_schema)
