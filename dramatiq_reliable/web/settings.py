"""What one web app was built with: where to read, where to act, and the options of ``create_app``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from ..dead_letters import PostgresDeadLetterStore
from ..health import QueueDepths
from .access import AccessHook
from .pools import ReadPool

__all__ = ["Settings"]

Target = Literal["outbox", "queue"]


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
    target: Target
    replay_max_age_ms: int | None
    rabbitmq: QueueDepths | None
    queues: Sequence[str]
    page_size: int
    owned: list[Any] = dataclasses.field(default_factory=list)
    _read_store: PostgresDeadLetterStore | None = None

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
