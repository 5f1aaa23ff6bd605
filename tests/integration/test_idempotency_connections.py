"""Idempotency's own Postgres statements against a real server: stale pooled sockets and hostile input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.common import xq_name
from dramatiq.middleware import Callbacks
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool
from support import TcpProxy

from dramatiq_reliable import WorkerRelay, events
from dramatiq_reliable.idempotency import Idempotency, job_connection
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def seen() -> Iterator[list[events.Event]]:
    received: list[events.Event] = []
    events.subscribe(received.append)
    yield received
    events.unsubscribe(received.append)


@pytest.fixture
def effects(db: psycopg.Connection[Any], db_schema: str) -> str:
    table = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (id serial PRIMARY KEY, s text NOT NULL)").format(table))
    return table.as_string(db)


def _names(seen: list[events.Event]) -> list[str]:
    return [e.name for e in seen if e.name.startswith(("idempotency.", "retry."))]


@pytest.mark.parametrize("mode", ["transactional", "record"])
def test_connections_a_cut_left_in_the_pool_are_replaced_without_failing_the_job(
    broker, queue_name, worker, db, db_schema, database_url, effects, seen, rabbit, mode
):
    params = conninfo_to_dict(database_url)
    proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)).start()
    pool: ConnectionPool[Any] = ConnectionPool(
        make_conninfo(database_url, host="127.0.0.1", port=str(proxy.port)), min_size=3, max_size=4, open=True
    )
    runs: list[int] = []
    try:
        broker.add_middleware(Idempotency(database=pool, schema=db_schema, default_mode=mode), before=Callbacks)
        broker.add_middleware(WorkerRelay(poll_interval_ms=50))

        # max_retries=0: a check that failed on a stale socket would dead-letter the message.
        @dramatiq.actor(queue_name=queue_name, broker=broker, max_retries=0)
        def task(n: int) -> None:
            runs.append(n)

        pool.wait(timeout=10)
        proxy.stop()  # a blip: every pooled socket is reset ...
        proxy.start()  # ... and the server is back at once
        worker.start()
        task.send(1)
        keys = sql.Identifier(db_schema, "processed_jobs")
        wait_for(
            lambda: db.execute(sql.SQL("SELECT 1 FROM {}").format(keys)).fetchone(),
            timeout_ms=20_000,
            message="the key was never stored",
        )
        assert runs == [1]
        assert "idempotency.unavailable" not in _names(seen)
        assert "idempotency.record_failed" not in _names(seen)
        assert rabbit.count(xq_name(queue_name)) == 0
    finally:
        worker.stop()
        pool.close()
        proxy.stop()


def test_an_argument_with_a_lone_surrogate_is_protected_and_a_duplicate_delivery_is_skipped(
    broker, queue_name, worker, db, db_schema, effects, seen
):
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    runs: list[str] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def record(s: str) -> None:
        runs.append(s)
        job_connection().execute(f"INSERT INTO {effects} (s) VALUES (%s)", (s.encode("unicode_escape").decode(),))

    worker.start()
    message = record.send("\ud800x")
    wait_for(lambda: runs, message="the first delivery never ran")
    broker.enqueue(message)  # a redelivery
    wait_for(lambda: "idempotency.duplicate" in _names(seen), message="the redelivery was not recognised")
    assert runs == ["\ud800x"]
    assert db.execute(f"SELECT s FROM {effects}").fetchall() == [("\\ud800x",)]  # type: ignore[call-overload]
