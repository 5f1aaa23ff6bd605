"""Scheduled runs in real workers: run state recorded by ScheduleRuns, the loop inside workers
(WorkerScheduler) on PostgresBroker and OutboxBroker, and ticks written into the Postgres queue."""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import ClassifiedRetries, PostgresBroker, build_middleware
from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.scheduler import Registry, Scheduler, ScheduleRuns, WorkerScheduler, schedule
from dramatiq_reliable.testing import wait_for
from tests.support import closed_port

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc


def _ticks(db: psycopg.Connection[Any], schema_name: str) -> list[tuple[Any, ...]]:
    query = sql.SQL(
        "SELECT schedule_name, state, started_at IS NOT NULL, finished_at IS NOT NULL FROM {} ORDER BY fire_at"
    ).format(sql.Identifier(schema_name, "schedule_ticks"))
    return db.execute(query).fetchall()


def _runs(db: psycopg.Connection[Any], schema_name: str) -> list[tuple[Any, ...]]:
    """The ticks that fired (the overlap policy may have skipped a second one due in the same pass)."""
    return [tick for tick in _ticks(db, schema_name) if tick[1] != "skipped"]


def _count(db: psycopg.Connection[Any], schema_name: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema_name, table))).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def qname() -> str:
    return f"sr_{uuid.uuid4().hex[:10]}"


def _pg_broker(database_url: str, db_schema: str, *extra: dramatiq.Middleware, max_retries: int = 0) -> PostgresBroker:
    broker = PostgresBroker(
        database=database_url,
        schema=db_schema,
        lease_ms=2000,
        middleware=build_middleware(
            middleware=[ScheduleRuns(), *extra],
            retries=ClassifiedRetries(max_retries=max_retries, min_backoff=10, max_backoff=20),
        ),
    )
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def brokers() -> Iterator[list[PostgresBroker]]:
    made: list[PostgresBroker] = []
    yield made
    for broker in made:
        broker.close()


def _fire_one(broker: PostgresBroker, registry: Registry) -> Scheduler:
    scheduler = Scheduler.from_broker(broker, registry=registry)
    scheduler.sync()
    later = dt.datetime.now(UTC) + dt.timedelta(seconds=2)
    assert scheduler.tick_once(now=later).fired == 1
    return scheduler


def test_a_tick_written_to_the_postgres_queue_runs_and_is_recorded_succeeded(
    database_url: str, db_schema: str, db: Any, qname: str, brokers: list[PostgresBroker]
) -> None:
    broker = _pg_broker(database_url, db_schema)
    brokers.append(broker)
    ran: list[int] = []

    @dramatiq.actor(queue_name=qname)
    def job(n: int) -> None:
        ran.append(n)

    registry = Registry()
    schedule("pg-every-second", actor=job, every_ms=1000, args=[7], registry=registry)
    _fire_one(broker, registry)
    assert _count(db, db_schema, "outbox") == 0
    assert _count(db, db_schema, "queue") == 1
    assert _runs(db, db_schema) == [("pg-every-second", "enqueued", False, False)]
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: _runs(db, db_schema)[0][1] == "succeeded", message="tick recorded succeeded")
    finally:
        worker.stop()
    assert ran == [7]
    assert _runs(db, db_schema) == [("pg-every-second", "succeeded", True, True)]


def test_a_failing_run_is_retrying_then_failed_when_retries_give_up(
    database_url: str, db_schema: str, db: Any, qname: str, brokers: list[PostgresBroker]
) -> None:
    broker = _pg_broker(database_url, db_schema, max_retries=1)
    brokers.append(broker)
    attempts: list[str] = []
    states: list[str] = []

    @dramatiq.actor(queue_name=qname)
    def job() -> None:
        states.append(_runs(db, db_schema)[0][1])  # what the tick says while the attempt runs
        attempts.append("x")
        raise ValueError("boom")

    registry = Registry()
    schedule("pg-failing", actor=job, every_ms=1000, registry=registry)
    _fire_one(broker, registry)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: _runs(db, db_schema)[0][1] == "failed", message="tick recorded failed")
    finally:
        worker.stop()
    assert len(attempts) == 2
    # The first attempt ran while 'running'; the retry found the tick 'running' again.
    assert states == ["running", "running"]
    assert _runs(db, db_schema) == [("pg-failing", "failed", True, True)]


def test_a_retry_is_recorded_retrying_between_attempts(database_url: str, db_schema: str, db: Any) -> None:
    """The retry decision is read from message.failed, which ClassifiedRetries has set by then."""
    broker = PostgresBroker(database=database_url, schema=db_schema)
    try:
        runs = ScheduleRuns()
        scheduler = Scheduler.from_broker(broker, registry=_registry_for("direct"))
        scheduler.sync()
        scheduler.tick_once(now=dt.datetime.now(UTC) + dt.timedelta(seconds=2))
        message_id = db.execute(
            sql.SQL("SELECT message_id FROM {}").format(sql.Identifier(db_schema, "schedule_ticks"))
        ).fetchone()[0]
        proxy = _proxy(message_id)
        runs.before_process_message(broker, proxy)
        runs.after_process_message(broker, proxy, exception=ValueError("again"))
        assert _ticks(db, db_schema)[0][1] == "retrying"
        proxy.fail()
        runs.after_process_message(broker, proxy, exception=ValueError("last"))
        assert _ticks(db, db_schema)[0][1:] == ("failed", True, True)
        # A late duplicate never reopens a finished tick.
        runs.before_process_message(broker, _proxy(message_id))
        assert _ticks(db, db_schema)[0][1] == "failed"
    finally:
        broker.close()


