"""What a dead-letter store must do for the middleware, the ``.XQ`` import and the command line.

:class:`~.store.PostgresDeadLetterStore` is the real one; :class:`~dramatiq_reliable.testing.
InMemoryDeadLetterStore` keeps rows in a dict, so actors can be unit tested with
``DeadLetters(store=InMemoryDeadLetterStore())`` under Dramatiq's ``StubBroker``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .analysis import Failure
from .records import (
    DeadLetter,
    DeadLetterCount,
    DeadLetterFilter,
    DeadLetterGroup,
    DeadLetterPage,
    DiscardResult,
    PurgeResult,
    ReplayResult,
    State,
)

__all__ = ["DeadLetterStore"]


@runtime_checkable
class DeadLetterStore(Protocol):
    """A place for dead letters.  Implementations may take more keyword arguments (the Postgres
    store's ``conn=``, to join a caller's transaction)."""

    def save(self, failure: Failure, *, timeout_ms: int) -> DeadLetter:
        """Store ``failure``, or refresh the row of a message that is already dead (``captures``
        goes up); raise when it cannot be stored within about ``timeout_ms``."""
        ...

    def save_imported(self, failure: Failure, *, after_id: int) -> int | None:
        """Store a death found in ``.XQ`` unless a row of its message id newer than ``after_id``
        exists; the new row's id, or ``None`` when it was already stored."""
        ...

    def check_ready(self) -> None:
        """Raise if nothing could be stored (e.g. ``SchemaNotReady``); called at worker boot."""
        ...

    def get(self, dead_letter_id: int) -> DeadLetter | None: ...

    def list(
        self,
        *,
        where: DeadLetterFilter | None = None,
        state: State | None = "dead",
        limit: int = 50,
        cursor: str | None = None,
    ) -> DeadLetterPage: ...

    def count(
        self, *, where: DeadLetterFilter | None = None, ids: Sequence[int] | None = None, state: State | None = "dead"
    ) -> int: ...

    def stats(self, *, where: DeadLetterFilter | None = None, limit: int = 20) -> tuple[DeadLetterGroup, ...]: ...

    def counts(self) -> tuple[DeadLetterCount, ...]: ...

    def replay_preview(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        force: bool = False,
        max_age_ms: Any = ...,
    ) -> tuple[int, int]: ...

    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        queue_name: str | None = None,
        delay_ms: int | None = None,
        force: bool = False,
        max_age_ms: Any = ...,
        by: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayResult: ...

    def discard(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        note: str | None = None,
        by: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DiscardResult: ...

    def purge(self, *, older_than_ms: Any = ..., handled_older_than_ms: int | None = 0) -> PurgeResult: ...

    def close(self) -> None: ...
