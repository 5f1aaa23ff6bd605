"""What one web app was built with: where to read, where to act, and the options of ``create_app``."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..backing import SendsTo
from ..dead_letters import PostgresDeadLetterStore
from ..queue_depths import QueueDepths
from .access import AccessHook
from .pools import ReadPool

__all__ = []


@dataclasses.dataclass
class Settings:
    """The app's configuration and connections, kept on ``app.state.settings``.

    ``reads`` is the bounded pool the pages read through; ``actions`` the store that replays and
    discards (on the caller's database, as the command line does); ``rabbitmq`` reads queue
    depths (``None``: no RabbitMQ, as with ``PostgresBroker``).
    """

    schema: str
    reads: ReadPool
    actions: PostgresDeadLetterStore
    access: AccessHook | None
    hide_args: bool
    target: SendsTo
    replay_max_age_ms: int | None
    rabbitmq: QueueDepths | None
    queues: Sequence[str]
    page_size: int
    scan_interval_ms: int = 60_000
    #: The ``Host`` names answered (see :mod:`.security`); ``None``: any.
    allowed_hosts: Sequence[str] | None = None
    owned: list[Any] = dataclasses.field(default_factory=list)
    _read_store: PostgresDeadLetterStore | None = None
    _scan_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _scanned_at: float = float("-inf")
    _scanned_queues: tuple[str, ...] = ()
    _retries_waiting: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def scan_due(self) -> bool:
        """Whether the overview should run the full scans now (and claim them, so that concurrent
        refreshes do not all run them): at most once per ``scan_interval_ms``."""
        with self._scan_lock:
            now = time.monotonic()
            if now - self._scanned_at < self.scan_interval_ms / 1000:
                return False
            self._scanned_at = now
            return True

    def remember_scan(self, queues: Sequence[str], retries_waiting: Mapping[str, int]) -> None:
        """Keep what the full scans found, for the refreshes until the next one."""
        with self._scan_lock:
            self._scanned_queues = tuple(queues)
            self._retries_waiting = dict(retries_waiting)

    def forget_scan(self) -> None:
        """A full scan failed: try again on the next refresh."""
        with self._scan_lock:
            self._scanned_at = float("-inf")

    def last_scan(self) -> tuple[float, tuple[str, ...], Mapping[str, int]]:
        """When the full scans last ran (monotonic seconds), the queues and the retries waiting they found."""
        with self._scan_lock:
            return self._scanned_at, self._scanned_queues, self._retries_waiting

    def read_store(self) -> PostgresDeadLetterStore:
        """The dead-letter store on the bounded read pool (made once: it remembers the schema check)."""
        if self._read_store is None:
            self._read_store = PostgresDeadLetterStore(
                database=self.reads.get(),
                schema=self.schema,
                replay_to=self.target,
                replay_max_age_ms=self.replay_max_age_ms,
            )
        return self._read_store

    def close(self) -> None:
        """Close what the app opened: the read pool, its own action pool, the RabbitMQ reader."""
        self.reads.close()
        for item in self.owned:
            item.close()
        if self.rabbitmq is not None:
            self.rabbitmq.close()
