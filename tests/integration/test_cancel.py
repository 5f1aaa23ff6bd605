"""Cancel a job wherever it is: the outbox, the Postgres queue table, RabbitMQ, running, finished."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_reliable import (
    Cancellation,
    ClassifiedRetries,
    ConfigurationError,
    Database,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    PostgresBroker,
    build_middleware,
    cancel_job,
    check_cancelled,
    is_cancelled,
)
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.jobs.cancel import get_cancellation
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


def middleware(**retries: Any) -> list[dramatiq.Middleware]:
    return build_middleware(
        middleware=[Cancellation(check_interval_ms=20), Idempotency(), DeadLetters()],
        retries=ClassifiedRetries(max_retries=retries.get("max_retries", 3), min_backoff=10, max_backoff=20),
    )


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    db = Database(url=database_url, max_size=2)
    yield db
    db.close()


@pytest.fixture
def outbox_broker(rabbitmq_url: str, database_url: str, db_schema: str) -> Iterator[OutboxBroker]:
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, middleware=middleware())
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.fixture
def postgres_broker(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = PostgresBroker(database=database_url, schema=db_schema, middleware=middleware(), lease_ms=5000)
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.fixture(params=["outbox", "postgres"])
def any_broker(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("outbox_broker" if request.param == "outbox" else "postgres_broker")


@pytest.fixture
def qname(queue_name: str) -> str:
    return queue_name


def count(db: psycopg.Connection[Any], schema: str, table: str, message_id: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(
        psycopg.sql.Identifier(schema, table)
    )
    row = db.execute(query, (message_id,)).fetchone()
    assert row is not None
    return int(row[0])


def run_worker(broker: Any, queue_name: str) -> dramatiq.Worker:
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    return worker


def wait_done(broker: Any, queue_name: str) -> None:
    if isinstance(broker, OutboxBroker):
        drain_outbox(broker)
    broker.join(queue_name, timeout=15_000)


def test_a_job_waiting_in_the_outbox_is_deleted_and_never_published(
    outbox_broker: OutboxBroker, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    task = dramatiq.actor(lambda: None, actor_name=f"{qname}_a", queue_name=qname, broker=outbox_broker)
    message = task.send()
    result = cancel_job(database, db_schema, message.message_id, by="alice", reason="sent twice")
    assert (result.outcome, result.changed, result.removed) == ("outbox", True, 1)
    assert count(db, db_schema, "outbox", message.message_id) == 0
    assert drain_outbox(outbox_broker) == 0
    again = cancel_job(database, db_schema, message.message_id, by="bob")
    assert (again.outcome, again.changed) == ("already_cancelled", False)
    assert again.cancellation is not None and again.cancellation.cancelled_by == "alice"
    assert again.cancellation.reason == "sent twice" and again.cancellation.found_in == "outbox"


def test_a_job_waiting_in_the_postgres_queue_is_deleted_and_no_worker_runs_it(
    postgres_broker: PostgresBroker, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    ran: list[int] = []
    task = dramatiq.actor(ran.append, actor_name=f"{qname}_a", queue_name=qname, broker=postgres_broker)
    cancelled = task.send(1)
    result = cancel_job(database, db_schema, cancelled.message_id, by="alice")
    assert (result.outcome, result.removed) == ("queue", 1)
    assert count(db, db_schema, "queue", cancelled.message_id) == 0
    task.send(2)
    worker = run_worker(postgres_broker, qname)
    try:
        wait_done(postgres_broker, qname)
    finally:
        worker.stop()
    assert ran == [2]


def test_a_job_already_in_rabbitmq_is_skipped_and_acked_when_delivered(
    outbox_broker: OutboxBroker, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    ran: list[int] = []
    task = dramatiq.actor(ran.append, actor_name=f"{qname}_a", queue_name=qname, broker=outbox_broker)
    cancelled = task.send(1)
    assert drain_outbox(outbox_broker) == 1  # published: only a tombstone can stop it now
    result = cancel_job(database, db_schema, cancelled.message_id, by="alice")
    assert result.outcome == "in_flight"
    task.send(2)
    worker = run_worker(outbox_broker, qname)
    try:
        wait_done(outbox_broker, qname)  # join: both messages acked, none left unacked or in .XQ
    finally:
        worker.stop()
    assert ran == [2]
    with psycopg.connect(database.conninfo) as conn:
        record = get_cancellation(conn, db_schema, cancelled.message_id)
    assert record is not None and record.honoured_how == "skipped" and record.honoured_at is not None
    assert count(db, db_schema, "dead_letters", cancelled.message_id) == 0


def test_a_running_job_sees_is_cancelled_and_stops_without_retry_or_dead_letter(
    any_broker: Any, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    started, stopped = threading.Event(), threading.Event()
    runs: list[bool] = []

    def long_job() -> None:
        runs.append(is_cancelled())
        started.set()
        while not stopped.wait(0.01):
            check_cancelled()

    task = dramatiq.actor(long_job, actor_name=f"{qname}_a", queue_name=qname, broker=any_broker)
    message = task.send()
    worker = run_worker(any_broker, qname)
    try:
        if isinstance(any_broker, OutboxBroker):
            drain_outbox(any_broker)
        assert started.wait(15), "the job never started"
        result = cancel_job(database, db_schema, message.message_id, by="alice")
        assert result.outcome == "in_flight"
        wait_done(any_broker, qname)  # acked: not retried (a retry would be a second run), not left held
    finally:
        stopped.set()
        worker.stop()
    assert runs == [False]
    assert count(db, db_schema, "dead_letters", message.message_id) == 0
    assert count(db, db_schema, "processed_jobs", message.message_id) == 0  # rolled back with the job
    with psycopg.connect(database.conninfo) as conn:
        record = get_cancellation(conn, db_schema, message.message_id)
    assert record is not None and record.honoured_how == "stopped"


def test_a_finished_job_is_left_alone(
    postgres_broker: PostgresBroker, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    def maybe_fail(fail: bool) -> None:
        if fail:
            raise ValueError("boom")

    task = dramatiq.actor(maybe_fail, actor_name=f"{qname}_a", queue_name=qname, broker=postgres_broker, max_retries=0)
    done, dead = task.send(False), task.send(True)
    worker = run_worker(postgres_broker, qname)
    try:
        wait_done(postgres_broker, qname)
    finally:
        worker.stop()
    wait_for(lambda: count(db, db_schema, "dead_letters", dead.message_id) == 1, message="no dead letter")
    for message, finished_as in ((done, "done"), (dead, "dead")):
        result = cancel_job(database, db_schema, message.message_id, by="alice")
        assert (result.outcome, result.finished_as, result.changed) == ("finished", finished_as, False)
        assert count(db, db_schema, "job_cancellations", message.message_id) == 0


def test_an_unknown_id_changes_nothing_and_bad_input_is_refused_before_sql(
    database: Database, db_schema: str, db: Any
) -> None:
    unknown = str(uuid.uuid4())
    result = cancel_job(database, db_schema, unknown, by="alice")
    assert (result.outcome, result.changed) == ("unknown", False)
    assert count(db, db_schema, "job_cancellations", unknown) == 0
    for message_id, by in (("", "alice"), ("a\x00b", "alice"), ("x" * 256, "alice"), (unknown, ""), (None, "a")):
        with pytest.raises(ConfigurationError):
            cancel_job(database, db_schema, message_id, by=by)  # type: ignore[arg-type]


def test_the_cli_cancels_once_exits_7_for_an_unknown_id_and_8_for_a_finished_job(
    outbox_broker: OutboxBroker,
    qname: str,
    database_url: str,
    db_schema: str,
    db: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(["jobs", "cancel", *argv, "--database-url", database_url, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    task = dramatiq.actor(lambda: None, actor_name=f"{qname}_a", queue_name=qname, broker=outbox_broker)
    message = task.send()
    code, _, err = cli(message.message_id)  # no terminal, no --yes: refused
    assert code == ExitCode.ABORTED and "pass --yes" in err
    assert count(db, db_schema, "outbox", message.message_id) == 1
    code, out, _ = cli(message.message_id, "--yes", "--by", "alice", "--reason", "sent twice")
    assert code == ExitCode.OK and "removed from the outbox" in out and "alice" in out
    code, out, _ = cli(message.message_id, "--yes", "--json")
    assert code == ExitCode.OK and json.loads(out)["outcome"] == "already_cancelled"
    code, _, err = cli(str(uuid.uuid4()), "--yes")
    assert code == ExitCode.NOT_FOUND == 7 and "nothing changed" in err
    code, _, err = cli("a" * 300, "--yes")
    assert code == ExitCode.USAGE and "message_id" in err
    done = task.send()
    db.execute(
        psycopg.sql.SQL(
            "INSERT INTO {} (actor_name, job_key, payload_hash, message_id, expires_at) "
            "VALUES (%s, %s, '\\x00', %s, now() + interval '1 hour')"
        ).format(psycopg.sql.Identifier(db_schema, "processed_jobs")),
        (task.actor_name, done.message_id, done.message_id),
    )
    drain_outbox(outbox_broker)
    code, out, _ = cli(done.message_id, "--yes")
    assert code == ExitCode.REFUSED == 8 and "already finished (done)" in out


def test_a_postgres_queue_row_held_by_a_dead_worker_is_tombstoned_then_skipped_on_redelivery(
    postgres_broker: PostgresBroker, qname: str, database: Database, db_schema: str, db: Any
) -> None:
    ran: list[int] = []
    task = dramatiq.actor(ran.append, actor_name=f"{qname}_a", queue_name=qname, broker=postgres_broker)
    held = task.send(1)
    # A worker claimed it and died: the row keeps its lease, which has just run out.
    db.execute(
        psycopg.sql.SQL("UPDATE {} SET lease = 42, deliveries = 1, available_at = now() WHERE message_id = %s").format(
            psycopg.sql.Identifier(db_schema, "queue")
        ),
        (held.message_id,),
    )
    result = cancel_job(database, db_schema, held.message_id, by="alice")
    assert result.outcome == "in_flight"
    assert count(db, db_schema, "queue", held.message_id) == 1  # a held row is never deleted under a worker
    worker = run_worker(postgres_broker, qname)
    try:
        wait_done(postgres_broker, qname)
    finally:
        worker.stop()
    assert ran == []
    assert count(db, db_schema, "queue", held.message_id) == 0  # acked
