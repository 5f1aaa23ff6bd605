"""Argument checks and conversions shared by the dead-letter store and middleware."""

from __future__ import annotations

import datetime
import functools
import getpass
import os
import socket
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigurationError
from .records import _EPOCH, _MAX_NAME_CHARS, _US, DeadLetterFilter

__all__ = []


@functools.lru_cache(maxsize=1)
def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def _check_batch(batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 100_000:
        raise ConfigurationError(f"batch_size must be an int from 1 to 100000, got {batch!r}; e.g. 5000")
    return int(batch)


def _check_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"a dead letter id is a positive int, got {value!r}")
    return int(value)


def _check_ids(ids: Sequence[int] | None) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ConfigurationError(f"ids must be a sequence of dead letter ids, got {ids!r}")
    checked = [_check_id(item) for item in ids]
    if not checked:
        raise ConfigurationError("ids is empty; pass at least one dead letter id, or where= to pick by filter")
    return sorted(set(checked))


def _check_filter(where: DeadLetterFilter | None) -> DeadLetterFilter:
    if where is None:
        return DeadLetterFilter()
    if not isinstance(where, DeadLetterFilter):
        raise ConfigurationError(f"where must be a DeadLetterFilter, got {type(where).__name__!r}")
    return where


def _check_target(
    ids: Sequence[int] | None, where: DeadLetterFilter | None, verb: str
) -> tuple[list[int] | None, DeadLetterFilter]:
    if ids is None and where is None:
        raise ConfigurationError(
            f"{verb}() needs ids= or where=; to {verb} every dead letter pass where=DeadLetterFilter()"
        )
    return _check_ids(ids), _check_filter(where)


def _check_by(by: str | None) -> str:
    if by is None:
        return _who()
    if not isinstance(by, str) or not by:
        raise ConfigurationError(f"by must be a non-empty string naming who acts, got {by!r}")
    return by[:_MAX_NAME_CHARS]


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _encode_cursor(last_failed_at: datetime.datetime, dead_letter_id: int) -> str:
    return f"{(last_failed_at - _EPOCH) // _US}.{dead_letter_id}"


def _decode_cursor(cursor: str | None) -> tuple[datetime.datetime | None, int | None]:
    if cursor is None:
        return None, None
    try:
        micros, dead_letter_id = (int(part) for part in str(cursor).split("."))
    except ValueError:
        raise ConfigurationError(
            f"cursor {cursor!r} is not one a listing returned; pass next_cursor unchanged"
        ) from None
    return _EPOCH + micros * _US, dead_letter_id


def _format_duration_ms(ms: int) -> str:
    """``7d``, ``36h``, ``15m``, ``30s``: the largest unit that divides ``ms`` evenly, else ms."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
