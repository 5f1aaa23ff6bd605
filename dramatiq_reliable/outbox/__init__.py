"""The transactional outbox: OutboxBroker, binding, the relay and its worker middleware."""

from .binding import bind, current_connection
from .broker import OutboxBroker
from .relay import Relay, RelayPass, WorkerRelay, purge_published

__all__ = ["OutboxBroker", "Relay", "RelayPass", "WorkerRelay", "bind", "current_connection", "purge_published"]
