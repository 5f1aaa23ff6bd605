"""Idempotency against a real Postgres and RabbitMQ: one effect per message, whatever the delivery."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.common import xq_name
from dramatiq.message import Message
from dramatiq.middleware import Callbacks
from psycopg import sql
from psycopg_pool import ConnectionPool
from support import TcpProxy

from dramatiq_reliable import OutboxBroker, WorkerRelay, events
from dramatiq_reliable.idempotency import (
    Idempotency,
    external_key,
    job_connection,
    make_purge_actor,
    purge_expired,
)
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration

PLACEMENTS = ["before_callbacks", "appended"]


@pytest.fixture
def effects(db: psycopg.Connection[Any], db_schema: str) -> str:
    """A business table of the test's own; returns its quoted name for SQL text."""
    table = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (id serial PRIMARY KEY, n int NOT NULL)").format(table))
    return table.as_string(db)


def _install(broker: OutboxBroker, placement: str = "before_callbacks", **options: Any) -> Idempotency:
    """Idempotency where the architecture puts it (before Callbacks), or appended after Retries."""
    middleware = Idempotency(**options)
    if placement == "appended":
        broker.add_middleware(middleware)
    else:
        broker.add_middleware(middleware, before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    return middleware


def _count(db: psycopg.Connection[Any], table: str, where: str = "TRUE", params: tuple[Any, ...] = ()) -> int:
    row = db.execute(f"SELECT count(*) FROM {table} WHERE {where}", params).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return int(row[0])


def _keys(db: psycopg.Connection[Any], db_schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL("SELECT actor_name, job_key, message_id FROM {} ORDER BY created_at").format(
            sql.Identifier(db_schema, "processed_jobs")
        )
    ).fetchall()


def _named(seen: list[events.Event], name: str) -> list[dict[str, Any]]:
    return [e.as_attributes() for e in seen if e.name == name]


def _waiting_on_key(db: psycopg.Connection[Any], db_schema: str) -> int:
    """Backends blocked on a row lock of this schema's processed_jobs (a duplicate waiting)."""
    return _count(
        db,
        "pg_stat_activity",
        "wait_event_type = 'Lock' AND query LIKE %s",
        (f'%"{db_schema}".processed_jobs%',),
    )


def _waiting_on_advisory(db: psycopg.Connection[Any], lock: int) -> int:
    return _count(db, "pg_locks", "locktype = 'advisory' AND NOT granted AND objid = %s", (lock,))


# -- duplicates ---------------------------------------------------------------------------------


@pytest.mark.pooler
def test_the_same_message_delivered_twice_in_a_row_has_one_effect(
    broker, queue_name, worker, db, db_schema, effects, seen
):
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def record(n: int) -> None:
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))

    worker.start()
    message = record.send(1)
    wait_for(lambda: _keys(db, db_schema), message="the first delivery never committed")
    broker.enqueue(message)  # a redelivery: same message_id, same arguments
    wait_for(lambda: _named(seen, "idempotency.duplicate"), message="the redelivery was not recognised")
    assert _count(db, effects) == 1
    assert _keys(db, db_schema) == [(record.actor_name, message.message_id, message.message_id)]
    (duplicate,) = _named(seen, "idempotency.duplicate")
    assert duplicate["first_message_id"] == message.message_id
    assert duplicate["queue_name"] == queue_name


def test_a_duplicate_delivered_while_the_first_runs_waits_for_it_then_skips(
    broker, queue_name, worker, db, db_schema, effects, seen
):
    lock = random.randrange(1, 2**31)
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def slow(n: int) -> None:
        conn = job_connection()
        conn.execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))  # held by the test: the job blocks

    db.execute("SELECT pg_advisory_lock(%s)", (lock,))
    message = slow.message(1)
    broker.enqueue(message)
    broker.enqueue(message)  # two deliveries of one message, one per worker thread
    worker.start()
    try:
        wait_for(lambda: _waiting_on_advisory(db, lock) == 1, timeout_ms=15000, message="the first run never started")
        wait_for(lambda: _waiting_on_key(db, db_schema) == 1, timeout_ms=15000, message="the duplicate did not wait")
        assert _count(db, effects) == 0  # nothing is visible before the first run commits
    finally:
        db.execute("SELECT pg_advisory_unlock(%s)", (lock,))
    wait_for(lambda: _named(seen, "idempotency.duplicate"), timeout_ms=15000, message="the duplicate was not skipped")
    assert _count(db, effects) == 1
    assert len(_keys(db, db_schema)) == 1


