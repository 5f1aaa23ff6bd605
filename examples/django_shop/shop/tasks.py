"""The receipt job: an ORM write inside the job's transaction, committed with its idempotency key.

``rundramatiq_reliable`` imports ``<app>.tasks`` of every installed app.  The actor may fail after
its write (``FAIL_ONCE``, filled by the tests): the job's transaction then rolls back, the retry runs
again from a clean slate, and the receipt is counted once.  ``SHOP_QUEUE`` names its queue (tests
running side by side on one RabbitMQ give each run its own).
"""

from __future__ import annotations

import os

import dramatiq
from django.db.models import F

from .models import Order

#: Order ids whose first run raises after the ORM update (the tests fill it).
FAIL_ONCE: set[int] = set()


@dramatiq.actor(queue_name=os.environ.get("SHOP_QUEUE", "shop"), max_retries=3, min_backoff=10, max_backoff=50)
def send_receipt(order_id: int) -> None:
    Order.objects.filter(pk=order_id).update(receipts_sent=F("receipts_sent") + 1)
    if order_id in FAIL_ONCE:
        FAIL_ONCE.discard(order_id)
        raise ConnectionError("the mail server hung up after the receipt was counted")
