"""The argument rules every dead-letter store applies: ids, filters, what to act on, who acts.

Shared by :class:`~dramatiq_reliable.PostgresDeadLetterStore` and
:class:`~dramatiq_reliable.testing.InMemoryDeadLetterStore`, so a unit test refuses what
production refuses.  Each raises ``ConfigurationError`` naming the fix, before any SQL.
"""

from __future__ import annotations

import functools
import getpass
import os
import socket
from collections.abc import Sequence
from typing import Any

from .._checks import check_choice, check_int, shown
from ..errors import ConfigurationError
from .analysis import _clean_text
from .records import _MAX_NAME_CHARS, STATES, DeadLetterFilter

__all__ = [
    "MAX_ID",
    "MAX_LIMIT",
    "check_batch",
    "check_by",
    "check_filter",
    "check_id",
    "check_ids",
    "check_limit",
    "check_state",
    "check_target",
    "format_duration_ms",
    "seconds",
]

#: Dead-letter ids are ``bigserial``: an id past this names no row, and Postgres refuses it as a
#: ``bigint`` parameter.
MAX_ID = 2**63 - 1
#: The most rows one listing or grouping returns.
MAX_LIMIT = 10_000

__all__ = []


@functools.lru_cache(maxsize=1)
def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def check_batch(batch: Any) -> int:
    """Rows per transaction of a bulk replay, discard or purge."""
    return int(check_int("batch_size", batch, minimum=1, maximum=100_000, fix="e.g. 5000"))


def check_id(value: Any) -> int:
    """One dead-letter id: an int (not a bool) from 1 to :data:`MAX_ID`."""
    return int(check_int("a dead letter id", value, minimum=1, maximum=MAX_ID))


def check_ids(ids: Sequence[int] | None) -> list[int] | None:
    """``ids`` sorted and without repeats, each checked with :func:`check_id`; ``None`` passes."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ConfigurationError(f"ids must be a sequence of dead letter ids, got {shown(ids)}")
    checked = [check_id(item) for item in ids]
    if not checked:
        raise ConfigurationError("ids is empty; pass at least one dead letter id, or where= to pick by filter")
    return sorted(set(checked))


def check_limit(limit: Any) -> int:
    """Rows of one listing or grouping: 1 to :data:`MAX_LIMIT`."""
    return int(check_int("limit", limit, minimum=1, maximum=MAX_LIMIT))


def check_state(state: Any) -> Any:
    """A dead letter's state to select, or ``None`` for every state."""
    if state is not None:
        check_choice("state", state, STATES, fix="or None for every state")
    return state


def check_filter(where: DeadLetterFilter | None) -> DeadLetterFilter:
    """``where``, or the filter that matches everything for ``None``."""
    if where is None:
        return DeadLetterFilter()
    if not isinstance(where, DeadLetterFilter):
        raise ConfigurationError(f"where must be a DeadLetterFilter, got {type(where).__name__!r}")
    return where


def check_target(
    ids: Sequence[int] | None, where: DeadLetterFilter | None, verb: str
) -> tuple[list[int] | None, DeadLetterFilter]:
    """What a replay or discard acts on: ``ids``, ``where`` or both, never neither."""
    if ids is None and where is None:
        raise ConfigurationError(
            f"{verb}() needs ids= or where=; to {verb} every dead letter pass where=DeadLetterFilter()"
        )
    return check_ids(ids), check_filter(where)


def check_by(by: str | None) -> str:
    """Who acts, for ``handled_by``: ``by`` kept readable as Postgres can store it (a NUL or a lone
    surrogate escaped, as in the dead letters themselves), or ``user@host`` for ``None``."""
    if by is None:
        return _who()
    if not isinstance(by, str) or not by:
        raise ConfigurationError(f"by must be a non-empty string naming who acts, got {shown(by)}")
    return _clean_text(by[:_MAX_NAME_CHARS])


def seconds(ms: int | None) -> float | None:
    """Milliseconds as the seconds the SQL takes (``None`` stays ``None``)."""
    return None if ms is None else ms / 1000


def format_duration_ms(ms: int) -> str:
    """``7d``, ``36h``, ``15m``, ``30s``: the largest unit that divides ``ms`` evenly, else ms."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
