"""What an idempotency store must do for the middleware in record mode.

Record mode checks a key before the actor runs and records it after the actor returned, each in
its own short step, so any store that can look a key up and insert it once will do.
:class:`~.store.PostgresIdempotencyStore` keeps keys in ``processed_jobs``;
:class:`~dramatiq_reliable.testing.InMemoryIdempotencyStore` keeps them in a dict, so actors can
be unit tested with ``Idempotency(store=InMemoryIdempotencyStore())`` under Dramatiq's
``StubBroker``.  Transactional mode needs the job's own Postgres transaction and so no store.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["IdempotencyStore", "StoredKey"]


class StoredKey(NamedTuple):
    """A key that ran: the hash of its arguments and the message that ran it first."""

    payload_hash: bytes
    first_message_id: str


@runtime_checkable
class IdempotencyStore(Protocol):
    """A place for processed keys (namespaced by actor)."""

    def lookup(self, *, actor_name: str, key: str) -> StoredKey | None:
        """The unexpired stored key, or ``None``; raise when the store cannot be read."""
        ...

    def record(self, *, actor_name: str, key: str, payload_hash: bytes, message_id: str, retention_s: float) -> bool:
        """Store the key unless an unexpired one exists; ``True`` when this call stored it."""
        ...

    def check_ready(self) -> None:
        """Raise if keys cannot be stored (e.g. ``SchemaNotReady``)."""
        ...

    def purge_expired(self) -> int:
        """Delete expired keys; return how many."""
        ...
