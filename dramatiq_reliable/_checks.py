"""The one argument checker: every constructor and entry point validates its options through it.

Each rule is one function (an int in a range, milliseconds, a bool, one of a few choices), and
each raises the error class the caller names (``ConfigurationError`` by default; an actor
option raises ``ActorOptionError`` so Dramatiq lets it out of a before-hook).  Messages name the
argument, show the value with ``!r`` and end with the fix, so "got True" never hides behind
"must be positive": a ``bool`` is never accepted as a number.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, TypeGuard, TypeVar

from .errors import ConfigurationError

__all__ = ["MAX_MS", "check_bool", "check_choice", "check_int", "check_ms", "is_int"]

#: The longest duration an option may hold: 100 years, the bound the command line's durations
#: share.  Past it, ``timedelta`` and Postgres intervals overflow and a typo goes unnoticed.
MAX_MS = 100 * 365 * 86_400_000

_T = TypeVar("_T")


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
