"""Which dead letters a replay or discard acts on, and what it would do: the rule the command line and the web page share.

Both ``dramatiq-reliable dead-letters replay|discard`` and the web page's buttons pick rows the
same way (ids, a filter, or both: their intersection; acting on every row must be said
explicitly), ask the store the same question before a bulk action (how many rows still dead
match, and how many of them the replay age limit leaves dead unless forced), and then make the
same store call.  The age rule itself is the store's (:meth:`PostgresDeadLetterStore.replay`
with ``force=``); this module only keeps the two front ends from drifting apart around it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from ..errors import ConfigurationError
from .protocol import DeadLetterStore
from .records import DeadLetterFilter

__all__ = ["Preview", "Selection"]

Verb = Literal["replay", "discard"]


@dataclasses.dataclass(frozen=True)
class Preview:
    """What an action would find: ``total`` rows still dead that match, ``too_old`` of them first
    sent longer ago than the replay age limit (always 0 for a discard, or when forced)."""

    total: int
    too_old: int = 0

    @property
    def touched(self) -> int:
        """The rows the action would change."""
        return self.total - self.too_old


@dataclasses.dataclass(frozen=True)
class Selection:
    """The dead letters an action applies to: ``ids`` (``None``: not by id), narrowed by ``where``.

    Build it with :meth:`of`, which refuses a selection that says nothing (no id, an empty
    filter) unless ``everything=True``: a click or a typo must never act on every row.
    """

    ids: tuple[int, ...] | None
    where: DeadLetterFilter

    @classmethod
    def of(
        cls, ids: Sequence[int] = (), where: DeadLetterFilter | None = None, *, everything: bool = False
    ) -> Selection:
        """The selection of ``ids`` and ``where``; ``ConfigurationError`` when it names nothing."""
        where = where if where is not None else DeadLetterFilter()
        unique = tuple(dict.fromkeys(int(item) for item in ids))
        if not unique and where.is_empty and not everything:
            raise ConfigurationError(
                "say which dead letters: ids, a filter (actor, queue, error type, fingerprint, time range), "
                "or every one explicitly"
            )
        return cls(unique or None, where)

    def describe(self) -> str:
        """The selection as people read it: ``2 ids (4, 7)``, ``fingerprint='ab12'``, ``all``."""
        if self.ids is None:
            return self.where.describe()
        shown = ", ".join(str(item) for item in self.ids[:10]) + (", ..." if len(self.ids) > 10 else "")
        text = f"id {shown}" if len(self.ids) == 1 else f"{len(self.ids)} ids ({shown})"
        return text if self.where.is_empty else f"{text}, {self.where.describe()}"

    def preview(self, store: DeadLetterStore, verb: Verb, *, force: bool = False) -> Preview:
        """Ask ``store`` what ``verb`` would find (for a confirmation), changing nothing."""
        if verb == "replay":
            total, too_old = store.replay_preview(ids=self.ids, where=self.where, force=force)
            return Preview(total, too_old)
        if verb == "discard":
            return Preview(store.count(ids=self.ids, where=self.where))
        raise ConfigurationError(f"verb must be 'replay' or 'discard', got {verb!r}")
