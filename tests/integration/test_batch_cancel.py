"""Cancelling a batch against real Postgres: no callback, its unfinished children cancelled as jobs, no deadlock
with a child finishing at the same moment; and a finished child's job page links to its batch."""

from __future__ import annotations

import contextlib
import html as html_module
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Callbacks
from psycopg import sql
from starlette.testclient import TestClient

from dramatiq_reliable import ConfigurationError, Idempotency, JobNotFound, OutboxBroker, PostgresBroker, cancel_batch
from dramatiq_reliable.cli import main
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.web import Access, create_app
from dramatiq_reliable.workflows import Batch, Batches, batch_status

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    made = PostgresBroker(database=database_url, schema=db_schema)
    made.add_middleware(Idempotency(), before=Callbacks)
    made.add_middleware(Batches())
    dramatiq.set_broker(made)
    dramatiq.actor(lambda n: None, actor_name="child", queue_name="cancelling", broker=made)
    dramatiq.actor(lambda what: None, actor_name="after", queue_name="cancelling", broker=made)
    yield made
    made.close()


def _queued(db: psycopg.Connection[Any], schema: str, message_id: str, table: str = "queue") -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, table))
    row = db.execute(query, (message_id,)).fetchone()
    assert row is not None
    return int(row[0])


def _batch(broker: Any, children: int, **options: Any) -> tuple[Batch, list[Any]]:
    after = broker.actors["after"]
    batch = Batch(callback=after.message("callback"), on_failure=after.message("on_failure"), broker=broker, **options)
    with broker.transaction(), batch:
        sent = [batch.add(broker.actors["child"].message(n)) for n in range(children)]
    return batch, sent


def test_a_cancelled_batch_never_fires_and_its_unfinished_children_never_run(
    broker: PostgresBroker,
    db: psycopg.Connection[Any],
    db_schema: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    batch, sent = _batch(broker, 3)
    counter = Batches()
    assert counter._finish(broker, MessageProxy(sent[0]), dead=False, conn=None) == "counted"

    result = cancel_batch(broker.database, db_schema, batch.id, by="alice", reason="wrong month")
    assert (result.changed, result.state) == (True, "cancelled")
    assert sorted((job.message_id, job.outcome) for job in result.jobs) == sorted(
        (m.message_id, "queue") for m in sent[1:]
    ), "each pending child goes through the job cancel (deleted from the queue table)"
    assert [_queued(db, db_schema, m.message_id) for m in sent[1:]] == [0, 0]
    status = batch_status(broker.database, db_schema, batch.id)
    assert (status.state, status.done, status.pending, status.cancelled_by, status.cancel_reason) == (
        "cancelled",
        1,
        2,
        "alice",
        "wrong month",
    )
    # A child that finishes afterwards (it was running) is not counted and fires nothing;
    # neither the callback nor on_failure is ever written.
    assert counter._finish(broker, MessageProxy(sent[1]), dead=False, conn=None) == "duplicate"
    assert counter._finish(broker, MessageProxy(sent[2]), dead=True, conn=None) == "duplicate"
    assert _queued(db, db_schema, batch.callback.message_id) == 0
    assert batch.on_failure is not None and _queued(db, db_schema, batch.on_failure.message_id) == 0
    with pytest.raises(ConfigurationError, match="was cancelled; start a new Batch"), broker.transaction():
        batch.add(broker.actors["child"].message(9))

    again = cancel_batch(broker.database, db_schema, batch.id, by="bob")
    assert (again.changed, again.state, again.jobs) == (False, "cancelled", ())
    with pytest.raises(JobNotFound, match="no batch 'no-such-batch'"):
        cancel_batch(broker.database, db_schema, "no-such-batch", by="alice")
    with pytest.raises(ConfigurationError, match="by"):
        cancel_batch(broker.database, db_schema, batch.id, by="")

    cli = ["--database-url", database_url, "--schema", db_schema]
    finished, _ = _batch(broker, 0)  # empty: fired at its seal
    assert main(["batches", "cancel", finished.id, "--yes", "--json", *cli]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "id": finished.id,
        "changed": False,
        "state": "succeeded",
        "jobs": [],
    }
    open_one = Batch(callback=broker.actors["after"].message("x"), broker=broker)
    with broker.transaction():
        open_one.add(broker.actors["child"].message(1))
    assert main(["batches", "cancel", open_one.id, "--yes", "--by", "carol", *cli]) == 0
    assert "cancelled; its callback never fires, 1 unfinished child(ren) cancelled" in capsys.readouterr().out
    assert main(["batches", "show", open_one.id, *cli]) == 0
    assert "by carol at" in capsys.readouterr().out
    assert main(["batches", "cancel", "no-such-batch", "--yes", *cli]) == 7


def test_on_an_outbox_broker_the_unpublished_children_are_deleted_from_the_outbox(
    database_url: str, db_schema: str, rabbitmq_url: str, queue_name: str, db: psycopg.Connection[Any]
) -> None:
    outbox = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema)  # no relay: nothing published
    try:
        outbox.add_middleware(Batches())
        dramatiq.actor(lambda n: None, actor_name="child", queue_name=queue_name, broker=outbox)
        dramatiq.actor(lambda what: None, actor_name="after", queue_name=queue_name, broker=outbox)
        batch, sent = _batch(outbox, 2)
        result = cancel_batch(outbox.database, db_schema, batch.id, by="alice")
        assert sorted(job.outcome for job in result.jobs) == ["outbox", "outbox"]
        assert [_queued(db, db_schema, m.message_id, "outbox") for m in sent] == [0, 0]
        assert Batches()._finish(outbox, MessageProxy(sent[1]), dead=False, conn=None) == "duplicate"
        assert _queued(db, db_schema, batch.callback.message_id, "outbox") == 0
    finally:
        outbox.close()


