"""Batches against real Postgres (and RabbitMQ): one callback, after every child, in the last child's transaction."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import (
    ConfigurationError,
    DeadLetters,
    Idempotency,
    NotBound,
    PostgresBroker,
    job_connection,
)
from dramatiq_reliable.cli import main
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.workflows import BATCH_OPTION, Batch, Batches, batch_status

pytestmark = pytest.mark.integration


def _with_batches(broker: Any) -> Any:
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(DeadLetters())
    broker.add_middleware(Batches())  # last: its after-hook runs first, inside the job's transaction
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def batched(backed_broker: Any) -> Any:
    """A broker of each kind with Idempotency (transactional), DeadLetters and Batches; the global broker."""
    return _with_batches(backed_broker)


def _count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()
    assert row is not None
    return int(row[0])


def test_the_callback_runs_once_after_every_child_and_progress_is_readable_by_id(
    batched: Any,
    backed_queue: str,
    backed_worker: dramatiq.Worker,
    database_url: str,
    db_schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    done: list[int] = []
    reports: list[list[int]] = []

    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def invoice(n: int) -> None:
        done.append(n)

    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def report(month: str) -> None:
        reports.append(sorted(done))

    batch = Batch(callback=report.message("2026-11"), broker=batched)
    with batched.transaction(), batch:
        for n in range(20):
            batch.add(invoice.message(n))
    backed_worker.start()
    wait_for(
        lambda: reports, timeout_ms=30_000, message=lambda: f"the callback never ran; children done: {sorted(done)}"
    )
    assert reports == [list(range(20))], "the callback ran before every child finished, or twice"
    status = batch_status(batched.database, db_schema, batch.id)
    assert (status.total, status.done, status.dead, status.pending, status.state) == (20, 20, 0, 0, "succeeded")
    assert status.fired_at is not None and status.sealed_at is not None
    assert main(["batches", "show", batch.id, "--database-url", database_url, "--schema", db_schema]) == 0
    assert "20 of 20 finished" in capsys.readouterr().out
    assert main(["batches", "show", "no-such-batch", "--database-url", database_url, "--schema", db_schema]) == 7


def test_a_dead_child_fails_the_batch_or_counts_as_finished_per_policy(
    batched: Any, backed_queue: str, backed_worker: dramatiq.Worker, db_schema: str
) -> None:
    ran: list[str] = []

    @dramatiq.actor(queue_name=backed_queue, broker=batched, max_retries=0)
    def child(n: int) -> None:
        if n == 1:
            raise RuntimeError("child 1 fails for good")

    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def after(what: str) -> None:
        ran.append(what)

    failing = Batch(
        callback=after.message("fail:callback"), on_failure=after.message("fail:on_failure"), broker=batched
    )
    going_on = Batch(callback=after.message("continue:callback"), if_child_dies="continue", broker=batched)
    with batched.transaction():
        for batch in (failing, going_on):
            with batch:
                for n in range(3):
                    batch.add(child.message(n))
    backed_worker.start()
    wait_for(lambda: len(ran) == 2, timeout_ms=30_000, message=lambda: f"the batches did not both finish: {ran}")
    assert sorted(ran) == ["continue:callback", "fail:on_failure"]
    failed = batch_status(batched.database, db_schema, failing.id)
    assert (failed.done, failed.dead, failed.state) == (2, 1, "failed")
    assert batch_status(batched.database, db_schema, going_on.id).state == "succeeded"


def test_a_rolled_back_transaction_leaves_no_batch_and_no_child(
    batched: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def child(n: int) -> None:
        pass

    batch = Batch(callback=child.message(-1), broker=batched)
    with pytest.raises(RuntimeError, match="give up"), batched.transaction():
        for n in range(3):
            batch.add(child.message(n))
        raise RuntimeError("give up")
    table = "queue" if isinstance(batched, PostgresBroker) else "outbox"
    assert [_count(db, db_schema, t) for t in ("batches", "batch_children", "batch_shards", table)] == [0, 0, 0, 0]


def test_bad_input_is_refused_with_the_fix_and_an_empty_batch_fires_when_sealed(
    batched: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def child(n: int) -> None:
        pass

    batch = Batch(callback=child.message(-1), broker=batched)
    with pytest.raises(NotBound, match="outside a transaction; .* wrap the adds in broker.transaction"):
        batch.add(child.message(0))
    with pytest.raises(ConfigurationError, match="not declared on this broker"):
        Batch(callback=dramatiq.Message(backed_queue, "nobody", (), {}, {}), broker=batched)
    with pytest.raises(ConfigurationError, match="callback must be a message"):
        Batch(callback=child, broker=batched)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="if_child_dies must be 'fail' or 'continue'"):
        Batch(callback=child.message(-1), if_child_dies="ignore", broker=batched)  # type: ignore[arg-type]

    assert batch.seal() == "fired"  # empty: the callback is sent at once
    assert batch_status(batched.database, db_schema, batch.id).state == "succeeded"
    with batched.transaction(), pytest.raises(ConfigurationError, match="is sealed; start a new Batch"):
        batch.add(child.message(1))


def test_a_redelivered_child_neither_counts_twice_nor_fires_again(
    batched: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=batched)
    def child(n: int) -> None:
        pass

    batch = Batch(callback=child.message(-1), broker=batched)
    with batched.transaction(), batch:
        sent = [batch.add(child.message(n)) for n in range(2)]
    batches = next(m for m in batched.middleware if isinstance(m, Batches))
    proxy = dramatiq.broker.MessageProxy(sent[0])
    assert proxy.options[BATCH_OPTION] == batch.id
    assert batches._finish(batched, proxy, dead=False, conn=None) == "counted"
    assert batches._finish(batched, proxy, dead=False, conn=None) == "duplicate"
    assert batches._finish(batched, proxy, dead=True, conn=None) == "duplicate"
    last = dramatiq.broker.MessageProxy(sent[1])
    assert batches._finish(batched, last, dead=False, conn=None) == "fired"
    assert batches._finish(batched, last, dead=False, conn=None) == "duplicate"
    status = batch_status(batched.database, db_schema, batch.id)
    assert (status.done, status.pending, status.state) == (2, 0, "succeeded")


@pytest.fixture
def pg_batched(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    broker = _with_batches(PostgresBroker(database=database_url, schema=db_schema))
    yield broker
    broker.close()


def test_eight_threads_finishing_children_at_once_fire_exactly_one_callback(
    pg_batched: PostgresBroker, db_schema: str
) -> None:
    fired: dict[str, int] = {}
    lock = threading.Lock()

    @dramatiq.actor(queue_name="race", broker=pg_batched)
    def child(run: int, n: int) -> None:
        pass

    @dramatiq.actor(queue_name="race", broker=pg_batched)
    def callback(run: int) -> None:
        with lock:
            fired[str(run)] = fired.get(str(run), 0) + 1

    batches = [Batch(callback=callback.message(run), broker=pg_batched) for run in range(4)]
    with pg_batched.transaction():
        for run, batch in enumerate(batches):
            with batch:
                for n in range(60):
                    batch.add(child.message(run, n))
    worker = dramatiq.Worker(pg_batched, worker_timeout=20, worker_threads=8)
    worker.start()
    try:
        wait_for(lambda: len(fired) == 4, timeout_ms=60_000, message=lambda: f"not every batch fired: {fired}")
        for batch in batches:
            wait_for(lambda b=batch: batch_status(pg_batched.database, db_schema, b.id).pending == 0)  # type: ignore[misc]
    finally:
        worker.stop()
    assert fired == {str(run): 1 for run in range(4)}


def test_ten_thousand_children_stream_into_one_batch(pg_batched: PostgresBroker, db_schema: str) -> None:
    count = int(os.environ.get("DRAMATIQ_RELIABLE_BATCH_CHILDREN", "10000"))

    @dramatiq.actor(queue_name="big", broker=pg_batched)
    def child(n: int) -> None:
        pass

    batch = Batch(callback=child.message(-1), broker=pg_batched)
    started = time.monotonic()
    with pg_batched.transaction(), batch:
        for n in range(count):
            batch.add(child.message(n))
    elapsed = time.monotonic() - started
    status = batch_status(pg_batched.database, db_schema, batch.id)
    assert (status.total, status.pending, status.state) == (count, count, "running"), elapsed


def test_a_child_whose_commit_fails_is_not_counted_done_its_death_fails_the_batch(
    pg_batched: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    # The count travels with the job's COMMIT (one round trip): a COMMIT that fails must take it along.
    db.execute(
        sql.SQL(
            "CREATE TABLE {parents} (id int PRIMARY KEY);"
            "CREATE TABLE {rows} (parent int REFERENCES {parents} DEFERRABLE INITIALLY DEFERRED)"
        ).format(parents=sql.Identifier(db_schema, "parents"), rows=sql.Identifier(db_schema, "rows"))
    )
    outcomes: list[str] = []

    @dramatiq.actor(queue_name="commit", broker=pg_batched)
    def child(n: int) -> None:
        # Passes every statement; its COMMIT fails the deferred foreign key (a permanent failure).
        job_connection().execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(db_schema, "rows")), (n,))

    @dramatiq.actor(queue_name="commit", broker=pg_batched)
    def after(outcome: str) -> None:
        outcomes.append(outcome)

    batch = Batch(callback=after.message("callback"), on_failure=after.message("on_failure"), broker=pg_batched)
    with pg_batched.transaction(), batch:
        batch.add(child.message(1))
    worker = dramatiq.Worker(pg_batched, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: outcomes, timeout_ms=30_000, message="the batch never finished")
    finally:
        worker.stop()
    assert outcomes == ["on_failure"], "the failed COMMIT took the 'done' count with it; the death failed the batch"
    status = batch_status(pg_batched.database, db_schema, batch.id)
    assert (status.done, status.dead, status.pending, status.state) == (0, 1, 0, "failed")


def test_a_plain_send_inside_with_batch_is_not_a_child(pg_batched: PostgresBroker, db_schema: str) -> None:
    @dramatiq.actor(queue_name="plain_inside", broker=pg_batched)
    def job(n: int) -> None:
        pass

    batch = Batch(callback=job.message(-1), broker=pg_batched)
    with pg_batched.transaction(), batch:
        child = batch.add(job.message(1))
        plain = job.send(2)  # documented: only batch.add makes a child
    assert child.options[BATCH_OPTION] == batch.id and BATCH_OPTION not in plain.options
    status = batch_status(pg_batched.database, db_schema, batch.id)
    assert (status.total, status.pending, status.state) == (1, 1, "running")


def test_a_child_is_counted_with_its_jobs_commit_not_in_a_statement_of_its_own(
    pg_batched: PostgresBroker, db_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One round trip fewer per child: the count rides on Idempotency's COMMIT (send_with_commit).
    own_statements: list[str] = []
    finish = Batches._finish

    def spy(self: Batches, broker: Any, message: Any, *, dead: bool, conn: Any) -> str:
        own_statements.append(message.message_id)
        return finish(self, broker, message, dead=dead, conn=conn)

    monkeypatch.setattr(Batches, "_finish", spy)
    fired: list[int] = []

    @dramatiq.actor(queue_name="with_commit", broker=pg_batched)
    def child(n: int) -> None:
        pass

    @dramatiq.actor(queue_name="with_commit", broker=pg_batched)
    def report() -> None:
        fired.append(batch_status(pg_batched.database, db_schema, batch.id).done)

    batch = Batch(callback=report.message(), broker=pg_batched)
    with pg_batched.transaction(), batch:
        for n in range(3):
            batch.add(child.message(n))
    worker = dramatiq.Worker(pg_batched, worker_timeout=20, worker_threads=2)
    worker.start()
    try:
        wait_for(lambda: fired, timeout_ms=30_000, message="the callback never ran")
    finally:
        worker.stop()
    assert fired == [3] and own_statements == [], "every child was counted in its COMMIT's round trip"
