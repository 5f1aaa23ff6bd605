"""A batch child's count or a workflow step's mark written on its own connection fails closed.

With no job transaction (no ``Idempotency``, or its record mode) the write runs after the actor
returned; Dramatiq would swallow its failure and ack the message, and the batch or workflow
would wait for ever.  Here a real Postgres failure (the table the write needs, renamed away)
either heals while the write is tried again, or fails the message into the dead letters, whose
replay finishes the batch or workflow once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks, Middleware
from psycopg import sql

from dramatiq_reliable import DeadLetters, Idempotency, MiddlewareFailed, PostgresBroker, PostgresDeadLetterStore
from dramatiq_reliable.binding import bound_connection
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.workflows import Batch, Batches, Workflow, Workflows, batch_status, workflow_status

pytestmark = pytest.mark.integration


def _rename(db: psycopg.Connection[Any], schema: str, table: str, to: str) -> None:
    db.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(sql.Identifier(schema, table), sql.Identifier(to)))


class _Refuse(Middleware):
    """Refuses to send the messages of the actors named in ``refused`` (as a failing dedupe check would)."""

    refused: ClassVar[set[str]] = set()

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        if message.actor_name in self.refused:
            raise MiddlewareFailed(f"refused to send {message.actor_name}")


@pytest.fixture(params=["no_idempotency", "record"])
def broker(request: pytest.FixtureRequest, database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    """A PostgresBroker whose children and steps run with no job transaction bound."""
    instance = PostgresBroker(database=database_url, schema=db_schema)
    if request.param != "no_idempotency":
        instance.add_middleware(Idempotency(default_mode=request.param), before=Callbacks)
    instance.add_middleware(_Refuse())
    instance.add_middleware(DeadLetters())
    instance.add_middleware(Batches(write_timeout_ms=300))
    instance.add_middleware(Workflows(write_timeout_ms=300))
    dramatiq.set_broker(instance)
    yield instance
    instance.close()


@pytest.fixture
def worker(broker: PostgresBroker) -> Iterator[dramatiq.Worker]:
    instance = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    yield instance
    instance.stop()


def _dead_letters(broker: PostgresBroker) -> list[Any]:
    return list(PostgresDeadLetterStore.from_broker(broker).list().items)


def test_a_count_that_cannot_be_written_dead_letters_the_child_and_its_replay_fires_the_batch_once(
    broker: PostgresBroker, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    ran: list[str] = []

    @dramatiq.actor(queue_name="closed", broker=broker, max_retries=0)
    def child(n: int) -> None:
        ran.append(f"child {n}")

    @dramatiq.actor(queue_name="closed", broker=broker)
    def report() -> None:
        ran.append("report")

    batch = Batch(callback=report.message(), broker=broker)
    with broker.transaction(), batch:
        batch.add(child.message(1))
    _rename(db, db_schema, "batch_children", "batch_children_away")
    worker.start()
    wait_for(lambda: _dead_letters(broker), timeout_ms=15_000, message="the child was acked with its count lost")
    [dead] = _dead_letters(broker)
    assert dead.actor_name == "child" and "replay it once Postgres is reachable" in (dead.error_message or "")
    assert ran == ["child 1"]

    _rename(db, db_schema, "batch_children_away", "batch_children")
    status = batch_status(broker.database, db_schema, batch.id)
    assert (status.done, status.dead, status.pending) == (0, 0, 1), "a child that ran must not be counted dead"
    assert PostgresDeadLetterStore.from_broker(broker).replay(ids=[dead.id]).replayed == 1
    wait_for(lambda: "report" in ran, timeout_ms=15_000, message="the replayed child did not fire the batch")
    status = batch_status(broker.database, db_schema, batch.id)
    assert (status.done, status.dead, status.pending, status.state) == (1, 0, 0, "succeeded")
    assert ran == ["child 1", "child 1", "report"]  # the replay runs the child again; the count is once


@pytest.mark.parametrize("broker", ["no_idempotency"], indirect=True)
def test_a_count_that_fails_for_a_moment_is_written_again_and_the_child_acked(
    broker: PostgresBroker,
    worker: dramatiq.Worker,
    db: psycopg.Connection[Any],
    db_schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    batches = next(m for m in broker.middleware if isinstance(m, Batches))
    batches.write_timeout_ms = 30_000
    ran: list[str] = []

    @dramatiq.actor(queue_name="healed", broker=broker, max_retries=0)
    def child(n: int) -> None:
        ran.append(f"child {n}")

    @dramatiq.actor(queue_name="healed", broker=broker)
    def report() -> None:
        ran.append("report")

    batch = Batch(callback=report.message(), broker=broker)
    with broker.transaction(), batch:
        batch.add(child.message(1))
    _rename(db, db_schema, "batch_shards", "batch_shards_away")
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.workflows"):
        worker.start()
        wait_for(
            lambda: any("trying again" in r.getMessage() for r in caplog.records),
            timeout_ms=15_000,
            message="the failed count was not tried again",
        )
        _rename(db, db_schema, "batch_shards_away", "batch_shards")
        wait_for(lambda: "report" in ran, timeout_ms=15_000, message="the count never landed")
    assert ran == ["child 1", "report"]
    assert _dead_letters(broker) == []
    status = batch_status(broker.database, db_schema, batch.id)
    assert (status.done, status.dead, status.state) == (1, 0, "succeeded")


@pytest.mark.parametrize("broker", ["record"], indirect=True)
def test_a_step_mark_that_cannot_be_written_dead_letters_the_step_and_its_replay_resumes_the_workflow(
    broker: PostgresBroker, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    ran: list[str] = []

    @dramatiq.actor(queue_name="steps", broker=broker, max_retries=0)
    def first() -> str:
        ran.append("first")
        return "a"

    @dramatiq.actor(queue_name="steps", broker=broker)
    def second(previous: str) -> None:
        ran.append(previous + "b")

    workflow = Workflow([first.message(), second.message()], broker=broker)
    with broker.transaction():
        workflow.run()
    _rename(db, db_schema, "workflow_stages", "workflow_stages_away")
    worker.start()
    wait_for(lambda: _dead_letters(broker), timeout_ms=15_000, message="the step was acked with its mark lost")
    [dead] = _dead_letters(broker)
    _rename(db, db_schema, "workflow_stages_away", "workflow_stages")
    status = workflow_status(broker.database, db_schema, workflow.id)
    assert (status.state, [s.state for s in status.steps]) == ("running", ["sent", "waiting"])

    # Record mode did not store the key of the failed message: the replay runs, and is not skipped.
    assert PostgresDeadLetterStore.from_broker(broker).replay(ids=[dead.id]).replayed == 1
    wait_for(lambda: "ab" in ran, timeout_ms=15_000, message="the replayed step did not resume the workflow")
    wait_for(lambda: workflow_status(broker.database, db_schema, workflow.id).state == "succeeded")
    assert ran == ["first", "first", "ab"]


@pytest.mark.parametrize("broker", ["transactional"], indirect=True)
def test_a_next_stage_refused_in_the_jobs_transaction_rolls_the_step_back_into_the_dead_letters(
    broker: PostgresBroker, worker: dramatiq.Worker, db_schema: str
) -> None:
    ran: list[str] = []

    @dramatiq.actor(queue_name="refused", broker=broker, max_retries=0)
    def first() -> str:
        ran.append("first")
        return "a"

    @dramatiq.actor(queue_name="refused", broker=broker)
    def second(previous: str) -> None:
        ran.append(previous + "b")

    workflow = Workflow([first.message(), second.message()], broker=broker)
    with broker.transaction():
        workflow.run()
    _Refuse.refused = {"second"}
    try:
        worker.start()
        # Swallowed by Dramatiq, the refusal let the mark commit with the job, without the next stage.
        wait_for(lambda: _dead_letters(broker), timeout_ms=15_000, message="the step committed without its stage")
    finally:
        _Refuse.refused = set()
    [dead] = _dead_letters(broker)
    assert "in the job's transaction (rolled back)" in dead.error_message
    status = workflow_status(broker.database, db_schema, workflow.id)
    assert (status.state, [s.state for s in status.steps]) == ("running", ["sent", "waiting"])

    assert PostgresDeadLetterStore.from_broker(broker).replay(ids=[dead.id]).replayed == 1
    wait_for(lambda: "ab" in ran, timeout_ms=15_000, message="the replayed step did not resume the workflow")
    assert ran == ["first", "first", "ab"]


class _CutOnSend(Middleware):
    """Terminates the job's own Postgres backend as it sends the next stage (``actor`` named), once.

    The send then fails on the job's connection (wrapped as ``OutboxWriteError``, not a psycopg
    error), as a Postgres restart or a network cut between the step's mark and its next stage would.
    """

    url: ClassVar[str] = ""
    actor: ClassVar[str | None] = None

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        conn = bound_connection()
        if message.actor_name != self.actor or conn is None:
            return
        type(self).actor = None
        with psycopg.connect(self.url, autocommit=True) as killer:
            killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))


@pytest.mark.needs_session("terminates the job's own backend, which a pooler hides")
@pytest.mark.parametrize("broker", ["transactional"], indirect=True)
def test_a_next_stage_lost_with_the_jobs_connection_is_retried_not_dead_lettered(
    broker: PostgresBroker, worker: dramatiq.Worker, db_schema: str, direct_database_url: str
) -> None:
    ran: list[str] = []

    @dramatiq.actor(queue_name="cut", broker=broker, min_backoff=10, max_backoff=50)
    def first() -> str:
        ran.append("first")
        return "a"

    @dramatiq.actor(queue_name="cut", broker=broker)
    def second(previous: str) -> None:
        ran.append(previous + "b")

    broker.add_middleware(_CutOnSend())
    workflow = Workflow([first.message(), second.message()], broker=broker)
    with broker.transaction():
        workflow.run()
    _CutOnSend.url, _CutOnSend.actor = direct_database_url, "second"
    try:
        worker.start()
        # The job's transaction was lost with its connection: nothing of it committed, so the
        # step is retried; failing it into the dead letters left the workflow waiting for a replay.
        wait_for(
            lambda: "ab" in ran or _dead_letters(broker),
            timeout_ms=15_000,
            message="the step neither resumed the workflow nor died",
        )
        assert _dead_letters(broker) == [], "a lost connection is an outage to retry, not a step to replay"
        wait_for(lambda: workflow_status(broker.database, db_schema, workflow.id).state == "succeeded")
    finally:
        _CutOnSend.actor = None
    assert _CutOnSend.actor is None and ran == ["first", "first", "ab"]
