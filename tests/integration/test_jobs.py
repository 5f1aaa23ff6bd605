"""Jobs by id against real Postgres (and RabbitMQ for OutboxBroker): one message walked through
waiting -> published -> retrying (attempt 2, last error) -> done, one through -> dead, asserting
what ``show_job`` says at each step, on both Postgres-backed brokers."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    JobNotFound,
    OutboxBroker,
    PostgresBroker,
    Unrecoverable,
    build_middleware,
    list_jobs,
    show_job,
)
from dramatiq_reliable.jobs import JobStatus
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration

# A retry a minute away: the test makes it due itself, so no step waits on a backoff.
_BACKOFF_MS = 60_000


def _middleware() -> list[dramatiq.Middleware]:
    return build_middleware(
        middleware=[DeadLetters(), Idempotency()],
        retries=ClassifiedRetries(max_retries=5, min_backoff=_BACKOFF_MS, max_backoff=_BACKOFF_MS, jitter="none"),
    )


class Rig:
    """One broker kind: send, hand to the workers (the relay for OutboxBroker), make a retry due."""

    def __init__(self, kind: str, broker: OutboxBroker | PostgresBroker, db: psycopg.Connection[Any], schema: str):
        self.kind, self.broker, self.db, self.schema = kind, broker, db, schema
        self.table = "outbox" if kind == "outbox" else "queue"

    def hand_over(self) -> None:
        if isinstance(self.broker, OutboxBroker):
            drain_outbox(self.broker)

    def make_due(self, message_id: str) -> None:
        """Fast-forward the waiting retry to now (the backoff itself is ClassifiedRetries' business)."""
        self.db.execute(
            sql.SQL("UPDATE {} SET available_at = now() WHERE message_id = %s").format(
                sql.Identifier(self.schema, self.table)
            ),
            (message_id,),
        )
        self.hand_over()

    def show(self, id: str) -> JobStatus:
        return show_job(self.db, self.schema, id)


@pytest.fixture(params=["outbox", "postgres"])
def rig(
    request: pytest.FixtureRequest, database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> Iterator[Rig]:
    broker: OutboxBroker | PostgresBroker
    if request.param == "outbox":
        rabbitmq_url = request.getfixturevalue("rabbitmq_url")
        broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, middleware=_middleware())
    else:
        broker = PostgresBroker(database=database_url, schema=db_schema, middleware=_middleware())
    dramatiq.set_broker(broker)
    yield Rig(request.param, broker, db, db_schema)
    broker.close()


@pytest.fixture
def qname(request: pytest.FixtureRequest, rig: Rig) -> str:
    if rig.kind == "outbox":
        return str(request.getfixturevalue("queue_name"))
    return "jobs_" + request.node.name.split("[")[0][-20:].replace("-", "_")


@pytest.fixture
def start(rig: Rig) -> Iterator[Any]:
    workers: list[dramatiq.Worker] = []

    def starting() -> None:
        worker = dramatiq.Worker(rig.broker, worker_timeout=100, worker_threads=1)
        worker.start()
        workers.append(worker)

    yield starting
    for worker in workers:
        worker.stop()


def _state_is(rig: Rig, message_id: str, state: str, attempts: int | None = None) -> bool:
    status = rig.show(message_id)
    return status.state == state and (attempts is None or status.attempts == attempts)


def test_a_job_walks_from_waiting_through_retrying_to_done(rig: Rig, qname: str, start: Any) -> None:
    runs: list[int] = []

    @dramatiq.actor(queue_name=qname, actor_name=f"{qname}_email")
    def send_email(user_id: int) -> None:
        runs.append(user_id)
        if len(runs) <= 2:
            raise ConnectionResetError(f"smtp down (run {len(runs)})")

    with rig.broker.transaction():
        message = send_email.send(7)
    waiting = rig.show(message.message_id)
    assert (waiting.state, waiting.attempts, waiting.actor_name) == ("waiting", 0, send_email.actor_name)
    assert waiting.since is not None and waiting.last_error_type is None

    if rig.kind == "outbox":
        rig.hand_over()
        published = rig.show(message.message_id)
        assert published.state == "published_no_news"
        assert "no news" in published.detail

    start()
    wait_for(lambda: _state_is(rig, message.message_id, "retrying", 1), message="the first failure was not recorded")
    rig.make_due(message.message_id)
    wait_for(lambda: _state_is(rig, message.message_id, "retrying", 2), message="the second failure was not recorded")
    retrying = rig.show(message.message_id)
    assert retrying.last_error_type == "ConnectionResetError"
    assert retrying.last_error_message == "smtp down (run 2)"
    assert retrying.last_error_where is not None and "test_jobs.py" in retrying.last_error_where
    assert retrying.last_error_where.endswith("in send_email")
    assert retrying.max_retries == 5
    assert retrying.next_due_at is not None and retrying.since is not None
    ahead = (retrying.next_due_at - retrying.since).total_seconds()
    assert 55 <= ahead <= 65, ahead
    assert [row.message_id for row in list_jobs(rig.db, rig.schema, state="retrying")] == [message.message_id]

    rig.make_due(message.message_id)
    wait_for(lambda: _state_is(rig, message.message_id, "done"), message="the third run never finished")
    done = rig.show(message.message_id)
    # The failure record stays: done after two failed attempts, and the last error is still told.
    assert (done.attempts, done.last_error_type, done.next_due_at) == (2, "ConnectionResetError", None)
    assert runs == [7, 7, 7]
    assert list_jobs(rig.db, rig.schema, state="retrying") == []


def test_a_job_that_cannot_recover_is_dead_with_its_error(rig: Rig, qname: str, start: Any) -> None:
    @dramatiq.actor(queue_name=qname, actor_name=f"{qname}_charge")
    def charge(order_id: int) -> None:
        raise Unrecoverable(f"card of order {order_id} declined")

    message = charge.send(42)
    rig.hand_over()
    start()
    wait_for(lambda: _state_is(rig, message.message_id, "dead"), message="the job never died")
    dead = rig.show(message.message_id)
    assert dead.attempts == 1
    assert dead.last_error_type == "dramatiq_reliable.Unrecoverable"
    assert dead.last_error_message == "card of order 42 declined"
    assert isinstance(dead.since, datetime.datetime)
    assert [row.message_id for row in list_jobs(rig.db, rig.schema, state="dead", actor=charge.actor_name)] == [
        message.message_id
    ]
    assert list_jobs(rig.db, rig.schema, state="dead", actor="someone_else") == []


def test_an_unknown_id_is_not_found_and_says_what_was_searched(rig: Rig) -> None:
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        rig.show("nope")


def _records(rig: Rig) -> list[tuple[Any, ...]]:
    return rig.db.execute(
        sql.SQL("SELECT message_id, attempts FROM {}").format(sql.Identifier(rig.schema, "job_attempts"))
    ).fetchall()


def test_a_job_that_succeeds_writes_no_failure_record(rig: Rig, qname: str, start: Any) -> None:
    @dramatiq.actor(queue_name=qname, actor_name=f"{qname}_ok")
    def fine() -> None: ...

    message = fine.send()
    rig.hand_over()
    start()
    wait_for(lambda: rig.show(message.message_id).state == "done", message="the job never finished")
    assert _records(rig) == []


def test_expired_failure_records_are_purged_with_the_expired_keys(rig: Rig, database_url: str) -> None:
    from dramatiq_reliable.idempotency import purge_expired

    insert = sql.SQL(
        "INSERT INTO {} (message_id, queue_name, actor_name, attempts, outcome, expires_at) "
        "VALUES (%s, 'q', 'a', 1, 'retry', now() + make_interval(secs => %s))"
    ).format(sql.Identifier(rig.schema, "job_attempts"))
    for message_id, expires_in_s in (("old-1", -10), ("old-2", -1), ("fresh", 3600)):
        rig.db.execute(insert, (message_id, expires_in_s))
    purge_expired(database_url, schema=rig.schema, batch_size=1)
    assert _records(rig) == [("fresh", 1)]


# PostgresBroker only: a RabbitMQ delivery leaves no row in Postgres unless LongJobs leases it.
@pytest.mark.parametrize("rig", ["postgres"], indirect=True)
def test_a_job_a_postgres_broker_worker_holds_is_running(rig: Rig, qname: str, start: Any) -> None:
    """PostgresBroker leases the row it hands a worker; an OutboxBroker job says so only under LongJobs."""
    started, release = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name=qname, actor_name=f"{qname}_slow")
    def slow() -> None:
        started.set()
        release.wait(10)

    message = slow.send()
    start()
    try:
        assert started.wait(10), "the job never started"
        running = rig.show(message.message_id)
        assert (running.state, running.queue_name) == ("running", qname)
        assert "held by a PostgresBroker worker" in running.detail
    finally:
        release.set()
    wait_for(lambda: rig.show(message.message_id).state == "done", message="the job never finished")
