"""OutboxBroker's join() and flush() count the outbox: a message is in its queue from the moment its row commits.

Users' tests call ``broker.join(queue)`` and ``broker.flush_all()`` as with Dramatiq's RabbitMQ
broker; these hold whether or not a relay has published the rows yet.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.errors import QueueJoinTimeout
from support import Rabbit, running

from dramatiq_reliable import OutboxBroker, Relay, SchemaNotReady
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


def _actor(broker: OutboxBroker, queue_name: str, fn: Any = None) -> dramatiq.Actor[Any, Any]:
    def noop(*args: Any) -> None:
        return None

    return dramatiq.actor(fn or noop, actor_name=f"{queue_name}_actor", queue_name=queue_name, broker=broker)


def _unpublished(db: psycopg.Connection[Any], db_schema: str) -> list[str]:
    return [
        row[0]
        for row in db.execute(
            psycopg.sql.SQL("SELECT queue_name FROM {} WHERE published_at IS NULL ORDER BY id").format(
                psycopg.sql.Identifier(db_schema, "outbox")
            )
        )
    ]


def _published(db: psycopg.Connection[Any], db_schema: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NOT NULL").format(
        psycopg.sql.Identifier(db_schema, "outbox")
    )
    row = db.execute(query).fetchone()
    return int(row[0]) if row else 0


def test_join_takes_the_rabbitmq_brokers_arguments() -> None:
    ours = inspect.signature(OutboxBroker.join).parameters
    theirs = inspect.signature(RabbitmqBroker.join).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_join_times_out_while_the_queues_rows_wait_for_a_relay(broker: OutboxBroker, queue_name: str) -> None:
    task = _actor(broker, queue_name)
    task.send(1)
    started = time.monotonic()
    with pytest.raises(QueueJoinTimeout):
        broker.join(queue_name, timeout=1500)
    assert time.monotonic() - started >= 1.5


def test_join_counts_a_delayed_messages_row_for_the_delay_queue(broker: OutboxBroker, queue_name: str) -> None:
    task = _actor(broker, queue_name)
    task.send_with_options(args=(1,), delay=3_600_000)
    with pytest.raises(QueueJoinTimeout):
        broker.join(queue_name, min_successes=1, idle_time=10, timeout=500)


def test_join_returns_once_a_relay_published_and_a_worker_consumed_every_message(
    broker: OutboxBroker, queue_name: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    ran: list[int] = []
    task = _actor(broker, queue_name, fn=ran.append)
    with broker.transaction():
        for n in range(20):
            task.send(n)
    worker.start()
    relay = Relay.from_broker(broker, poll_interval_ms=50)
    with running(relay.run, relay.stop):
        broker.join(queue_name, timeout=30_000)
        worker.join()
        assert sorted(ran) == list(range(20))
        assert _unpublished(db, db_schema) == [] and _published(db, db_schema) == 20


def test_flush_drops_the_queues_unpublished_rows_and_keeps_published_ones_and_other_queues(
    broker: OutboxBroker, queue_name: str, rabbit: Rabbit, db: psycopg.Connection[Any], db_schema: str
) -> None:
    other_queue = f"{queue_name}_other"
    task, other = _actor(broker, queue_name), _actor(broker, other_queue)
    task.send(0)
    assert drain_outbox(broker) == 1  # published: in RabbitMQ, its row kept for audit
    task.send(1)
    task.send_with_options(args=(2,), delay=3_600_000)
    other.send(3)
    # The delayed message waits in the outbox, addressed to its queue, until due.
    assert _unpublished(db, db_schema) == [queue_name, queue_name, other_queue]

    broker.flush(queue_name)
    assert _unpublished(db, db_schema) == [other_queue]
    assert _published(db, db_schema) == 1
    assert rabbit.count(queue_name) == 0
    broker.join(queue_name, min_successes=1, timeout=5000)  # nothing left to wait for

    broker.flush_all()
    assert _unpublished(db, db_schema) == []
    assert _published(db, db_schema) == 1
    assert drain_outbox(broker) == 0


def test_flush_while_a_relay_publishes_leaves_nothing_behind_in_either_place(
    broker: OutboxBroker, queue_name: str, rabbit: Rabbit, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(broker, queue_name)
    with broker.transaction():
        for n in range(2000):
            task.send(n)
    relay = Relay.from_broker(broker, batch_size=50, poll_interval_ms=50)
    with running(relay.run, relay.stop):
        wait_for(lambda: _published(db, db_schema) > 0, timeout_ms=30_000, message="the relay published nothing")
        broker.flush(queue_name)
        # Rows the relay held were waited for and then purged from RabbitMQ; the rest were deleted.
        assert _unpublished(db, db_schema) == []
        assert rabbit.count(queue_name) == 0


def test_join_and_flush_on_an_unmigrated_schema_name_the_migrate_command(
    rabbitmq_url: str, database_url: str, unmigrated_schema: str, queue_name: str
) -> None:
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=unmigrated_schema)
    try:
        broker.declare_queue(queue_name)
        with pytest.raises(SchemaNotReady, match="dramatiq-reliable migrate --schema"):
            broker.join(queue_name, timeout=1000)
        with pytest.raises(SchemaNotReady, match="dramatiq-reliable migrate --schema"):
            broker.flush_all()
    finally:
        broker.close()
