"""Concurrency per key against real Postgres: at most N runs of a key at once, a full key's jobs parked."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Callbacks, SkipMessage
from psycopg import sql

from dramatiq_reliable import PostgresBroker
from dramatiq_reliable.flow import ConcurrencyLimit, concurrency_waiting
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def limited(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(database=database_url, schema=db_schema, lease_ms=2000)
    broker.add_middleware(ConcurrencyLimit(lease_ms=1000), before=Callbacks)
    yield broker
    broker.close()


def _count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()
    return int(row[0]) if row else -1


def test_no_more_than_the_limit_of_a_key_run_at_once_and_every_parked_job_runs(
    limited: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    done: list[tuple[str, int]] = []
    lock = threading.Lock()
    gate = threading.Event()

    @dramatiq.actor(
        queue_name="limited", broker=limited, concurrency_limit=2, concurrency_limit_key=lambda tenant, n: tenant
    )
    def export(tenant: str, n: int) -> None:
        with lock:
            running[tenant] = running.get(tenant, 0) + 1
            peak[tenant] = max(peak.get(tenant, 0), running[tenant])
        gate.wait(10)
        time.sleep(0.01)
        with lock:
            running[tenant] -= 1
            done.append((tenant, n))

    with limited.transaction():
        for n in range(6):
            export.send("big", n)
        export.send("small", 0)
    worker = dramatiq.Worker(limited, worker_timeout=50, worker_threads=6)
    worker.start()
    try:
        # The two slots of "big" are taken and its four other jobs parked; "small" runs beside them.
        wait_for(lambda: _count(db, db_schema, "concurrency_parked") == 4, message="big's extra jobs were not parked")
        wait_for(lambda: running.get("small") == 1, message="the other key's job was held up")
        (waiting,) = concurrency_waiting(db, schema=db_schema)
        assert (waiting["key"], waiting["parked"], waiting["running"]) == ("big", 4, 2)
        gate.set()
        wait_for(lambda: len(done) == 7, timeout_ms=20_000, message=lambda: f"not every job ran: {done}")
    finally:
        worker.stop()
    assert peak == {"big": 2, "small": 1}
    assert sorted(n for t, n in done if t == "big") == list(range(6))
    assert _count(db, db_schema, "concurrency_slots") == 0
    assert _count(db, db_schema, "concurrency_parked") == 0


def test_a_key_function_that_raises_fails_closed_the_job_does_not_run(
    limited: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[Any] = []

    @dramatiq.actor(
        queue_name="limited", broker=limited, concurrency_limit=1, concurrency_limit_key=lambda job: job["tenant"]
    )
    def export(job: Any) -> None:
        runs.append(job)

    export.send({"tenant": 5})  # a key that is no string
    export.send({"tenant": "t"})
    worker = dramatiq.Worker(limited, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: runs == [{"tenant": "t"}], message="the job with a good key did not run")
        dead = sql.SQL("SELECT count(*) FROM {} WHERE queue_name = 'limited.XQ'").format(
            sql.Identifier(db_schema, "queue")
        )
        wait_for(lambda: db.execute(dead).fetchone() == (1,), message="the bad key's message was not failed")
    finally:
        worker.stop()
    assert _count(db, db_schema, "concurrency_slots") == 0


def test_a_parked_job_is_woken_with_its_priority(
    limited: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    middleware = next(m for m in limited.middleware if isinstance(m, ConcurrencyLimit))
    export = dramatiq.actor(
        lambda n: None,
        actor_name="export",
        queue_name="limited",
        broker=limited,
        concurrency_limit=1,
        concurrency_limit_key=lambda n: "tenant",
    )
    running = MessageProxy(export.send(0))
    urgent = MessageProxy(export.send_with_options(args=(1,), broker_priority=9))
    queue = sql.Identifier(db_schema, "queue")
    db.execute(sql.SQL("DELETE FROM {}").format(queue))  # both delivered (and acked)
    middleware.before_process_message(limited, running)
    with pytest.raises(SkipMessage, match="parked"):  # on another worker thread: a context of its own
        contextvars.copy_context().run(middleware.before_process_message, limited, urgent)
    middleware.after_process_message(limited, running, result=None)
    woken = db.execute(sql.SQL("SELECT message_id, priority FROM {}").format(queue)).fetchall()
    assert woken == [(urgent.message_id, 9)], "the woken job lost its priority"
