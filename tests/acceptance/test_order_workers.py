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
from worker_apps import kill_app, start_app, stop_app

from dramatiq_reliable import DeadLetterFilter, OutboxBroker, PostgresBroker
from dramatiq_reliable.dead_letters import PostgresDeadLetterStore
from dramatiq_reliable.flow import OrderedKeys, order_waiting
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("flow_worker_app.py")


def _worker(
    database_url: str, schema: str, queue: str, *, wait_started: bool = False, **settings: str
) -> subprocess.Popen[str]:
    return start_app(APP, wait_started=wait_started, DATABASE_URL=database_url, SCHEMA=schema, QUEUE=queue, **settings)


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
    # Both consuming before the send, one thread each, 100 ms a job: a worker holds at most two
    # of the three keys' heads (its prefetch), so the other finds the third at its next poll,
    # and both run jobs however fast either boots (with 4 threads and 10 ms jobs the first
    # worker up could run all 30 before the second claimed one; it failed CI once so).
    workers: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            workers.append(_worker(database_url, db_schema, queue, wait_started=True, WORK_MS="100", THREADS="1"))
        with sender.transaction():
            for n in range(10):
                for key in ("a", "b", "c"):
                    ordered.send(key, n)

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


def _ok(rows: list[tuple[Any, ...]], key: str) -> list[int]:
    """The numbers of ``key``'s jobs that ran to the end, each once: a worker killed after its job
    returned but before the job was settled runs that job again (at least once, no Idempotency here)."""
    return list(dict.fromkeys(r[1] for r in rows if r[0] == key and r[3] == "ok"))


@pytest.mark.parametrize("kind", ["postgres", "outbox"])
def test_order_holds_when_workers_are_killed_mid_job_and_nothing_is_lost(
    kind: str,
    request: pytest.FixtureRequest,
    database_url: str,
    db_schema: str,
    db: psycopg.Connection[Any],
    runs: sql.Composed,
    sender: PostgresBroker,
) -> None:
    """SIGKILL a worker twice while keys are mid-sequence: what it had claimed (on a
    ``PostgresBroker`` its takes made at claim included; on RabbitMQ its unacked deliveries) comes
    back, and no key's next job starts before the killed one ran again; every job finishes,
    nothing stays parked."""
    keys, per_key = ("a", "b", "c"), 12
    source: PostgresBroker | OutboxBroker = sender
    settings = {"WORK_MS": "60", "FLOW_LEASE_MS": "1500", "BROKER": kind}
    if kind == "outbox":
        queue = str(request.getfixturevalue("queue_name"))
        source = OutboxBroker(url=str(request.getfixturevalue("rabbitmq_url")), database=database_url, schema=db_schema)
        source.add_middleware(OrderedKeys())
        request.addfinalizer(source.close)
    else:
        queue = f"ordk_{uuid.uuid4().hex[:10]}"
    ordered = dramatiq.actor(
        lambda key, n: None, actor_name="ordered", queue_name=queue, broker=source, order_key=lambda key, n: key
    )
    with source.transaction():
        for n in range(per_key):
            for key in keys:
                ordered.send(key, n)
    workers = [_worker(database_url, db_schema, queue, **settings) for _ in range(2)]
    kills: dict[int, Any] = {}  # pid -> the database clock just after its SIGKILL
    try:
        for target in (per_key // 3, 2 * per_key // 3):
            # At a third and at two thirds of the sequence, kill a worker that has a job mid-run.
            def running(target: int = target, live: frozenset[int] = frozenset(w.pid for w in workers)) -> int | None:
                return next(
                    (r[2] for r in db.execute(runs).fetchall() if r[2] in live and r[5] is None and r[1] >= target),
                    None,
                )

            pid = wait_for(running, timeout_ms=60_000, message=f"no job past {target} was seen mid-run")
            victim = next(w for w in workers if w.pid == pid)
            kill_app(victim)
            row = db.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            kills[victim.pid] = row[0]
            workers = [*(w for w in workers if w is not victim), _worker(database_url, db_schema, queue, **settings)]
        try:
            wait_for(
                lambda: all(_ok(db.execute(runs).fetchall(), key) == list(range(per_key)) for key in keys),
                timeout_ms=60_000,
            )
        except AssertionError:
            rows = db.execute(runs).fetchall()
            seen = {key: [(r[1], r[2], r[3]) for r in rows if r[0] == key] for key in keys}
            raise AssertionError(
                f"the keys did not all finish after the kills (killed {sorted(kills)}): runs {seen}; "
                f"waiting {order_waiting(db, schema=db_schema)}"
            ) from None
    finally:
        for process in workers:
            stop_app(process)
    rows = db.execute(runs).fetchall()
    cut = [r for r in rows if r[2] in kills and r[5] is None]
    assert cut, "no job was running when its worker was killed"
    for key in keys:
        mine = [r for r in rows if r[0] == key]
        seen = [r[1] for r in mine]
        # In send order: a killed run is run again before the next one, never after it.
        assert seen == sorted(seen), f"key {key} ran out of order: {seen}"
        assert _ok(rows, key) == list(range(per_key)), f"key {key}: {seen}"
        for before, after in itertools.pairwise(mine):
            ended = before[5] if before[5] is not None else kills[before[2]]
            assert after[4] >= ended, f"{key}{after[1]} started before {key}{before[1]} ended (or its worker died)"
    assert not order_waiting(db, schema=db_schema)
    if kind == "outbox":
        return
    left = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE queue_name = %s").format(sql.Identifier(db_schema, "queue")), (queue,)
    ).fetchone()
    assert left == (0,), "messages were left in the queue table"
