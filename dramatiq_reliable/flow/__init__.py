"""Flow control in Postgres: concurrency per key and order per key (no Redis, no other server)."""

from __future__ import annotations

from .concurrency import ConcurrencyLimit, ConcurrencyParked, concurrency_waiting
from .order import ORDER_SEQ_OPTION, OrderedKeys, OrderParked, order_waiting

__all__ = [
    "ORDER_SEQ_OPTION",
    "ConcurrencyLimit",
    "ConcurrencyParked",
    "OrderParked",
    "OrderedKeys",
    "concurrency_waiting",
    "order_waiting",
]