def test_a_child_finishing_during_the_cancel_is_not_waited_for_and_fires_nothing_after_it(
    broker: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    batch, (last,) = _batch(broker, 1)
    counter = Batches()
    results: list[Any] = []
    with broker.database.connection() as job, job.transaction():
        # The child's finish has taken its own row's lock (as batch_finish's first statement
        # does); a cancel waiting for it while holding the batch's row would deadlock with it.
        job.execute(
            sql.SQL("SELECT 1 FROM {} WHERE message_id = %s FOR UPDATE").format(
                sql.Identifier(db_schema, "batch_children")
            ),
            (last.message_id,),
        )
        canceller = threading.Thread(
            target=lambda: results.append(cancel_batch(broker.database, db_schema, batch.id, by="alice"))
        )
        canceller.start()
        wait_for(lambda: results, message="the cancel waited for the finishing child's row")
        # The child was the last one: without the cancel it would fire the callback here.
        assert counter._finish(broker, MessageProxy(last), dead=False, conn=job) == "counted"
    canceller.join(timeout=30)
    assert (results[0].changed, results[0].jobs) == (True, ())
    assert _queued(db, db_schema, batch.callback.message_id) == 0, "a child finishing after the cancel fired it"
    status = batch_status(broker.database, db_schema, batch.id)
    assert (status.state, status.done, status.pending) == ("cancelled", 1, 0)


def test_a_cancel_waits_for_the_child_firing_the_batch_then_changes_nothing(
    broker: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    batch, (last,) = _batch(broker, 1)
    results: list[Any] = []
    with broker.database.connection() as job, job.transaction():
        assert Batches()._finish(broker, MessageProxy(last), dead=False, conn=job) == "fired"
        canceller = threading.Thread(
            target=lambda: results.append(cancel_batch(broker.database, db_schema, batch.id, by="alice"))
        )
        canceller.start()
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    (f'%Cancel a batch%"{db_schema}".batches%',),
                ).fetchone()
                == (1,)
            ),
            message="the cancel did not wait for the batch's row",
        )
        assert not results
    canceller.join(timeout=30)
    assert (results[0].changed, results[0].state) == (False, "succeeded")
    assert _queued(db, db_schema, batch.callback.message_id) == 1, "the callback, sent before the cancel, stands"


def read_only(request: Any) -> Access:
    return Access("read", user="bob")


def full(request: Any) -> Access:
    return Access("full", user="ann")


def cell(page: str, testid: str) -> str:
    match = re.search(rf'<(\w+)[^>]*data-testid="{re.escape(testid)}"[^>]*>(.*?)</\1>', page, re.S)
    assert match, f"no {testid!r} in the page"
    return " ".join(html_module.unescape(re.sub(r"<[^>]+>", "", match.group(2))).split())


def test_the_batch_page_cancels_with_a_confirmation_under_the_access_rules_and_a_done_child_links_back(
    broker: PostgresBroker, db_schema: str
) -> None:
    # A child runs to the end on a real worker: its queue row is gone, its page still links to its batch.
    finished, (child,) = _batch(broker, 1)
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        wait_for(lambda: batch_status(broker.database, db_schema, finished.id).done == 1, timeout_ms=30_000)
    finally:
        worker.stop()
    assert _queued_by(broker, db_schema, child.message_id) == 0
    batch, _ = _batch(broker, 2, id="invoices/<b>2026-11</b>")
    with contextlib.ExitStack() as opened:
        client = opened.enter_context(
            TestClient(create_app(broker=broker, access=full), client=("127.0.0.1", 50000), base_url="http://localhost")
        )
        job = client.get("/jobs/show", params={"id": child.message_id})
        assert job.status_code == 200
        assert cell(job.text, "job-batch") == f"batch {finished.id} (this job is one of its children, counted done)"

        looking = opened.enter_context(
            TestClient(
                create_app(broker=broker, access=read_only), client=("127.0.0.1", 50000), base_url="http://localhost"
            )
        )
        page = looking.get("/batches/show", params={"id": batch.id}).text
        assert 'data-testid="batch-cancel-read-only"' in page and 'data-testid="batch-cancel-form"' not in page
        assert looking.post("/batches/cancel", data={"id": batch.id, "confirm": "1"}).status_code == 403
        assert batch_status(broker.database, db_schema, batch.id).state != "cancelled"

        page = client.get("/batches/show", params={"id": batch.id}).text
        assert 'data-testid="batch-cancel-form"' in page
        confirm = client.post("/batches/cancel", data={"id": batch.id})
        assert confirm.status_code == 200 and "pending children is cancelled as a job" in cell(
            confirm.text, "batch-cancel-effect"
        )
        assert batch_status(broker.database, db_schema, batch.id).state != "cancelled", "the first POST only asks"
        done_post = client.post(
            "/batches/cancel", data={"id": batch.id, "confirm": "1", "reason": "wrong month"}, follow_redirects=False
        )
        assert done_post.status_code == 303
        shown = client.get(done_post.headers["location"]).text
        assert cell(shown, "batch-state") == "cancelled" and cell(shown, "batch-cancelled-by") == "web:ann"
        assert "wrong month" in cell(shown, "batch-cancelled") and 'data-testid="batch-cancel-form"' not in shown
        assert client.post("/batches/cancel", data={"id": "no-such-batch", "confirm": "1"}).status_code == 404
        assert client.post("/batches/cancel", data={"id": "x" * 201}).status_code == 400


def _queued_by(broker: PostgresBroker, schema: str, message_id: str) -> int:
    with broker.database.connection() as conn:
        return _queued(conn, schema, message_id)
