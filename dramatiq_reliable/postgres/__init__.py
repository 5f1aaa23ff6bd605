"""Postgres queues: PostgresBroker, its consumers, leases and retention."""

from .broker import PostgresBroker
from .consumer import wake_consumers
from .queue import QueueCounts
from .retention import purge_dead

__all__ = ["PostgresBroker", "QueueCounts", "purge_dead", "wake_consumers"]
