"""What a delivery knows: the x-delivery-count header read safely, and no Delivery for messages not consumed."""

from __future__ import annotations

from types import SimpleNamespace

import dramatiq
from dramatiq.broker import MessageProxy

from dramatiq_reliable.outbox import delivery_of
from dramatiq_reliable.outbox.consumer import _delivery_count, ack_now


def test_the_delivery_count_is_the_quorum_header_when_it_is_a_count() -> None:
    assert _delivery_count(SimpleNamespace(headers={"x-delivery-count": 3})) == 3
    assert _delivery_count(SimpleNamespace(headers=None)) is None  # a first delivery, or a classic queue
    assert _delivery_count(SimpleNamespace(headers={"x-delivery-count": "3"})) is None
    assert _delivery_count(SimpleNamespace(headers={"x-delivery-count": True})) is None
    assert _delivery_count(None) is None


def test_a_message_no_channel_bound_consumer_delivered_has_no_delivery_and_cannot_be_acked_early() -> None:
    message = dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    assert delivery_of(message) is None
    assert delivery_of(MessageProxy(message)) is None
    assert ack_now(MessageProxy(message)) is False
