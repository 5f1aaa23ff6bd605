"""Apps share their own psycopg pool or connection with us: whatever it is set up for, jobs stay correct."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from dramatiq_reliable import Idempotency, OutboxBroker, WorkerRelay, bind, job_connection
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(params=["autocommit", "dict_row"])
def app_pool(request: pytest.FixtureRequest, database_url: str) -> Iterator[ConnectionPool[Any]]:
    """An application's pool set up its own way: autocommit connections, or rows as dicts."""
    kwargs: dict[str, Any] = {"autocommit": True} if request.param == "autocommit" else {"row_factory": dict_row}
    pool = ConnectionPool(database_url, kwargs=kwargs, min_size=1, max_size=6, open=True)
    yield pool
    pool.close()


def test_sends_and_relay_work_on_an_app_pool(app_pool, rabbitmq_url, db_schema, queue_name, rabbit):
    broker = OutboxBroker(url=rabbitmq_url, database=app_pool, schema=db_schema)
    try:
        task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
        with broker.transaction():
            task.send(1)
        with app_pool.connection() as conn, conn.transaction(), bind(conn):
            task.send(2)
        assert drain_outbox(broker) == 2
        assert sorted(body["args"][0] for body in rabbit.take_all(queue_name, expect=2)) == [1, 2]
    finally:
        broker.close()


def test_a_failed_job_is_retried_and_has_one_effect_on_an_app_pool(app_pool, rabbitmq_url, db_schema, queue_name, db):
    """On an autocommit pool the key must still commit with the job, or the retry is skipped."""
    table = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (n int)").format(table))
    broker = OutboxBroker(url=rabbitmq_url, database=app_pool, schema=db_schema)
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    runs: list[int] = []

    def pay(n: int) -> None:
        runs.append(n)
        job_connection().execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(table), (n,))
        if len(runs) == 1:
            raise ConnectionError("the provider hung up")  # after the write: it must roll back

    task = dramatiq.actor(
        pay, actor_name=f"{queue_name}_pay", queue_name=queue_name, broker=broker, min_backoff=10, max_backoff=20
    )
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        task.send(7)

        def effects() -> int:
            return int(db.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0])

        # The retry's row is visible only once its transaction committed; waiting for the retry to
        # start (len(runs) == 2) raced that commit.  A leaked first write would also commit its key,
        # so the retry would be skipped and this wait would fail.
        wait_for(
            lambda: len(runs) == 2 and effects() >= 1,
            timeout_ms=30000,
            message="the retry never committed: its key outlived the failure",
        )
        worker.join()
        row = effects()
    finally:
        worker.stop()
        broker.close()
    assert (row, runs) == (1, [7, 7])
    with app_pool.connection() as conn:
        assert conn.autocommit is (app_pool.kwargs or {}).get("autocommit", False), "the pool's setting came back"


def test_a_bad_broker_priority_is_refused_at_send(broker, queue_name, db, db_schema):
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    with pytest.raises(Exception, match=r"broker_priority=300.*0 to 255") as caught:
        task.send_with_options(broker_priority=300)
    assert type(caught.value).__name__ == "PayloadError"
    rows = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(db_schema, "outbox"))).fetchone()
    assert rows == (0,)


def test_a_row_pika_cannot_encode_fails_alone(broker, queue_name, rabbit, db, db_schema):
    """A priority written past send()'s check (an old row, a hand-made one) must not block the outbox."""
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    task.send(1)
    outbox = sql.Identifier(db_schema, "outbox")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, priority) "
            "SELECT 'bad', queue_name, actor_name, body, 300 FROM {} LIMIT 1"
        ).format(outbox, outbox)
    )
    task.send(2)
    assert drain_outbox(broker) == 2
    assert len(rabbit.take_all(queue_name, expect=2)) == 2
    failed = db.execute(
        sql.SQL("SELECT message_id, attempts, last_error FROM {} WHERE published_at IS NULL").format(outbox)
    ).fetchall()
    assert [(m, a) for m, a, _ in failed] == [("bad", 1)]
    assert "cannot publish" in failed[0][2]


def test_an_in_worker_relay_waits_for_the_schema_instead_of_dying(
    rabbitmq_url, database_url, unmigrated_schema, queue_name
):
    """A rolling deploy may start workers before the migration ran."""
    from dramatiq_reliable import migrate

    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=unmigrated_schema)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50, backoff_min_ms=20, backoff_max_ms=100))
    runs: list[int] = []
    task = dramatiq.actor(runs.append, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        relay_middleware = next(m for m in broker.middleware if isinstance(m, WorkerRelay))
        thread = relay_middleware._thread
        assert thread is not None
        migrate(database_url, schema=unmigrated_schema)
        task.send(5)
        wait_for(lambda: runs == [5], timeout_ms=20000, message="the relay never picked up after the migration")
        assert thread.is_alive()
    finally:
        worker.stop()
        broker.close()


def test_dict_row_connections_can_be_bound(database_url, broker, queue_name, db, db_schema):
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    with psycopg.connect(database_url, row_factory=dict_row) as conn, conn.transaction(), bind(conn):
        task.send()
    rows = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(db_schema, "outbox"))).fetchone()
    assert rows == (1,)
