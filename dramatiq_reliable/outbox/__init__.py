"""The transactional outbox: OutboxBroker, binding, the relay and its worker middleware."""

from ..binding import bind
from .broker import OutboxBroker
from .consumer import Delivery, delivery_of
from .long_jobs import LongJobs
from .relay import Relay, RelayOptions, RelayPass, WorkerRelay, purge_published
from .wake import wake_relays

__all__ = [
    "Delivery",
    "LongJobs",
    "OutboxBroker",
    "Relay",
    "RelayOptions",
    "RelayPass",
    "WorkerRelay",
    "bind",
    "delivery_of",
    "purge_published",
    "wake_relays",
]
