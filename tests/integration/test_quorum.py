"""Quorum queues on the machine's RabbitMQ node: declared by workers and relays alike, refusals that explain."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import dramatiq
import pika
import psycopg
import pytest
from dramatiq.common import dq_name, xq_name
from support import vhost_of

from dramatiq_reliable import OutboxBroker, PayloadError, QueueMismatch
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def quorum_broker(rabbitmq_url, database_url, db_schema):
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, queue_type="quorum")
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def _refusal(rabbitmq_url: str, queue: str, arguments: dict[str, Any] | None) -> str | None:
    """RabbitMQ's answer to declaring ``queue`` with ``arguments``: ``None`` if it agreed."""
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        connection.channel().queue_declare(queue, durable=True, arguments=arguments, passive=False)
        return None
    except pika.exceptions.ChannelClosedByBroker as error:
        return str(error.reply_text)
    finally:
        if connection.is_open:
            connection.close()


def _is_quorum(rabbitmq_url: str, queue: str) -> bool:
    """Whether the machine's node holds ``queue`` as a quorum queue, in the URL's vhost (rabbitmqctl, read-only)."""
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost_of(rabbitmq_url), "name", "type", "--formatter", "json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    types = {row["name"]: row["type"] for row in json.loads(listed.stdout)}
    return types.get(queue) == "quorum"


def test_quorum_broker_and_relay_declare_quorum_queues_and_messages_flow(quorum_broker, queue_name, rabbitmq_url):
    done: list[int] = []
    task = dramatiq.actor(done.append, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=quorum_broker)
    with quorum_broker.transaction():
        for i in range(20):
            task.send(i)
    assert drain_outbox(quorum_broker) == 20  # the relay's publisher declares the queues
    assert all(_is_quorum(rabbitmq_url, name) for name in (queue_name, dq_name(queue_name), xq_name(queue_name)))
    worker = dramatiq.Worker(quorum_broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        wait_for(lambda: len(done) == 20, message="the worker consumes from the quorum queue")
    finally:
        worker.stop()
    assert sorted(done) == list(range(20))


def test_queue_types_make_one_queue_quorum_and_leave_the_others_classic(
    rabbitmq_url, database_url, db_schema, queue_name
):
    other = f"{queue_name}_classic"
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, queue_types={queue_name: "quorum"})
    try:
        broker.declare_queue(queue_name, ensure=True)
        broker.declare_queue(other, ensure=True)
    finally:
        broker.close()
    assert _is_quorum(rabbitmq_url, queue_name)
    assert not _is_quorum(rabbitmq_url, other)
    assert (
        _refusal(rabbitmq_url, other, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": xq_name(other)})
        is None
    )


def test_a_send_with_a_priority_to_a_quorum_queue_is_refused_before_anything_is_written(
    quorum_broker, queue_name, db, db_schema
):
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_p", queue_name=queue_name, broker=quorum_broker)
    with pytest.raises(PayloadError, match="is a quorum queue, which has no priorities") as caught:
        task.send_with_options(broker_priority=3)
    assert "drop broker_priority" in str(caught.value)
    task.send()  # without a priority it goes
    rows = db.execute(psycopg.sql.SQL("SELECT count(*) FROM {}.outbox").format(psycopg.sql.Identifier(db_schema)))
    assert rows.fetchone() == (1,)


def test_a_queue_declared_with_the_other_type_raises_queue_mismatch_naming_both_and_the_move(
    quorum_broker, queue_name, rabbitmq_url, db, db_schema
):
    # An existing classic deployment: Dramatiq's own declaration.
    classic = dramatiq.brokers.rabbitmq.RabbitmqBroker(url=rabbitmq_url, middleware=[])
    try:
        classic.declare_queue(queue_name, ensure=True)
    finally:
        classic.close()
    with pytest.raises(QueueMismatch) as caught:
        quorum_broker.declare_queue(queue_name, ensure=True)
    message = str(caught.value)
    assert f"queue {queue_name!r} exists in RabbitMQ as a classic queue but this broker declares it quorum" in message
    assert "production-topology.md" in message and "drain" in message
    assert isinstance(caught.value.__cause__, pika.exceptions.ChannelClosedByBroker)
    # The relay keeps the rows and says why.
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_m", queue_name=queue_name, broker=quorum_broker)
    task.send()
    assert drain_outbox(quorum_broker) == 0
    (error,) = db.execute(
        psycopg.sql.SQL("SELECT last_error FROM {}.outbox").format(psycopg.sql.Identifier(db_schema))
    ).fetchone()
    assert "QueueMismatch" in error and "as a classic queue" in error
    # The broker's channel is usable again after RabbitMQ closed it.
    assert quorum_broker.channel.is_open


def test_moving_a_classic_queue_to_quorum_with_messages_in_flight_loses_none(
    rabbitmq_url, database_url, db_schema, queue_name, rabbit
):
    """The procedure of docs/production-topology.md, step by step, while sends keep coming."""
    ran: list[int] = []

    def job(n: int) -> None:
        ran.append(n)

    old = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema)
    new = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, queue_type="quorum")
    for broker in (old, new):
        dramatiq.actor(job, actor_name=f"{queue_name}_job", queue_name=queue_name, broker=broker)
    try:
        # Before: a classic deployment with a backlog in RabbitMQ.
        with old.transaction():
            for n in range(40):
                old.actors[f"{queue_name}_job"].send(n)
        assert drain_outbox(old) == 40
        old_worker = dramatiq.Worker(old, worker_timeout=100, worker_threads=1)
        old_worker.start()
        try:
            # 1. The relays are stopped; the new code's sends wait in the outbox, not lost, not published.
            with new.transaction():
                for n in range(40, 80):
                    new.actors[f"{queue_name}_job"].send(n)
            # 2. The old workers drain the classic queue (and its .DQ: the longest delay).
            wait_for(
                lambda: len(ran) == 40 and rabbit.count(queue_name) == 0 and rabbit.count(dq_name(queue_name)) == 0,
                timeout_ms=30_000,
                message="the old workers drain the classic queue",
            )
        finally:
            old_worker.stop()
        # 3. Delete the drained queues (RabbitMQ refuses if one is not empty); .XQ was imported first.
        channel = rabbit.channel
        channel.queue_delete(queue_name, if_empty=True)
        channel.queue_delete(dq_name(queue_name), if_empty=True)
        channel.queue_delete(xq_name(queue_name))
        # 4. New relays and workers declare the quorum queue and carry on.
        assert drain_outbox(new) == 40
        assert _is_quorum(rabbitmq_url, queue_name)
        new_worker = dramatiq.Worker(new, worker_timeout=100, worker_threads=2)
        new_worker.start()
        try:
            wait_for(lambda: len(ran) == 80, timeout_ms=30_000, message="the new workers run the waiting sends")
        finally:
            new_worker.stop()
    finally:
        old.close()
        new.close()
    assert sorted(ran) == list(range(80))
