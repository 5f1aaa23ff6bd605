"""The one argument checker: every constructor and entry point validates its options through it.

Each rule is one function (an int in a range, milliseconds, a bool, one of a few choices), and
each raises the error class the caller names (``ConfigurationError`` by default; an actor
option raises ``ActorOptionError`` so Dramatiq lets it out of a before-hook).  Messages name the
argument, show the value with ``!r`` and end with the fix, so "got True" never hides behind
"must be positive": a ``bool`` is never accepted as a number.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, TypeGuard, TypeVar

from .errors import ConfigurationError

__all__ = [
    "MAX_MS",
    "MAX_QUEUE_BYTES",
    "check_bool",
    "check_choice",
    "check_int",
    "check_ms",
    "check_queue_name",
    "check_text",
    "is_int",
    "shown",
]

#: The longest duration an option may hold: 100 years, the bound the command line's durations
#: share.  Past it, ``timedelta`` and Postgres intervals overflow and a typo goes unnoticed.
MAX_MS = 100 * 365 * 86_400_000

_T = TypeVar("_T")

#: The longest queue name: AMQP's 255 bytes less the three of Dramatiq's ``.DQ``/``.XQ`` suffixes.
MAX_QUEUE_BYTES = 252

#: What Postgres ``text`` refuses: NUL, and a lone surrogate (UTF-8 cannot encode one).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: How much of a refused value a message shows: enough to recognise it, never a page of it.
_SHOWN_CHARS = 60


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is not a count of milliseconds)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(error: type[ConfigurationError], text: str, fix: str) -> ConfigurationError:
    return error(f"{text}; {fix}" if fix else text)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    unit: str = "",
    fix: str = "",
    error: type[ConfigurationError] = ConfigurationError,
) -> Any:
    """Return ``value`` if it is an int (not a bool) within ``[minimum, maximum]``, else raise ``error``.

    ``allow_none`` lets ``None`` through (an option that can be switched off).
    """
    if value is None and allow_none:
        return None
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            wanted = f"an int from {minimum} to {maximum}"
        elif minimum is not None:
            wanted = f"an int >= {minimum}"
        elif maximum is not None:
            wanted = f"an int <= {maximum}"
        else:
            wanted = "an int"
        if unit:
            wanted += f" ({unit})"
        if allow_none:
            wanted += " or None"
        raise _fail(error, f"{name} must be {wanted}, got {value!r}", fix)
    return value


def check_ms(
    name: str,
    value: Any,
    *,
    minimum: int = 0,
    maximum: int = MAX_MS,
    allow_none: bool = False,
    fix: str = "",
    error: type[ConfigurationError] = ConfigurationError,
) -> Any:
    """Return ``value`` if it is a duration in milliseconds within ``[minimum, maximum]`` (100 years)."""
    if is_int(value) and value > maximum:
        raise _fail(error, f"{name} must be at most {maximum} milliseconds, got {value!r}", fix)
    return check_int(name, value, minimum=minimum, allow_none=allow_none, unit="milliseconds", fix=fix, error=error)


def check_bool(name: str, value: Any, *, error: type[ConfigurationError] = ConfigurationError) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not ``1``, not ``"yes"``)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(
    name: str,
    value: Any,
    choices: Collection[_T],
    *,
    fix: str = "",
    error: type[ConfigurationError] = ConfigurationError,
) -> _T:
    """Return ``value`` if it is one of ``choices`` (compared by equality, never by type coercion)."""
    if isinstance(value, bool) or not any(value == choice and type(value) is type(choice) for choice in choices):
        listed = [repr(choice) for choice in choices]
        wanted = " or ".join(listed) if len(listed) <= 2 else "one of " + ", ".join(listed)
        raise _fail(error, f"{name} must be {wanted}, got {value!r}", fix)
    return value  # type: ignore[no-any-return]


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut to about 60 characters (a refused value may be huge)."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS + 20 else text[:_SHOWN_CHARS] + "..."


def check_text(
    name: str,
    value: Any,
    *,
    max_chars: int,
    allow_none: bool = False,
    fix: str = "",
    error: type[ConfigurationError] = ConfigurationError,
) -> Any:
    """Return ``value`` if it is a non-empty ``str`` Postgres ``text`` can hold, of at most ``max_chars``.

    For names that go into a query (a filter, a schedule name): a NUL or a lone surrogate would
    reach the driver and come back as its own error (``DataError``, ``UnicodeEncodeError``), and a
    value longer than any stored one can match nothing.  The message shows the value shortened.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value:
        wanted = "a non-empty string" + (" or None" if allow_none else "")
        raise _fail(error, f"{name} must be {wanted}, got {shown(value)}", fix)
    bad = _UNSTORABLE.search(value)
    if bad is not None:
        what = "a NUL character" if bad.group() == "\x00" else "a lone surrogate"
        raise _fail(error, f"{name} must be text Postgres can store, got {shown(value)}, which holds {what}", fix)
    if len(value) > max_chars:
        raise _fail(error, f"{name} must be at most {max_chars} characters, got {shown(value)}", fix)
    return value


def check_queue_name(
    name: str, value: Any, *, allow_none: bool = False, error: type[ConfigurationError] = ConfigurationError
) -> Any:
    """Return ``value`` if it can name a queue everywhere one goes: Postgres text (no NUL, no lone
    surrogate) and RabbitMQ (at most :data:`MAX_QUEUE_BYTES` bytes, room left for ``.DQ``/``.XQ``)."""
    check_text(
        name, value, max_chars=MAX_QUEUE_BYTES, allow_none=allow_none, fix="give a Dramatiq queue name", error=error
    )
    if value is not None and len(value.encode()) > MAX_QUEUE_BYTES:
        raise error(
            f"{name} must be at most {MAX_QUEUE_BYTES} bytes in UTF-8, got {shown(value)}; give a shorter queue name"
        )
    return value
