"""PostgresBroker against a real Postgres: sends in the caller's transaction, Dramatiq's broker
expectations (join, flush, declared queues, groups, pipelines, Worker), leases, and our middleware."""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.errors import QueueJoinTimeout, QueueNotFound

from dramatiq_reliable import (
    ClassifiedRetries,
    ConfigurationError,
    DeadLetters,
    Idempotency,
    NotBound,
    PayloadError,
    PostgresBroker,
    PostgresDeadLetterStore,
    SchemaNotReady,
    bind,
    build_middleware,
    job_connection,
    schema,
)
from dramatiq_reliable.postgres import queue as queue_sql
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def qname() -> str:
    return f"pq_{uuid.uuid4().hex[:10]}"


def make_broker(database_url: str, db_schema: str, **options: Any) -> PostgresBroker:
    options.setdefault(
        "middleware", build_middleware(retries=ClassifiedRetries(max_retries=3, min_backoff=10, max_backoff=50))
    )
    broker = PostgresBroker(database=database_url, schema=db_schema, **options)
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def pg_broker(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = make_broker(database_url, db_schema, lease_ms=1500)
    yield broker
    broker.close()


@pytest.fixture
def pg_worker(pg_broker: PostgresBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(pg_broker, worker_timeout=100, worker_threads=2)
    yield worker
    worker.stop()


def rows(db: psycopg.Connection[Any], schema: str, queue_name: str) -> list[tuple[Any, ...]]:
    return db.execute(
        psycopg.sql.SQL(
            "SELECT queue_name, message_id, priority, available_at > now(), lease FROM {} WHERE queue_name LIKE %s ORDER BY id"
        ).format(psycopg.sql.Identifier(schema, "queue")),
        (queue_name + "%",),
    ).fetchall()


@pytest.mark.pooler
def test_a_send_in_a_transaction_exists_only_if_it_commits(pg_broker: PostgresBroker, qname: str, db: Any) -> None:
    @dramatiq.actor(queue_name=qname)
    def job(n: int) -> None: ...

    with pytest.raises(RuntimeError), pg_broker.transaction():
        job.send(1)
        raise RuntimeError("roll back")
    assert rows(db, pg_broker.schema, qname) == []
    with pg_broker.transaction() as conn:
        message = job.send(2)
        assert rows(db, pg_broker.schema, qname) == []  # not visible before the commit
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert [r[1] for r in rows(db, pg_broker.schema, qname)] == [message.message_id]


def test_bind_puts_the_row_in_the_callers_own_transaction(
    pg_broker: PostgresBroker, database_url: str, qname: str, db: Any
) -> None:
    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    with psycopg.connect(database_url) as conn:
        with bind(conn):
            job.send()
        conn.rollback()
        assert rows(db, pg_broker.schema, qname) == []
        with bind(conn):
            job.send()
        conn.commit()
    assert len(rows(db, pg_broker.schema, qname)) == 1


def test_on_unbound_error_refuses_a_send_outside_a_transaction(database_url: str, db_schema: str, qname: str) -> None:
    broker = make_broker(database_url, db_schema, on_unbound="error")
    try:

        @dramatiq.actor(queue_name=qname, broker=broker)
        def job() -> None: ...

        with pytest.raises(NotBound, match="broker.transaction"):
            job.send()
        with broker.transaction():
            job.send()
    finally:
        broker.close()


def test_delay_priority_message_id_and_options_are_kept(pg_broker: PostgresBroker, qname: str, db: Any) -> None:
    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    delayed = job.send_with_options(delay=60_000, custom="x")
    high = job.send_with_options(broker_priority=9)
    assert delayed.queue_name == f"{qname}.DQ" and "eta" in delayed.options
    by_id = {r[1]: r for r in rows(db, pg_broker.schema, qname)}
    assert by_id[delayed.message_id][0] == qname and by_id[delayed.message_id][3] is True
    assert by_id[high.message_id][2] == 9

    low = job.send()
    consumer = pg_broker.consume(qname, prefetch=5, timeout=200)
    try:
        first, second = next(consumer), next(consumer)
        assert (first.message_id, second.message_id) == (high.message_id, low.message_id)
        assert next(consumer) is None  # the delayed one is not due
        assert first.options["broker_priority"] == 9 and first.queue_name == qname
        consumer.requeue([first, second])
    finally:
        consumer.close()
    with pytest.raises(PayloadError, match="broker_priority"):
        job.send_with_options(broker_priority=300)


def test_a_delayed_message_runs_after_its_delay_not_before(
    pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str
) -> None:
    ran: list[float] = []

    @dramatiq.actor(queue_name=qname)
    def job() -> None:
        ran.append(time.monotonic())

    pg_worker.start()
    sent = time.monotonic()
    job.send_with_options(delay=700)
    pg_broker.join(qname, timeout=10_000)
    assert len(ran) == 1 and ran[0] - sent >= 0.69


def test_worker_join_flush_and_declared_queues(
    pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str, db: Any
) -> None:
    done: list[int] = []

    @dramatiq.actor(queue_name=qname)
    def job(n: int) -> None:
        done.append(n)

    assert qname in pg_broker.get_declared_queues()
    assert pg_broker.get_declared_delay_queues() == set()
    for n in range(20):
        job.send(n)
    pg_worker.start()
    pg_broker.join(qname, timeout=10_000)
    pg_worker.join()
    assert sorted(done) == list(range(20))
    assert rows(db, pg_broker.schema, qname) == []

    pg_worker.pause()
    job.send(99)
    job.send_with_options(args=(100,), delay=60_000)
    with pytest.raises(QueueJoinTimeout):
        pg_broker.join(qname, timeout=200)
    pg_broker.flush(qname)
    assert rows(db, pg_broker.schema, qname) == []
    job.send(101)
    pg_broker.flush_all()
    assert rows(db, pg_broker.schema, qname) == []
    with pytest.raises(QueueNotFound):
        pg_broker.join("never_declared")


@pytest.mark.pooler
def test_pipelines_and_groups_run(pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str) -> None:
    seen: list[Any] = []

    @dramatiq.actor(queue_name=qname)
    def add(a: int, b: int) -> int:
        return a + b

    @dramatiq.actor(queue_name=qname)
    def record(value: int) -> None:
        seen.append(value)

    pg_worker.start()
    (add.message(1, 2) | add.message(10) | record.message()).run()
    dramatiq.group([record.message(n) for n in (7, 8, 9)]).run()
    deadline = time.monotonic() + 10
    while len(seen) < 4 and time.monotonic() < deadline:
        pg_broker.join(qname, timeout=10_000)
    assert sorted(seen) == [7, 8, 9, 13]


def test_a_retry_waits_in_postgres_and_the_job_runs_again(
    pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str
) -> None:
    attempts: list[int] = []

    @dramatiq.actor(queue_name=qname)
    def flaky() -> None:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionResetError("try again")

    pg_worker.start()
    flaky.send()
    pg_broker.join(qname, timeout=10_000)
    assert len(attempts) == 3


def test_a_held_message_comes_back_after_its_lease_and_a_heartbeat_keeps_it(
    pg_broker: PostgresBroker, qname: str
) -> None:
    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    sent = job.send()
    holder = pg_broker.consume(qname, prefetch=1, timeout=100)
    taken = next(holder)
    assert taken is not None and taken.message_id == sent.message_id
    other = pg_broker.consume(qname, prefetch=1, timeout=100)
    # The heartbeat (every lease/3) keeps it hidden well past the lease.
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert next(other) is None
    # A holder that stops beating (a dead process) loses it once the lease runs out.
    pg_broker.leases.forget(taken.row_id)
    deadline = time.monotonic() + 5
    again = None
    while again is None and time.monotonic() < deadline:
        again = next(other)
    assert again is not None and again.message_id == sent.message_id and again.deliveries == 2
    # The first holder's late ack changes nothing: the row belongs to the new lease.
    holder.ack(taken)
    pg_broker.leases.flush()
    with pg_broker.database.connection() as conn:
        assert queue_sql.pending(conn, pg_broker.schema, qname) == 1
    other.ack(again)
    pg_broker.join(qname, timeout=5000)
    holder.close()
    other.close()


@pytest.mark.pooler
def test_a_failed_message_lands_in_dead_letters_and_replays_onto_the_queue(
    database_url: str, db_schema: str, qname: str, db: Any
) -> None:
    broker = make_broker(
        database_url,
        db_schema,
        middleware=build_middleware(middleware=[DeadLetters()], retries=ClassifiedRetries(max_retries=0)),
    )
    calls: list[int] = []
    try:

        @dramatiq.actor(queue_name=qname, broker=broker)
        def broken(n: int) -> None:
            calls.append(n)
            if len(calls) == 1:
                raise ValueError("bad")

        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        worker.start()
        try:
            broken.send(5)
            broker.join(qname, timeout=10_000)
            assert rows(db, db_schema, qname) == []  # stored in dead_letters, so no .XQ row
            store = PostgresDeadLetterStore.from_broker(broker)
            assert store.replay_to == "queue"
            (dead,) = store.list().items
            result = store.replay(ids=[dead.id])
            assert result.replayed == 1
            broker.join(qname, timeout=10_000)
            assert calls == [5, 5]
        finally:
            worker.stop()
    finally:
        broker.close()


def test_without_dead_letters_a_nack_keeps_the_row_as_xq(
    pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str, db: Any
) -> None:
    @dramatiq.actor(queue_name=qname, max_retries=0)
    def broken() -> None:
        raise ValueError("bad")

    pg_worker.start()
    broken.send()
    pg_broker.join(qname, timeout=10_000)
    assert [r[0] for r in rows(db, pg_broker.schema, qname)] == [f"{qname}.XQ"]
    pg_broker.flush(qname)
    assert rows(db, pg_broker.schema, qname) == []


@pytest.mark.pooler
def test_idempotency_commits_the_writes_the_key_and_the_ack_together(
    database_url: str, db_schema: str, qname: str, db: Any
) -> None:
    table = psycopg.sql.Identifier(db_schema, "effects")
    db.execute(psycopg.sql.SQL("CREATE TABLE {} (n int)").format(table))
    broker = make_broker(database_url, db_schema, middleware=build_middleware(middleware=[Idempotency()]))
    try:

        @dramatiq.actor(queue_name=qname, broker=broker, idempotency_key=lambda n: f"effect-{n}")
        def effect(n: int) -> None:
            conn = job_connection()
            conn.execute(psycopg.sql.SQL("INSERT INTO {} VALUES (%s)").format(table), (n,))

        assert broker.middleware.index(next(m for m in broker.middleware if isinstance(m, Idempotency))) < [
            type(m).__name__ for m in broker.middleware
        ].index("AckInJobTransaction")
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
        worker.start()
        try:
            effect.send(1)
            effect.send(1)  # a duplicate: skipped by its key
            broker.join(qname, timeout=10_000)
        finally:
            worker.stop()
        assert db.execute(psycopg.sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0] == 1
        keys = db.execute(
            psycopg.sql.SQL("SELECT job_key FROM {}").format(psycopg.sql.Identifier(db_schema, "processed_jobs"))
        ).fetchall()
        assert keys == [("effect-1",)]
        assert rows(db, db_schema, qname) == []
    finally:
        broker.close()


def test_ack_joins_a_bound_transaction_and_rolls_back_with_it(pg_broker: PostgresBroker, qname: str, db: Any) -> None:
    """The settle hook deletes the row on the bound connection: a rollback keeps the message."""
    from dramatiq_reliable.postgres.broker import AckInJobTransaction

    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    job.send()
    consumer = pg_broker.consume(qname, prefetch=1, timeout=100)
    message = next(consumer)
    assert message is not None
    hook = AckInJobTransaction()
    with pg_broker.database.connection() as conn:
        conn.execute("SELECT 1")  # the job's transaction is open, as Idempotency leaves it
        with bind(conn):
            hook.after_process_message(pg_broker, message, result=None)
        assert message.settled
        conn.rollback()
    assert len(rows(db, pg_broker.schema, qname)) == 1
    consumer.requeue([message])
    consumer.close()


def test_counts_report_ready_delayed_held_and_oldest_age(pg_broker: PostgresBroker, qname: str) -> None:
    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    job.send()
    job.send()
    job.send_with_options(delay=60_000)
    consumer = pg_broker.consume(qname, prefetch=1, timeout=100)
    held = next(consumer)
    (counts,) = [c for c in pg_broker.counts() if c.queue_name == qname]
    assert (counts.ready, counts.delayed, counts.held, counts.dead, counts.depth) == (1, 1, 1, 0, 3)
    assert counts.oldest_ready_s is not None and counts.oldest_ready_s >= 0
    assert held is not None
    consumer.requeue([held])
    consumer.close()


def test_a_send_from_many_threads_at_once_loses_nothing(
    pg_broker: PostgresBroker, pg_worker: dramatiq.Worker, qname: str
) -> None:
    done: set[int] = set()
    lock = threading.Lock()

    @dramatiq.actor(queue_name=qname)
    def job(n: int) -> None:
        with lock:
            done.add(n)

    pg_worker.start()
    threads = [threading.Thread(target=lambda k=k: [job.send(k * 50 + i) for i in range(50)]) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pg_broker.join(qname, timeout=20_000)
    assert done == set(range(200))


def test_a_broker_on_an_unmigrated_schema_says_to_migrate(
    database_url: str, unmigrated_schema: str, qname: str
) -> None:
    from dramatiq_reliable import SchemaNotReady

    broker = PostgresBroker(database=database_url, schema=unmigrated_schema)
    try:

        @dramatiq.actor(queue_name=qname, broker=broker)
        def job() -> None: ...

        with pytest.raises(SchemaNotReady, match="dramatiq-reliable migrate"):
            job.send()
    finally:
        broker.close()


def test_status_reads_depth_and_oldest_age_of_postgres_queues(
    pg_broker: PostgresBroker, qname: str, database_url: str
) -> None:
    from dramatiq_reliable.health import collect_health

    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    job.send()
    job.send_with_options(delay=60_000)
    health = collect_health(database=database_url, schema=pg_broker.schema)
    numbers = health.queue(qname)
    assert (numbers.depth, numbers.delayed, numbers.xq) == (1, 1, 0)
    assert numbers.queue_oldest_age_s is not None and numbers.queue_oldest_age_s >= 0


def test_the_cli_replays_dead_letters_onto_postgres_queues(
    database_url: str, db_schema: str, qname: str, db: Any
) -> None:
    from dramatiq_reliable.cli import main

    broker = make_broker(
        database_url,
        db_schema,
        middleware=build_middleware(middleware=[DeadLetters()], retries=ClassifiedRetries(max_retries=0)),
    )
    try:

        @dramatiq.actor(queue_name=qname, broker=broker)
        def broken() -> None:
            raise ValueError("bad")

        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        worker.start()
        try:
            broken.send()
            broker.join(qname, timeout=10_000)
        finally:
            worker.stop()
        code = main(
            [
                "dead-letters",
                "replay",
                "--all",
                "--yes",
                "--to",
                "queue",
                "--schema",
                db_schema,
                "--database-url",
                database_url,
            ]
        )
        assert code == 0
        assert [r[0] for r in rows(db, db_schema, qname)] == [qname]
    finally:
        broker.close()


def test_join_takes_the_rabbitmq_brokers_arguments_in_the_same_places() -> None:
    ours = inspect.signature(PostgresBroker.join).parameters
    theirs = inspect.signature(RabbitmqBroker.join).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_join_returns_after_min_successes_empty_counts_idle_time_apart(
    pg_broker: PostgresBroker, qname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    @dramatiq.actor(queue_name=qname)
    def job() -> None: ...

    counted: list[float] = []
    real_pending = queue_sql.pending

    def pending(conn: psycopg.Connection[Any], schema: str, queue_name: str) -> int:
        counted.append(time.monotonic())
        return real_pending(conn, schema, queue_name)

    monkeypatch.setattr(queue_sql, "pending", pending)
    pg_broker.join(qname, 3, 150, timeout=10_000)  # positionally, as on RabbitmqBroker
    assert len(counted) == 3
    assert all(later - earlier >= 0.15 for earlier, later in itertools.pairwise(counted))

    counted.clear()
    pg_broker.join(qname, min_successes=1)
    assert len(counted) == 1

    job.send()
    counted.clear()
    started = time.monotonic()
    with pytest.raises(QueueJoinTimeout):
        pg_broker.join(qname, min_successes=1, idle_time=100, timeout=350)
    assert time.monotonic() - started >= 0.35
    with pytest.raises(ConfigurationError, match="min_successes"):
        pg_broker.join(qname, min_successes=0)
    with pytest.raises(ConfigurationError, match="idle_time"):
        pg_broker.join(qname, idle_time=True)


def _about_the_schema(caplog: pytest.LogCaptureFixture, schema_name: str) -> list[logging.LogRecord]:
    """Warnings and worse that name the schema (Dramatiq's consumer errors quote the missing relation)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and schema_name in r.getMessage()]


def test_a_worker_on_an_unmigrated_schema_logs_one_error_then_starts_by_itself_once_migrated(
    database_url: str, unmigrated_schema: str, qname: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    broker = make_broker(database_url, unmigrated_schema)
    ran: list[int] = []
    try:

        @dramatiq.actor(queue_name=qname, broker=broker)
        def job(n: int) -> None:
            ran.append(n)

        @dramatiq.actor(queue_name=f"{qname}_b", broker=broker)
        def other() -> None: ...

        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
        worker.start()
        try:
            # Two consumers asking every 100 ms; the schema checked at start, after 1 s and 2 s later.
            wait_for(lambda: broker.schema_gate.checks >= 3, timeout_ms=20_000, message="the schema was not re-checked")
            (error,) = _about_the_schema(caplog, unmigrated_schema)
            assert error.levelno == logging.ERROR and error.name == "dramatiq_reliable.postgres"
            assert f"run 'dramatiq-reliable migrate --schema {unmigrated_schema}'" in error.getMessage()
            assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]

            schema.migrate(database_url, schema=unmigrated_schema)
            job.send(7)
            wait_for(lambda: ran == [7], timeout_ms=10_000, message="the worker did not start once migrated")
            assert _about_the_schema(caplog, unmigrated_schema) == [error]
        finally:
            worker.stop()
    finally:
        broker.close()


def test_join_flush_and_counts_on_an_unmigrated_schema_name_the_migrate_command(
    database_url: str, unmigrated_schema: str, qname: str
) -> None:
    broker = make_broker(database_url, unmigrated_schema)
    try:
        broker.declare_queue(qname)
        fix = f"dramatiq-reliable migrate --schema {unmigrated_schema}"
        with pytest.raises(SchemaNotReady, match=fix):
            broker.join(qname, timeout=1000)
        with pytest.raises(SchemaNotReady, match=fix):
            broker.flush_all()
        with pytest.raises(SchemaNotReady, match=fix):
            broker.counts()
    finally:
        broker.close()


def test_the_next_due_probe_sees_every_priority_and_an_empty_queue(
    pg_broker: PostgresBroker, qname: str, db: Any, db_schema: str
) -> None:
    pg_broker.declare_queue(qname)
    assert queue_sql.next_due_s(db, db_schema, qname) is None
    for priority, delay_ms in ((0, 60_000), (5, 30_000), (1, 90_000)):
        queue_sql.insert(
            db,
            db_schema,
            queue_name=qname,
            message_id=str(uuid.uuid4()),
            actor_name="job",
            body=b"{}",
            priority=priority,
            eta_ms=int(time.time() * 1000) + delay_ms,
        )
    due_s = queue_sql.next_due_s(db, db_schema, qname)
    assert due_s is not None and 25 < due_s <= 30  # the earliest, whatever its priority
    assert queue_sql.next_due_s(db, db_schema, qname + "_other") is None


def test_an_idle_consumer_wakes_for_a_delayed_message_when_due_not_a_poll_interval_later(
    database_url: str, db_schema: str, qname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dramatiq_reliable.postgres import consumer as consumer_module

    # Every idle sleep is now 5-10 minutes: only waking for the due row can claim it in time.
    monkeypatch.setattr(consumer_module, "FIRST_IDLE_S", 600.0)
    sender = make_broker(database_url, db_schema)
    receiver = make_broker(database_url, db_schema, poll_interval_ms=600_000)
    try:
        job = dramatiq.actor(lambda: None, actor_name="job", queue_name=qname, broker=sender)
        receiver.declare_queue(qname)
        message = job.send_with_options(delay=1000)  # another broker: nothing in the receiver's process wakes it
        consumer = receiver.consume(qname, timeout=20_000)
        received: list[Any] = []
        thread = threading.Thread(target=lambda: received.append(next(consumer)), daemon=True)
        thread.start()
        wait_for(lambda: received, timeout_ms=15_000, message="the delayed message was not claimed when due")
        assert received[0] is not None and received[0].message_id == message.message_id
        consumer.ack(received[0])
        consumer.close()
    finally:
        sender.close()
        receiver.close()
