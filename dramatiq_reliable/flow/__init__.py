"""Flow control in Postgres, no other server: rate limits, concurrency and order per key.

Rate limits learn from a provider's 429s (``RateLimits``), concurrency per key generalises the
singleton's lease (``ConcurrencyLimit``), and order per key runs a key's jobs one at a time in
send order (``OrderedKeys``).
"""

from __future__ import annotations

from .concurrency import ConcurrencyLimit, ConcurrencyParked, concurrency_waiting
from .middleware import RateLimitPaused, RateLimitPostponed, RateLimits
from .order import ORDER_SEQ_OPTION, OrderedKeys, OrderParked, order_waiting
from .rate_limit import KeyState, RateLimit, limited_keys

__all__ = [
    "ORDER_SEQ_OPTION",
    "ConcurrencyLimit",
    "ConcurrencyParked",
    "KeyState",
    "OrderParked",
    "OrderedKeys",
    "RateLimit",
    "RateLimitPaused",
    "RateLimitPostponed",
    "RateLimits",
    "concurrency_waiting",
    "limited_keys",
    "order_waiting",
]
