"""The dead-letter list's page cursor: where the next page starts, as a short opaque string.

A listing is keyset-paginated on ``(last_failed_at, id)``, newest first, so a cursor is that
pair: the microseconds since the epoch and the id, ``"1714563200000000.42"``.  It travels through
URLs (the web page's "next" link), so :func:`decode_cursor` trusts nothing: it accepts only
what :func:`encode_cursor` can write (ASCII digits, a time Python and Postgres can both hold, an
id within ``bigint``) and refuses anything else with ``ConfigurationError``, never an
``OverflowError`` or a driver error.
"""

from __future__ import annotations

import datetime
import re

from .._checks import shown
from ..errors import ConfigurationError

# Internal: the names below are used by other parts of the package, not by applications.
__all__: list[str] = []

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_US = datetime.timedelta(microseconds=1)
#: The instants a cursor may name: those ``datetime`` holds (Postgres holds more).
_FIRST_US = (datetime.datetime(1, 1, 1, tzinfo=datetime.timezone.utc) - _EPOCH) // _US
_LAST_US = (datetime.datetime.max.replace(tzinfo=datetime.timezone.utc) - _EPOCH) // _US
#: Dead-letter ids are ``bigserial``.
_MAX_ID = 2**63 - 1
# ASCII digits only: int() would also take "1_000", " 12 " and other scripts' digits.
_CURSOR = re.compile(r"(-?[0-9]{1,20})\.([0-9]{1,19})", re.ASCII)


def encode_cursor(last_failed_at: datetime.datetime, dead_letter_id: int) -> str:
    """The cursor of the page after the row ``(last_failed_at, dead_letter_id)``."""
    return f"{(last_failed_at - _EPOCH) // _US}.{dead_letter_id}"


def decode_cursor(cursor: object) -> tuple[datetime.datetime | None, int | None]:
    """``(last_failed_at, id)`` of ``cursor`` (``(None, None)`` for none); ``ConfigurationError``
    for anything :func:`encode_cursor` cannot have written."""
    if cursor is None:
        return None, None
    match = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) else None
    if match is not None:
        micros, dead_letter_id = int(match.group(1)), int(match.group(2))
        if _FIRST_US <= micros <= _LAST_US and 1 <= dead_letter_id <= _MAX_ID:
            return _EPOCH + micros * _US, dead_letter_id
    raise ConfigurationError(f"cursor {shown(cursor)} is not one a listing returned; pass next_cursor unchanged")
