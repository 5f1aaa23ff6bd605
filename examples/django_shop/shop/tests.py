"""The shop's own tests, run by ``manage.py test shop`` on Django's test database.

They send inside the view's ``atomic()``: a declined card rolls the order and its message
back; a paid order leaves one message, which a real Dramatiq worker (and, with the outbox,
a relay) turns into exactly one receipt, even when the job fails once after its ORM write.
``TransactionTestCase``, not ``TestCase``: a ``TestCase`` wraps each test in a transaction that
never commits, so the worker would never see the message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dramatiq
from django.db import connection
from django.test import TransactionTestCase
from psycopg import sql

from dramatiq_reliable import OutboxBroker, Relay
from dramatiq_reliable.django import get_broker, reliable_settings

from .models import Order
from .tasks import FAIL_ONCE


def receipt_messages(order_id: int) -> list[str]:
    """The ids of the receipt messages waiting for ``order_id`` (queue rows, or outbox rows)."""
    table = "outbox" if reliable_settings().broker == "outbox" else "queue"
    query = sql.SQL(
        "SELECT message_id FROM {} WHERE actor_name = 'send_receipt' "
        "AND convert_from(body, 'UTF8')::jsonb -> 'args' ->> 0 = %s"
    ).format(sql.Identifier(reliable_settings().schema, table))
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(connection.connection), [str(order_id)])
        return [row[0] for row in cursor.fetchall()]


def committed(message_id: str) -> bool:
    """Whether the job of ``message_id`` committed: its idempotency key is stored with its writes."""
    query = sql.SQL("SELECT count(*) FROM {} WHERE actor_name = 'send_receipt' AND message_id = %s").format(
        sql.Identifier(reliable_settings().schema, "processed_jobs")
    )
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(connection.connection), [message_id])
        return int(cursor.fetchone()[0]) == 1


def wait_for(condition: Callable[[], bool], message: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.05)


@contextmanager
def worker(broker: dramatiq.Broker | None = None) -> Iterator[None]:
    """A Dramatiq worker thread on ``broker`` (the app's), and the relay when the broker is the outbox."""
    broker = broker or get_broker()
    relay = Relay.from_broker(broker) if isinstance(broker, OutboxBroker) else None
    relay_thread = threading.Thread(target=relay.run, daemon=True) if relay else None
    if relay_thread:
        relay_thread.start()
    running = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    running.start()
    try:
        yield
    finally:
        running.stop()
        if relay and relay_thread:
            relay.stop()
            relay_thread.join(timeout=30)


class PlaceOrderTests(TransactionTestCase):
    def test_a_declined_card_rolls_back_the_order_and_its_message(self) -> None:
        before = Order.objects.count()
        response = self.client.post("/orders/", {"item": "lamp", "card": "declined"})
        assert response.status_code == 402
        assert Order.objects.count() == before
        with connection.cursor() as cursor:
            cursor.execute("SELECT last_value FROM shop_order_id_seq")
            rolled_back_id = int(cursor.fetchone()[0])
        assert receipt_messages(rolled_back_id) == []

    def test_a_paid_order_gets_one_receipt_through_a_worker(self) -> None:
        response = self.client.post("/orders/", {"item": "lamp"})
        assert response.status_code == 201
        order_id = response.json()["order"]
        [message_id] = receipt_messages(order_id)
        FAIL_ONCE.add(order_id)  # the first run fails after its ORM update: that update rolls back
        with worker():
            wait_for(lambda: committed(message_id), "the receipt job never committed")
        assert order_id not in FAIL_ONCE, "the first run did not fail as planned"
        assert Order.objects.get(pk=order_id).receipts_sent == 1
