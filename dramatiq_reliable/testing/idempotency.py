"""An idempotency store in a dict, for unit tests of actors under Dramatiq's ``StubBroker``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..idempotency.protocol import StoredKey

__all__ = ["InMemoryIdempotencyStore"]


class InMemoryIdempotencyStore:
    """Record-mode keys kept in memory, with the Postgres store's expiry rules.

    ``clock`` returns seconds (default ``time.monotonic``); tests pass their own to expire keys
    without waiting.

    >>> store = InMemoryIdempotencyStore()
    >>> broker.add_middleware(Idempotency(store=store), before=Callbacks)  # doctest: +SKIP
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[tuple[str, str], tuple[StoredKey, float]] = {}

    def lookup(self, *, actor_name: str, key: str) -> StoredKey | None:
        with self._lock:
            entry = self._keys.get((actor_name, key))
            return entry[0] if entry is not None and entry[1] > self._clock() else None

    def record(self, *, actor_name: str, key: str, payload_hash: bytes, message_id: str, retention_s: float) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._keys.get((actor_name, key))
            if entry is not None and entry[1] > now:
                return False
            self._keys[(actor_name, key)] = (StoredKey(bytes(payload_hash), message_id), now + retention_s)
            return True

    def check_ready(self) -> None:
        return None

    def purge_expired(self) -> int:
        now = self._clock()
        with self._lock:
            expired = [k for k, (_, expires_at) in self._keys.items() if expires_at <= now]
            for k in expired:
                del self._keys[k]
            return len(expired)

    def keys(self) -> list[tuple[str, str]]:
        """The unexpired ``(actor_name, key)`` pairs, for assertions."""
        now = self._clock()
        with self._lock:
            return [k for k, (_, expires_at) in self._keys.items() if expires_at > now]
