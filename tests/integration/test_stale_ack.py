"""Acks belong to the channel that delivered the message: a late ack never removes another message.

Dramatiq 2.2.1's RabbitMQ consumer acks by delivery tag on whatever channel is current.  After a
channel close (RabbitMQ's ``consumer_timeout``, here forced by acking an unknown tag, which
RabbitMQ answers the same way: ``PRECONDITION_FAILED`` and the channel is gone) the consumer
reconnects and tags restart at 1, so the long job's late ack lands on a different message of the
new channel.  If the worker then dies before running that message, it is gone for good.
"""

from __future__ import annotations

import threading
from collections import Counter
from functools import partial
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware
from support import Rabbit

from dramatiq_reliable.outbox import Delivery, OutboxBroker, delivery_of
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def publish(broker: OutboxBroker, message: dramatiq.Message[Any]) -> None:
    """Straight to RabbitMQ (no outbox, no relay): the test is about the consuming side only."""
    RabbitmqBroker.enqueue(broker, message)


def close_consumer_channel(worker: dramatiq.Worker, queue_name: str) -> Any:
    """Make RabbitMQ close the consumer's channel, as ``consumer_timeout`` does; the old consumer."""
    consumer = worker.consumers[queue_name].consumer
    assert consumer is not None
    # An ack of a tag the channel never delivered is a channel error: RabbitMQ closes the channel.
    consumer.connection.add_callback_threadsafe(partial(consumer.channel.basic_ack, 10_000))
    return consumer


class _Deliveries(Middleware):
    """Records what each delivery of the long job knew, as any middleware can ask."""

    def __init__(self, seen: list[Delivery | None]) -> None:
        self.seen = seen

    def before_process_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        if message.args == ("long",):
            self.seen.append(delivery_of(message))


def test_a_late_ack_after_a_channel_close_never_removes_another_message(
    broker: OutboxBroker, queue_name: str, rabbit: Rabbit
) -> None:
    runs: Counter[str] = Counter()
    deliveries: list[Delivery | None] = []
    first_started, first_release = threading.Event(), threading.Event()
    copy_started, copy_release = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"job_{queue_name}", max_retries=0)
    def job(kind: str) -> None:
        runs[kind] += 1
        if kind == "long" and runs[kind] == 1:
            first_started.set()
            first_release.wait(20)
        elif kind == "long":
            copy_started.set()
            copy_release.wait(20)

    broker.add_middleware(_Deliveries(deliveries))
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    second: dramatiq.Worker | None = None
    worker.start()
    try:
        publish(broker, job.message("warmup"))  # tag 1 on the first channel
        wait_for(lambda: runs["warmup"] == 1, message="the warm-up job ran")
        publish(broker, job.message("long"))  # tag 2 on the first channel
        assert first_started.wait(10), "the long job started"

        old = close_consumer_channel(worker, queue_name)
        consumers = worker.consumers[queue_name]
        # RabbitMQ redelivers the long job on the new channel (tag 1); the thread is still busy.
        wait_for(
            lambda: consumers.consumer is not old and worker.work_queue.qsize() == 1,
            message="the long job was redelivered on a new channel",
        )
        publish(broker, job.message("other"))  # tag 2 on the new channel
        wait_for(lambda: worker.work_queue.qsize() == 2, message="the other message was delivered")

        first_release.set()  # the first run ends: its ack (tag 2 of the old channel) must go nowhere
        assert copy_started.wait(10), "the redelivered long job started"

        # The worker dies before reaching "other": stop the thread, finish the copy, shut down.
        for thread in worker.workers:
            thread.stop()
        copy_release.set()
        worker.stop(timeout=10_000)

        second = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        second.start()
        wait_for(lambda: runs["other"] >= 1, message="the other message survived the stale ack and ran")
        wait_for(lambda: rabbit.count(queue_name) == 0, message="nothing left in the queue")
        # What the two deliveries of the long job knew: the same tag-number space, different channels.
        first, copy = deliveries
        assert first is not None and copy is not None
        assert (first.redelivered, copy.redelivered) == (False, True)
        assert first.channel_id != copy.channel_id and first.queue_name == queue_name
        assert (first.delivery_count, copy.delivery_count) == (None, None)  # a classic queue has none
    finally:
        first_release.set()
        copy_release.set()
        worker.stop(timeout=10_000)
        if second is not None:
            second.stop(timeout=10_000)
