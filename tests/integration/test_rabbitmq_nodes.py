"""The tests' own RabbitMQ nodes behave as the cluster and timeout tests rely on."""

from __future__ import annotations

import time

import pika
import pytest
from rabbitmq_nodes import RabbitCluster, RabbitNode

from dramatiq_reliable.testing import wait_for


def _channel(url: str) -> tuple[pika.BlockingConnection, pika.adapters.blocking_connection.BlockingChannel]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    return connection, connection.channel()


def test_a_quorum_queue_outlives_the_loss_of_its_leader(healed_cluster: RabbitCluster, queue_name: str) -> None:
    """Published through one node, the message is read through another after the leader is killed."""
    first, _second, third = healed_cluster.nodes
    connection, channel = _channel(first.url)
    channel.queue_declare(queue_name, durable=True, arguments={"x-queue-type": "quorum"})
    channel.confirm_delivery()
    channel.basic_publish("", queue_name, b"kept", pika.BasicProperties(delivery_mode=2))
    leader_name = next(
        line.split("\t")[1]
        for line in first.ctl("list_queues", "name", "leader").splitlines()
        if line.startswith(queue_name)
    )
    connection.close()

    leader = healed_cluster.node_named(leader_name)
    leader.kill()
    reader = next(node for node in healed_cluster.nodes if node is not leader)

    def read() -> bytes | None:
        try:
            connection, channel = _channel(reader.url)
        except pika.exceptions.AMQPError:
            return None
        try:
            method, _properties, body = channel.basic_get(queue_name, auto_ack=True)
            return body if method is not None else None
        except pika.exceptions.AMQPError:
            return None  # no leader yet: the election is under way
        finally:
            if connection.is_open:
                connection.close()

    assert wait_for(read, timeout_ms=30_000, message="the message never came back after the leader died") == b"kept"
    healed_cluster.heal()
    assert {node.running for node in healed_cluster.nodes} == {True}
    assert third.ctl("eval", "length(rabbit_nodes:all_running()).").strip() == "3"


def test_the_short_timeout_node_closes_a_channel_that_holds_a_delivery(
    rabbitmq_short_timeout_node: RabbitNode, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A delivery left unacked past 3 s has its channel closed with PRECONDITION_FAILED within seconds."""
    connection, channel = _channel(rabbitmq_short_timeout_node.url)
    try:
        channel.queue_declare(queue_name, durable=True)
        channel.basic_publish("", queue_name, b"held")
        method, _properties, _body = channel.basic_get(queue_name, auto_ack=False)
        assert method is not None
        started = time.monotonic()

        def closed() -> bool:
            connection.process_data_events(time_limit=0.2)
            return bool(channel.is_closed)

        wait_for(closed, timeout_ms=30_000, message="the node never closed the channel holding a delivery")
        assert time.monotonic() - started >= 2.5
        assert "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out" in caplog.text
    finally:
        if connection.is_open:
            connection.close()