def test_two_sends_with_the_same_business_key_have_one_effect(broker, queue_name, worker, db, db_schema, effects, seen):
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker, idempotency_key=lambda order_id: f"invoice-{order_id}")
    def issue_invoice(order_id: int) -> None:
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (order_id,))

    worker.start()
    first = issue_invoice.send(42)
    wait_for(lambda: _keys(db, db_schema), message="the first send never ran")
    second = issue_invoice.send(42)  # a second, separate send of the same operation
    wait_for(lambda: _named(seen, "idempotency.duplicate"), message="the second send was not recognised")
    assert first.message_id != second.message_id
    assert _count(db, effects) == 1
    assert _keys(db, db_schema) == [(issue_invoice.actor_name, "invoice-42", first.message_id)]
    assert _named(seen, "idempotency.duplicate")[0]["message_id"] == second.message_id


def test_reusing_a_key_with_other_arguments_fails_the_message_loudly(
    broker, queue_name, worker, db, db_schema, effects, seen, rabbit
):
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def charge(amount: int) -> None:
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (amount,))

    worker.start()
    charge.send_with_options(args=(100,), idempotency_key="order-7")
    wait_for(lambda: _keys(db, db_schema), message="the first send never ran")
    conflicting = charge.send_with_options(args=(999,), idempotency_key="order-7")
    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, message="the conflicting message was not dead-lettered")
    assert db.execute(f"SELECT n FROM {effects}").fetchall() == [(100,)]
    (conflict,) = _named(seen, "idempotency.conflict")
    assert conflict["message_id"] == conflicting.message_id and conflict["key"] == "order-7"
    assert _named(seen, "idempotency.duplicate") == []  # not silently skipped


# -- failures and retries -----------------------------------------------------------------------


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_actor_that_raises_leaves_no_key_no_writes_no_sends_and_its_retry_runs_once(
    placement, broker, queue_name, worker, db, db_schema, effects, database_url
):
    _install(broker, placement)
    attempts: list[int] = []
    children: list[int] = []
    observed: list[tuple[int, int, int]] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, idempotency="off")
    def child(n: int) -> None:
        children.append(n)

    @dramatiq.actor(queue_name=queue_name, broker=broker, min_backoff=20, max_backoff=50)
    def flaky(n: int) -> None:
        attempts.append(n)
        if len(attempts) == 2:
            with psycopg.connect(database_url, autocommit=True) as other:
                observed.append(
                    (
                        _count(other, effects),
                        len(_keys(other, db_schema)),
                        _count(other, f'"{db_schema}".outbox', "actor_name = %s", (child.actor_name,)),
                    )
                )
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))
        child.send(n)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails after writing and sending")

    worker.start()
    message = flaky.send(5)
    wait_for(lambda: children, timeout_ms=20000, message="the retry never succeeded")
    # Between the attempts: no effect row, no key, no child message from the failed attempt.
    assert observed == [(0, 0, 0)]
    assert attempts == [5, 5] and children == [5]
    assert _count(db, effects) == 1
    assert _keys(db, db_schema) == [(flaky.actor_name, message.message_id, message.message_id)]
    # The retry was written on its own connection, outside the transaction that rolled back.
    assert (
        _count(
            db,
            f'"{db_schema}".outbox',
            "message_id = %s AND queue_name = %s AND eta IS NOT NULL",
            (message.message_id, queue_name),
        )
        == 1
    )


def test_a_pipeline_step_commits_in_the_same_transaction_as_the_key_of_the_step_before(
    broker, queue_name, worker, db, db_schema, effects
):
    # Placed before Pipelines, the next step is enqueued before the commit, into the job's
    # transaction: a crash after the commit cannot lose it (a redelivery would be skipped).
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def step(n: int, previous: int | None = None) -> int:
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))
        return n

    first, second = step.message(1), step.message(2)
    worker.start()
    dramatiq.pipeline([first, second]).run()
    wait_for(lambda: _count(db, effects) == 2, message="the pipeline never finished")
    # now() is the transaction's start time: equal timestamps mean one transaction.
    key_started = db.execute(
        sql.SQL("SELECT created_at FROM {} WHERE message_id = %s").format(sql.Identifier(db_schema, "processed_jobs")),
        (first.message_id,),
    ).fetchone()
    next_step_started = db.execute(
        sql.SQL("SELECT created_at FROM {} WHERE message_id = %s").format(sql.Identifier(db_schema, "outbox")),
        (second.message_id,),
    ).fetchone()
    assert key_started is not None and key_started == next_step_started


