"""Order per key, parked at send (migration 22): a job that is not its key's head never reaches the
broker until its turn, and the sender's commit cannot miss a head that finished meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Callbacks, Middleware
from psycopg import sql

from dramatiq_reliable import OutboxBroker, PostgresBroker, WorkerRelay
from dramatiq_reliable.flow import OrderedKeys
from dramatiq_reliable.jobs import show_job
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


class _Deliveries(Middleware):
    """Counts every delivery a worker takes in hand, parked or run."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._lock = threading.Lock()

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        with self._lock:
            self.ids.append(message.message_id)


@pytest.fixture(params=["postgres", "outbox"])
def ordered(request: pytest.FixtureRequest, database_url: str, db_schema: str) -> Iterator[Any]:
    if request.param == "postgres":
        broker: Any = PostgresBroker(database=database_url, schema=db_schema, lease_ms=2000, poll_interval_ms=20)
    else:
        broker = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
        broker.add_middleware(WorkerRelay(poll_interval_ms=20))
    broker.add_middleware(_Deliveries(), before=Callbacks)
    broker.add_middleware(OrderedKeys(lease_ms=1000), before=Callbacks)
    yield broker
    broker.close()


@pytest.fixture
def queue(ordered: Any, request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("queue_name")) if isinstance(ordered, OutboxBroker) else "ordered"


@pytest.fixture
def worker(ordered: Any) -> Iterator[dramatiq.Worker]:
    instance = dramatiq.Worker(ordered, worker_timeout=50, worker_threads=4)
    yield instance
    instance.stop()


def _table(ordered: Any, schema: str) -> sql.Identifier:
    return sql.Identifier(schema, "queue" if isinstance(ordered, PostgresBroker) else "outbox")


def _written(db: psycopg.Connection[Any], ordered: Any, schema: str) -> list[str]:
    query = sql.SQL("SELECT message_id FROM {} ORDER BY message_id").format(_table(ordered, schema))
    return [row[0] for row in db.execute(query).fetchall()]


def _places(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, str, bool, bool]]:
    query = sql.SQL("SELECT message_id, state, body IS NOT NULL, held_by IS NOT NULL FROM {} ORDER BY seq").format(
        sql.Identifier(schema, "order_jobs")
    )
    return [tuple(row) for row in db.execute(query).fetchall()]  # type: ignore[misc]


def test_only_each_keys_head_is_written_to_the_broker_and_every_job_is_delivered_once(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[tuple[str, int]] = []
    step = dramatiq.actor(
        lambda key, n: runs.append((key, n)),
        actor_name="step",
        queue_name=queue,
        broker=ordered,
        order_key=lambda k, n: k,
    )
    with ordered.transaction():
        sent = [step.send(key, n) for n in range(3) for key in ("a", "b")]
    heads = sorted(message.message_id for message in sent[:2])
    assert _written(db, ordered, db_schema) == heads, "a job behind its key's head was written to the broker"
    assert _places(db, db_schema) == [
        (message.message_id, "waiting" if n < 2 else "parked", n >= 2, False) for n, message in enumerate(sent)
    ]
    worker.start()
    wait_for(lambda: len(runs) == 6, message=f"not every job ran: {runs}")
    for key in ("a", "b"):
        assert [n for k, n in runs if k == key] == [0, 1, 2]
    deliveries = next(m for m in ordered.middleware if isinstance(m, _Deliveries)).ids
    assert sorted(deliveries) == sorted(message.message_id for message in sent), "a job was delivered twice"
    wait_for(lambda: not _places(db, db_schema), message="places left behind")


@pytest.mark.parametrize("head_finishes", ["before the sender commits", "after the sender commits"])
def test_a_job_parked_at_send_runs_whether_its_head_finished_before_or_after_the_senders_commit(
    ordered: Any,
    queue: str,
    worker: dramatiq.Worker,
    db: psycopg.Connection[Any],
    db_schema: str,
    head_finishes: str,
) -> None:
    started, finish = threading.Event(), threading.Event()
    runs: list[int] = []

    def job(n: int) -> None:
        if n == 0:
            started.set()
            assert finish.wait(30)
        runs.append(n)

    step = dramatiq.actor(job, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    head = step.send(0)
    worker.start()
    assert started.wait(30), "the head never ran"
    with ordered.transaction():
        second = step.send(1)  # its head runs: parked at send, not written
        assert second.message_id not in _written(db, ordered, db_schema)
        if head_finishes == "before the sender commits":
            # The head's release cannot see the uncommitted job: the sender's commit must send it.
            finish.set()
            wait_for(
                lambda: head.message_id not in [place[0] for place in _places(db, db_schema)],
                message="the head was never released",
            )
    finish.set()
    wait_for(lambda: runs == [0, 1], message=f"the job parked at send never ran: {runs}")
    wait_for(lambda: not _places(db, db_schema), message="places left behind")


def test_a_send_under_repeatable_read_is_written_to_the_broker_and_still_runs_in_order(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[int] = []
    step = dramatiq.actor(runs.append, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction() as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        sent = [step.send(n) for n in range(3)]
    # Its commit could not see a release that committed meanwhile: every job goes to the broker.
    assert _written(db, ordered, db_schema) == sorted(message.message_id for message in sent)
    worker.start()
    wait_for(lambda: runs == [0, 1, 2], message=f"out of order or lost: {runs}")


def test_on_a_schema_below_version_22_an_ordered_job_is_written_and_parks_when_delivered_early(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    middleware = next(m for m in ordered.middleware if isinstance(m, OrderedKeys))
    middleware._parks_at_send = False  # what a schema at version 20 or 21 answers
    runs: list[int] = []
    step = dramatiq.actor(runs.append, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction():
        sent = [step.send(n) for n in range(4)]
    assert _written(db, ordered, db_schema) == sorted(message.message_id for message in sent)
    worker.start()
    wait_for(lambda: runs == [0, 1, 2, 3], message=f"out of order or lost: {runs}")
    wait_for(lambda: not _places(db, db_schema), message="places left behind")


def test_a_send_refused_by_a_later_hook_leaves_no_diverted_write_for_the_next_send(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    class Refuse(Middleware):
        refuse = True

        def before_enqueue(self, broker: Broker, message: Any, delay: int | None) -> None:
            if self.refuse and message.actor_name == "step":
                raise dramatiq.middleware.MiddlewareError("refused")

    refuse = Refuse()
    ordered.add_middleware(refuse)
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    plain = dramatiq.actor(lambda n: None, actor_name="plain", queue_name=queue, broker=ordered)
    with pytest.raises(dramatiq.middleware.MiddlewareError), ordered.transaction():
        step.send(0)
    with ordered.transaction():
        sent = plain.send(1)
    assert _written(db, ordered, db_schema) == [sent.message_id], "the plain send took the refused send's write"
    assert _places(db, db_schema) == []


def test_jobs_show_says_a_parked_job_waits_for_its_turn_and_which_job_holds_its_key(
    ordered: Any, queue: str, db_schema: str
) -> None:
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction():
        head, _, third = (step.send(n) for n in range(3))
    status = show_job(ordered.database, db_schema, third.message_id)
    assert status.state == "waiting"
    assert status.actor_name == "step"
    assert "order key 'k': 2 job(s) ahead" in status.detail
    assert head.message_id in status.detail