def test_a_postgres_outage_while_recording_is_logged_and_never_fails_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = ScheduleRuns(
        database=f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres", schema="s", timeout_ms=300
    )
    proxy = _proxy("m-1")
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.scheduler"):
        runs.before_process_message(StubBroker(), proxy)  # must not raise
        runs.after_process_message(StubBroker(), proxy, result=None)
    assert not proxy.failed
    assert "could not record run state 'running'" in caplog.text
    assert "stale_after_ms" in caplog.text
    runs.after_worker_shutdown(StubBroker(), None)


def test_unscheduled_messages_cost_no_database_call() -> None:
    # No database at all: a message without the schedule option never looks for one.
    runs = ScheduleRuns()
    proxy = dramatiq.broker.MessageProxy(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
    runs.before_process_message(StubBroker(), proxy)
    runs.after_process_message(StubBroker(), proxy)
    assert runs.record(StubBroker(), "m", "running") is False  # a StubBroker has no database


def test_worker_scheduler_fires_ticks_inside_a_postgres_broker_worker_and_stops_in_bound(
    database_url: str, db_schema: str, db: Any, qname: str, brokers: list[PostgresBroker]
) -> None:
    ran: list[str] = []
    registry = Registry()
    broker = _pg_broker(database_url, db_schema, WorkerScheduler(registry=registry, poll_interval_ms=200))
    brokers.append(broker)

    @dramatiq.actor(queue_name=qname)
    def job() -> None:
        ran.append("ran")

    schedule("in-worker", actor=job, every_ms=1000, overlap="allow", registry=registry)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: len(ran) >= 2, timeout_ms=15_000, message="two scheduled runs")
        wait_for(lambda: any(t[1] == "succeeded" for t in _ticks(db, db_schema)), message="a succeeded tick")
    finally:
        worker.stop()
    assert {t[0] for t in _ticks(db, db_schema)} == {"in-worker"}
    assert _count(db, db_schema, "outbox") == 0
    middleware = next(m for m in broker.middleware if isinstance(m, WorkerScheduler))
    assert middleware.scheduler is None  # stopped and released at shutdown


def test_worker_scheduler_writes_outbox_rows_with_an_outbox_broker(broker: Any, db_schema: str, db: Any) -> None:
    registry = Registry()
    schedule("outbox-in-worker", actor="nobody", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    middleware = WorkerScheduler(registry=registry, poll_interval_ms=200)
    middleware.after_worker_boot(broker, None)
    try:
        wait_for(lambda: _count(db, db_schema, "outbox") >= 1, timeout_ms=10_000, message="an outbox row")
    finally:
        middleware.before_worker_shutdown(broker, None)
    assert middleware.scheduler is None
    assert _count(db, db_schema, "queue") == 0
    assert _count(db, db_schema, "outbox") == _count(db, db_schema, "schedule_ticks")


def test_worker_scheduler_takes_explicit_options_and_refuses_those_the_broker_owns() -> None:
    with pytest.raises(TypeError, match="database"):
        WorkerScheduler(database="postgresql://x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="batchsize"):
        WorkerScheduler(batchsize=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="stop_timeout_ms"):
        WorkerScheduler(stop_timeout_ms=0)
    with pytest.raises(ConfigurationError, match=r"batch_size must be an int >= 1, got True"):
        WorkerScheduler(batch_size=True)
    with pytest.raises(ConfigurationError, match=r"poll_interval_ms must be at most"):
        WorkerScheduler(poll_interval_ms=10**30)


def test_from_broker_refuses_a_broker_without_postgres() -> None:
    with pytest.raises(
        ConfigurationError, match=r"Scheduler\.from_broker\(\) has no database on a StubBroker; pass database="
    ):
        Scheduler.from_broker(StubBroker())
    with pytest.raises(ConfigurationError, match="target must be 'outbox' or 'queue'"):
        Scheduler(database="postgresql://x", target="rabbit")  # type: ignore[arg-type]


def _registry_for(name: str) -> Registry:
    registry = Registry()
    schedule(name, actor="nobody", queue_name="q", every_ms=1000, registry=registry)
    return registry


def _proxy(message_id: str) -> Any:
    message: Message[Any] = Message(
        queue_name="q", actor_name="nobody", args=(), kwargs={}, options={"schedule": "direct"}, message_id=message_id
    )
    return dramatiq.broker.MessageProxy(message)