def test_a_worker_killed_mid_job_has_one_effect_after_redelivery(
    broker, queue_name, db, db_schema, effects, database_url, rabbitmq_url, tmp_path
):
    lock = random.randrange(1, 2**31)
    script = tmp_path / "idempotent_worker.py"
    script.write_text(WORKER_SCRIPT)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "RABBITMQ_URL": rabbitmq_url,
        "SCHEMA": db_schema,
        "QUEUE": queue_name,
        "LOCK": str(lock),
    }
    message = Message(queue_name=queue_name, actor_name="slow_effect", args=(1,), kwargs={}, options={})
    broker.enqueue(message)
    assert drain_outbox(broker) == 1
    db.execute("SELECT pg_advisory_lock(%s)", (lock,))
    first = _spawn(script, env)
    second = None
    try:
        wait_for(lambda: _waiting_on_advisory(db, lock) == 1, timeout_ms=20000, message="the job never started")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        second = _spawn(script, env)
        # The redelivered message waits on the key the dead worker's transaction still holds.
        wait_for(lambda: _waiting_on_key(db, db_schema) == 1, timeout_ms=20000, message="the redelivery never waited")
        db.execute("SELECT pg_advisory_unlock(%s)", (lock,))
        # The dead worker's backend now notices its client is gone and rolls back; the
        # redelivery claims the key and runs.
        wait_for(lambda: _keys(db, db_schema), timeout_ms=20000, message="the redelivered message never committed")
        assert _count(db, effects) == 1
        assert _keys(db, db_schema) == [("slow_effect", message.message_id, message.message_id)]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
    assert second is not None and second.returncode == 0, (tmp_path / "worker-1.log").read_text()


def test_postgres_unreachable_during_the_check_stops_the_actor_and_retries_until_it_is_back(
    database_url, broker, queue_name, worker, db, db_schema, effects, seen
):
    proxy = TcpProxy.to(database_url).start()
    pool: ConnectionPool[Any] = ConnectionPool(proxy.url, min_size=1, max_size=4, timeout=1, open=True)
    runs: list[int] = []
    try:
        _install(broker, database=pool, schema=db_schema, connection_timeout_ms=300)

        @dramatiq.actor(queue_name=queue_name, broker=broker, max_retries=200, min_backoff=50, max_backoff=200)
        def record(n: int) -> None:
            runs.append(n)
            job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))

        pool.wait(timeout=10)
        proxy.stop()  # an outage: the pooled connection is cut, new ones are refused
        worker.start()
        message = record.send(1)
        wait_for(
            lambda: len(_named(seen, "idempotency.unavailable")) >= 3,
            timeout_ms=20000,
            message="the check did not fail closed",
        )
        assert runs == []
        assert _count(db, effects) == 0
        # Each failed check was retried through the outbox (same message_id, a row due after its backoff).
        retries = _count(
            db,
            f'"{db_schema}".outbox',
            "message_id = %s AND queue_name = %s AND eta IS NOT NULL",
            (message.message_id, queue_name),
        )
        assert retries >= 2
        assert {e["message_id"] for e in _named(seen, "idempotency.unavailable")} == {message.message_id}
        proxy.start()
        wait_for(lambda: _keys(db, db_schema), timeout_ms=40000, message="the message never ran after the outage")
        assert runs == [1]
        assert _count(db, effects) == 1
    finally:
        worker.stop()
        pool.close()
        proxy.stop()


def test_an_actor_that_swallows_a_database_error_is_failed_not_acked(
    broker, queue_name, worker, db, db_schema, effects, seen, rabbit
):
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def careless() -> None:
        conn = job_connection()
        conn.execute(f"INSERT INTO {effects} (n) VALUES (1)")
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            # The transaction is now aborted: committing it would quietly roll back.
            conn.execute("SELECT 1 / 0")

    worker.start()
    careless.send()
    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, message="the message was acked away")
    assert _named(seen, "idempotency.commit_failed")
    assert _count(db, effects) == 0 and _keys(db, db_schema) == []


def test_a_job_whose_commit_failed_is_dead_lettered_with_the_reason(broker, queue_name, worker, db, db_schema, effects):
    from dramatiq_reliable import DeadLetters

    _install(broker)
    broker.add_middleware(DeadLetters())

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def careless() -> None:
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            job_connection().execute("SELECT 1 / 0")

    worker.start()
    careless.send()
    table = sql.Identifier(db_schema, "dead_letters")
    row = wait_for(
        lambda: db.execute(sql.SQL("SELECT error_type, error_message FROM {}").format(table)).fetchone(),
        message="no dead letter",
    )
    assert row[0].endswith("JobCommitFailed")
    assert "did not commit" in row[1]


def test_a_missing_table_fails_closed_and_names_the_migrate_command(
    broker, queue_name, worker, db_schema, seen, rabbit
):
    bare = f"{db_schema}_bare"  # never migrated (db_schema itself is)
    _install(broker, schema=bare)
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, max_retries=0)
    def task() -> None:
        runs.append(1)

    worker.start()
    task.send()
    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, message="the message was not failed")
    assert runs == []
    (unavailable,) = _named(seen, "idempotency.unavailable")
    assert f"dramatiq-reliable migrate --schema {bare}" in unavailable["error"]


# -- record mode --------------------------------------------------------------------------------


