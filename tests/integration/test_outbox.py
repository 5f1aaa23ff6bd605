"""The outbox broker and relay against a real Postgres and RabbitMQ."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.common import dq_name, xq_name
from support import Rabbit, TcpProxy, running

from dramatiq_reliable import (
    NotBound,
    OutboxBroker,
    PayloadError,
    Relay,
    SchemaNotReady,
    WorkerRelay,
    bind,
    events,
    schema,
)
from dramatiq_reliable.errors import BrokerUnavailable
from dramatiq_reliable.outbox import wake, wake_relays
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


def _actor(broker: OutboxBroker, queue_name: str, fn: Any = None, **options: Any) -> dramatiq.Actor[Any, Any]:
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    return dramatiq.actor(fn or noop, actor_name=f"{queue_name}_actor", queue_name=queue_name, broker=broker, **options)


def _rows(db: psycopg.Connection[Any], db_schema: str, where: str = "TRUE") -> list[tuple[Any, ...]]:
    return db.execute(
        psycopg.sql.SQL(
            "SELECT message_id, queue_name, attempts, last_error, published_at FROM {}.outbox WHERE "
            + where
            + " ORDER BY id"
        ).format(psycopg.sql.Identifier(db_schema))
    ).fetchall()


@pytest.mark.pooler
def test_commit_delivers_exactly_one_message_per_send(broker, queue_name, rabbit, db, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction():
        sent = [task.send(i) for i in range(25)]
    assert drain_outbox(broker) == 25
    bodies = rabbit.take_all(queue_name, expect=25)
    assert sorted(b["message_id"] for b in bodies) == sorted(m.message_id for m in sent)
    assert sorted(b["args"][0] for b in bodies) == list(range(25))
    assert all(row[4] is not None for row in _rows(db, db_schema))


def test_rollback_delivers_nothing(broker, queue_name, rabbit, db, db_schema):
    task = _actor(broker, queue_name)
    with pytest.raises(RuntimeError, match="boom"), broker.transaction():
        task.send(1)
        raise RuntimeError("boom")
    assert _rows(db, db_schema) == []
    assert drain_outbox(broker) == 0
    assert rabbit.count(queue_name) == 0


@pytest.mark.pooler
def test_send_on_an_app_connection_commits_with_the_app_writes(broker, queue_name, database_url, db, db_schema):
    task = _actor(broker, queue_name)
    with psycopg.connect(database_url) as conn:
        conn.execute("CREATE TEMP TABLE orders (id int) ON COMMIT DROP")
        with bind(conn):
            conn.execute("INSERT INTO orders VALUES (1)")
            task.send(1)
            # Not visible to anyone else before the app commits.
            assert _rows(db, db_schema) == []
        conn.commit()
    assert len(_rows(db, db_schema)) == 1


def test_groups_and_pipelines_go_through_the_outbox(broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction():
        dramatiq.group([task.message(1), task.message(2)]).run()
        dramatiq.pipeline([task.message(3), task.message(4)]).run()
        task.send_with_options(args=(5,), delay=10)
    assert len(_rows(db, db_schema)) == 4  # a pipeline enqueues its first message only


def test_unbound_send_commits_on_its_own_by_default(broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    message = task.send(7)
    assert [row[0] for row in _rows(db, db_schema)] == [message.message_id]


def test_unbound_send_is_refused_when_configured(rabbitmq_url, database_url, db_schema, queue_name, db):
    strict = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, on_unbound="error")
    try:
        task = _actor(strict, queue_name)
        with pytest.raises(NotBound, match=r"broker\.transaction\(\)"):
            task.send(1)
        assert _rows(db, db_schema) == []
    finally:
        strict.close()


def test_unencodable_payload_fails_at_send_and_leaves_the_transaction_usable(broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction() as conn:
        with pytest.raises(PayloadError, match="cannot be encoded.*JSON-serialisable"):
            task.send(object())
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
        task.send(1)
    assert len(_rows(db, db_schema)) == 1


def test_large_payload_warns(broker, queue_name, caplog):
    task = _actor(broker, queue_name)
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.outbox"):
        task.send("x" * (broker.max_payload_bytes + 1))
    assert "payloads should carry IDs" in caplog.text


def test_missing_schema_names_the_migrate_command(rabbitmq_url, database_url, unmigrated_schema, queue_name):
    bare = OutboxBroker(url=rabbitmq_url, database=database_url, schema=unmigrated_schema)
    try:
        task = _actor(bare, queue_name)
        with pytest.raises(SchemaNotReady, match=f"dramatiq-reliable migrate --schema {unmigrated_schema}"):
            task.send(1)
        # Inside the caller's transaction the check does not poison it.
        with bare.transaction() as conn:
            with pytest.raises(SchemaNotReady):
                task.send(1)
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        bare.close()


def test_a_delayed_message_waits_in_the_outbox_and_reaches_its_queue_without_an_eta(broker, queue_name, rabbit, db):
    task = _actor(broker, queue_name)
    message = task.send_with_options(args=(1,), delay=60_000)
    # send() still returns Dramatiq's delayed message; the row is what waits.
    assert message.queue_name == dq_name(queue_name) and "eta" in message.options
    assert drain_outbox(broker) == 0, "a row not yet due is not published"
    assert rabbit.count(dq_name(queue_name)) == 0 and rabbit.count(queue_name) == 0
    # Due now: the relay publishes it to the queue itself, where a worker runs it at once.
    db.execute(
        psycopg.sql.SQL("UPDATE {}.outbox SET available_at = now()").format(psycopg.sql.Identifier(broker.schema))
    )
    assert drain_outbox(broker) == 1
    (body,) = rabbit.take_all(queue_name, expect=1)
    assert body["message_id"] == message.message_id and body["queue_name"] == queue_name
    assert "eta" not in body["options"]
    assert rabbit.count(dq_name(queue_name)) == 0


def test_worker_runs_delayed_message_not_before_its_eta(broker, queue_name, worker):
    runs: list[float] = []
    task = _actor(broker, queue_name, fn=lambda: runs.append(time.time()))
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    worker.start()
    sent_at = time.time()
    task.send_with_options(delay=1500)
    wait_for(lambda: runs, timeout_ms=20000, message="the delayed message never ran")
    assert runs[0] - sent_at >= 1.5


def test_retry_enqueued_inside_a_worker_goes_through_the_outbox(broker, queue_name, worker, db, db_schema):
    attempts: list[int] = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")

    task = _actor(broker, queue_name, fn=flaky, min_backoff=10, max_backoff=20)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    worker.start()
    message = task.send()
    wait_for(lambda: len(attempts) == 2, timeout_ms=20000, message="the retry never ran")
    rows = _rows(db, db_schema)
    # The original send and its retry, with the same message_id; the retry waited in the outbox
    # for its backoff and went to the queue itself, never through the delay queue.
    assert [row[0] for row in rows] == [message.message_id, message.message_id]
    assert rows[1][1] == queue_name


def test_two_relays_in_parallel_publish_every_row_once(broker, queue_name, rabbit, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction():
        sent = [task.send(i) for i in range(3000)]
    ids = {m.message_id for m in sent}
    relays = [Relay.from_broker(broker, batch_size=100) for _ in range(2)]
    counts: list[int] = []
    threads = [threading.Thread(target=lambda r=r: counts.append(r.drain())) for r in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for relay in relays:
        relay.publisher.close()
    assert sum(counts) == 3000
    assert all(count > 0 for count in counts), f"one relay did all the work: {counts}"
    bodies = rabbit.take_all(queue_name, expect=3000)
    assert len(bodies) == 3000
    assert {b["message_id"] for b in bodies} == ids


def test_rabbitmq_unreachable_then_back_delivers_everything(broker, queue_name, rabbit, db, db_schema, rabbitmq_url):
    task = _actor(broker, queue_name)
    with broker.transaction():
        sent = [task.send(i) for i in range(200)]
    proxy = TcpProxy.to(rabbitmq_url, connection_attempts="1")  # not started yet: a closed port
    url = proxy.url
    relay = Relay(
        rabbitmq_url=url,
        database=broker.database,
        schema=db_schema,
        poll_interval_ms=50,
        backoff_min_ms=20,
        backoff_max_ms=100,
    )
    with pytest.raises(BrokerUnavailable):
        relay.drain_once()
    outages: list[events.Event] = []
    events.subscribe(outages.append)
    with running(relay.run, relay.stop):
        wait_for(
            lambda: len([e for e in outages if e.name == "outbox.broker_unavailable"]) >= 3,
            message="the relay did not back off against the closed port",
        )
        events.unsubscribe(outages.append)
        rows = _rows(db, db_schema)
        assert all(row[2] == 0 and row[4] is None for row in rows), "an outage must not burn attempts"
        proxy.start()
        try:
            wait_for(lambda: rabbit.count(queue_name) >= 200, timeout_ms=30000, message="backlog not drained")
        finally:
            relay.stop()
    proxy.stop()
    assert {b["message_id"] for b in rabbit.take_all(queue_name, expect=200)} == {m.message_id for m in sent}


def test_a_poison_row_records_its_error_and_does_not_block_the_others(broker, queue_name, rabbit, db, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction() as conn:
        task.send(1)
        conn.execute(
            psycopg.sql.SQL(
                "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body) VALUES ('poison', %s, 'x', '{{}}')"
            ).format(psycopg.sql.Identifier(db_schema)),
            ("x" * 300,),
        )
        task.send(2)
    assert drain_outbox(broker) == 2
    assert rabbit.count(queue_name) == 2
    (poison,) = _rows(db, db_schema, "published_at IS NULL")
    assert poison[0] == "poison" and poison[2] == 1 and "cannot declare queue" in poison[3]
    # It backs off instead of being claimed again at once.
    assert drain_outbox(broker) == 0
    assert _rows(db, db_schema, "published_at IS NULL")[0][2] == 1


def test_relay_listens_again_after_a_dropped_connection_and_hears_wake_ups(
    broker, queue_name, rabbit, db, monkeypatch, listen_url
):
    # Idle sleeps of 5-10 minutes: only an explicit wake-up delivers within the timeouts below.
    monkeypatch.setattr(wake, "FIRST_IDLE_S", 600.0)
    task = _actor(broker, queue_name)
    relay = Relay.from_broker(broker, poll_interval_ms=600_000, listen_database=listen_url)
    with running(relay.run, relay.stop):
        wait_for(lambda: relay._listener is not None, message="relay never listened")
        pid = relay._listener.info.backend_pid
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # The relay notices on its next wait slice, backs off and listens again on a new connection.
        wait_for(
            lambda: (
                relay._listener is not None and relay._listener.info.backend_pid != pid and not relay._listener.closed
            ),
            timeout_ms=15000,
            message="relay did not listen again",
        )
        wait_for(lambda: (relay._sleeping_s or 0) > 60, message="relay never went back to sleep")
        with broker.transaction() as conn:
            task.send(2)
            wake_relays(conn, schema=broker.schema)
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10000, message="no wake-up after re-listening")


def test_purge_deletes_published_rows_past_retention_only(broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    for i in range(3):
        task.send(i)
    drain_outbox(broker)
    task.send(99)  # unpublished: never purged
    table = psycopg.sql.Identifier(db_schema, "outbox")
    db.execute(
        psycopg.sql.SQL(
            "UPDATE {} SET published_at = now() - interval '2 days' WHERE id = (SELECT min(id) FROM {})"
        ).format(table, table)
    )
    relay = Relay.from_broker(broker, retention_ms=86_400_000)
    assert relay.purge() == 1
    assert len(_rows(db, db_schema)) == 3
    relay.publisher.close()


def test_delete_mode_removes_rows_once_confirmed(broker, queue_name, rabbit, db, db_schema):
    task = _actor(broker, queue_name)
    for i in range(5):
        task.send(i)
    assert drain_outbox(broker, on_published="delete") == 5
    assert _rows(db, db_schema) == []
    assert rabbit.count(queue_name) == 5


@pytest.mark.pooler
def test_concurrent_migrations_apply_each_version_once(database_url, unmigrated_schema):
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(schema.migrate(database_url, schema=unmigrated_schema))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results, key=len) == [[], [], [], [m.version for m in schema.migrations()]]


def test_migration_sql_applied_by_hand_equals_migrate(database_url, unmigrated_schema):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(schema.migration_sql(schema=unmigrated_schema))
        assert schema.current_version(conn, schema=unmigrated_schema) == schema.LATEST_VERSION
    assert schema.migrate(database_url, schema=unmigrated_schema) == []


def test_rabbit_reader_sees_nothing_for_an_unknown_queue(rabbit: Rabbit) -> None:
    assert rabbit.count("q_does_not_exist_anywhere") == 0


def test_a_retry_that_cannot_be_written_is_dead_lettered_in_rabbitmq_not_acked_away(
    database_url, rabbitmq_url, db_schema, queue_name, rabbit
):
    proxy = TcpProxy.to(database_url, connect_timeout="2").start()
    broker = OutboxBroker(url=rabbitmq_url, database=proxy.url, schema=db_schema, worker_write_timeout_ms=300)

    def fails_while_postgres_is_away() -> None:
        proxy.stop()  # Postgres becomes unreachable before Dramatiq enqueues the retry
        raise RuntimeError("transient failure")

    task = _actor(broker, queue_name, fn=fails_while_postgres_is_away, min_backoff=10, max_backoff=20)
    message = task.send()
    assert drain_outbox(broker) == 1
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        (dead,) = wait_for(
            lambda: rabbit.take_all(xq_name(queue_name)), timeout_ms=30000, message="retry was acked away"
        )
    finally:
        worker.stop()
        broker.close()
        proxy.stop()
    assert dead["message_id"] == message.message_id


def test_middleware_hear_about_a_failed_outbox_insert(rabbitmq_url, database_url, unmigrated_schema, queue_name):
    seen: list[tuple[str, str]] = []

    class Recorder(dramatiq.Middleware):
        def before_enqueue(self, broker, message, delay):
            seen.append(("before", message.message_id))

        def after_enqueue(self, broker, message, delay):
            seen.append(("after", message.message_id))

        def after_enqueue_failed(self, broker, message, delay, *, exception):
            seen.append((type(exception).__name__, message.message_id))

    bare = OutboxBroker(url=rabbitmq_url, database=database_url, schema=unmigrated_schema)
    bare.add_middleware(Recorder())
    try:
        task = _actor(bare, queue_name)
        with pytest.raises(SchemaNotReady):
            message = task.message()
            bare.enqueue(message)
    finally:
        bare.close()
    assert seen == [("before", message.message_id), ("SchemaNotReady", message.message_id)]
