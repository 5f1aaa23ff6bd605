"""What a worker's claim of queue rows tells the middleware that wants to act before a worker thread.

Why: a middleware whose ``before_process_message`` asks Postgres something about every message
(``OrderedKeys``: may this job run now?) makes each worker thread wait a round trip before each
job.  On a ``PostgresBroker`` the consumer claims rows in batches on its own thread; a listener
registered here is told of each batch as it is claimed, so it can ask for the whole batch in one
statement there and leave its answer on each message (:attr:`PostgresMessage.notes
<dramatiq_reliable.postgres.consumer.PostgresMessage.notes>`), and of the messages given back
unprocessed (a worker stopping, a consumer closed), so it can undo what it did for them.  A
listener may also *settle* messages: those it returns from ``claimed`` are acked by the consumer
without reaching a worker thread (``OrderedKeys``: a job delivered before its turn, whose body
it already parked in Postgres), as Dramatiq acks a message a middleware skipped.

A listener that fails is logged and skipped: the messages go on as if it had said nothing, so a
listener must treat a message without its note as never seen (ask then, as without a claim).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from dramatiq.broker import MessageProxy

if TYPE_CHECKING:
    from .consumer import PostgresMessage

__all__ = ["ClaimListener", "ClaimListeners"]

logger = logging.getLogger("dramatiq_reliable.postgres.claims")


class ClaimListener(Protocol):
    """Told of the messages a consumer claimed (before any worker thread sees them) and gave back."""

    def claimed(self, messages: Sequence[PostgresMessage]) -> Iterable[MessageProxy]:
        """Told of a claimed batch; returns the messages it settled (to ack unrun), if any."""
        ...

    def given_back(self, messages: Sequence[PostgresMessage]) -> None: ...


class ClaimListeners:
    """The listeners of one broker; each call reaches every listener, and a failure stops none."""

    def __init__(self) -> None:
        self._listeners: list[ClaimListener] = []
        self._lock = threading.Lock()

    def add(self, listener: ClaimListener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners = [*self._listeners, listener]

    def remove(self, listener: ClaimListener) -> None:
        with self._lock:
            self._listeners = [other for other in self._listeners if other is not listener]

    def claimed(self, messages: Sequence[PostgresMessage]) -> set[int]:
        """Tell every listener; the ids (``id()``) of the messages one of them settled."""
        settled: set[int] = set()
        for listener in self._listeners:
            try:
                settled.update(id(message) for message in listener.claimed(messages))
            except Exception:
                logger.warning("claim listener %r failed; its messages go on without its note", listener, exc_info=True)
        return settled

    def given_back(self, messages: Sequence[PostgresMessage]) -> None:
        for listener in self._listeners:
            try:
                listener.given_back(messages)
            except Exception:
                logger.warning("claim listener %r failed on messages given back", listener, exc_info=True)