def test_record_mode_records_after_success_and_skips_a_later_duplicate(
    broker, queue_name, worker, db, db_schema, seen, database_url
):
    _install(broker)
    calls: list[str] = []
    keys_during_retry: list[int] = []

    @dramatiq.actor(
        queue_name=queue_name,
        broker=broker,
        idempotency="record",
        idempotency_key=lambda order_id: f"order-{order_id}",
        min_backoff=20,
        max_backoff=50,
    )
    def charge(order_id: int) -> None:
        calls.append(external_key("charge"))  # what we would send to the payment provider
        if len(calls) == 1:
            raise TimeoutError("provider timed out")
        with psycopg.connect(database_url, autocommit=True) as other:
            keys_during_retry.append(len(_keys(other, db_schema)))

    worker.start()
    first = charge.send(8812)
    wait_for(lambda: _keys(db, db_schema), timeout_ms=20000, message="the key was never recorded")
    charge.send(8812)
    wait_for(lambda: _named(seen, "idempotency.duplicate"), message="the duplicate was not skipped")
    assert len(calls) == 2 and calls[0] == calls[1], "the external key must be the same on every attempt"
    assert keys_during_retry == [0], "a failed attempt must not record the key"
    assert _keys(db, db_schema) == [(charge.actor_name, "order-8812", first.message_id)]
    assert _named(seen, "idempotency.duplicate")[0]["mode"] == "record"


def test_record_mode_under_a_busy_worker_records_each_message_once_and_acks_it(broker, queue_name, db, db_schema, seen):
    _install(broker)
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, idempotency="record")
    def notify(n: int) -> None:
        runs.append(n)

    messages = [notify.send(n) for n in range(120)]
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=8)
    worker.start()
    try:
        wait_for(lambda: len(_keys(db, db_schema)) == 120, timeout_ms=30000, message="not every key was recorded")
        broker.join(queue_name, timeout=10_000)
    finally:
        worker.stop()
    assert sorted(runs) == list(range(120))
    assert sorted(row[1] for row in _keys(db, db_schema)) == sorted(m.message_id for m in messages)
    assert not _named(seen, "idempotency.record_failed")


# -- retention ----------------------------------------------------------------------------------


def test_an_expired_key_no_longer_dedupes_and_the_purge_deletes_only_expired_keys(
    broker, queue_name, worker, db, db_schema, effects
):
    _install(broker)

    @dramatiq.actor(queue_name=queue_name, broker=broker)
    def record(n: int) -> None:
        job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))

    worker.start()
    old = record.send(1)
    kept = record.send(2)
    wait_for(lambda: len(_keys(db, db_schema)) == 2, message="the jobs never ran")
    table = sql.Identifier(db_schema, "processed_jobs")
    db.execute(
        sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second' WHERE job_key = %s").format(table),
        (old.message_id,),
    )
    broker.enqueue(old)  # past retention, a redelivery runs again
    wait_for(lambda: _count(db, effects) == 3, message="the expired key still deduped")
    assert {row[1] for row in _keys(db, db_schema)} == {old.message_id, kept.message_id}

    db.execute(
        sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second' WHERE job_key = %s").format(table),
        (old.message_id,),
    )
    db.execute(
        sql.SQL(
            "INSERT INTO {} (actor_name, job_key, payload_hash, message_id, expires_at) "
            "SELECT 'a', 'k' || i, '\\x00', 'm', now() - interval '1 day' FROM generate_series(1, 5) i"
        ).format(table)
    )
    assert purge_expired(broker.database, schema=db_schema, batch_size=2) == 6
    assert [row[1] for row in _keys(db, db_schema)] == [kept.message_id]
    purge = make_purge_actor(broker, queue_name=queue_name)
    assert purge.options["idempotency"] == "off"
    assert purge() == 0


WORKER_SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import threading

    import dramatiq
    from dramatiq.middleware import Callbacks

    from dramatiq_reliable import OutboxBroker
    from dramatiq_reliable import Idempotency, job_connection

    schema = os.environ["SCHEMA"]
    broker = OutboxBroker(url=os.environ["RABBITMQ_URL"], database=os.environ["DATABASE_URL"], schema=schema)
    broker.add_middleware(Idempotency(), before=Callbacks)


    @dramatiq.actor(broker=broker, queue_name=os.environ["QUEUE"], actor_name="slow_effect")
    def slow_effect(n):
        conn = job_connection()
        conn.execute(f'INSERT INTO "{schema}".effects (n) VALUES (%s)', (n,))
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (int(os.environ["LOCK"]),))


    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    stop.wait()
    worker.stop()
    broker.close()
    """
)


def _spawn(script: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # The child holds its own copy of the log's descriptor: ours is closed once it started.
    with (script.parent / f"worker-{len(list(script.parent.glob('worker-*.log')))}.log").open("wb") as log:
        return subprocess.Popen([sys.executable, str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)
