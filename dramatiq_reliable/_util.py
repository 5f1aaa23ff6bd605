"""Small private helpers shared by the modules of the package (one copy of each)."""

from __future__ import annotations

import re
from typing import Any, TypeGuard

__all__ = ["check_ms", "first_line", "format_age", "is_int", "redact", "type_name"]


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is not a count of milliseconds)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_ms(name: str, value: Any, *, minimum: int = 0, fix: str = "", allow_none: bool = False) -> None:
    """Raise ``ConfigurationError`` unless ``value`` is an int of milliseconds >= ``minimum``."""
    from .errors import ConfigurationError

    if value is None and allow_none:
        return
    if not is_int(value) or value < minimum:
        none = " or None" if allow_none else ""
        hint = f"; {fix}" if fix else ""
        raise ConfigurationError(f"{name} must be an int >= {minimum} (milliseconds){none}, got {value!r}{hint}")


def type_name(cls: type) -> str:
    """``ValueError`` for builtins, ``package.module.Name`` otherwise: unambiguous and stable."""
    module = getattr(cls, "__module__", None) or ""
    qualname = getattr(cls, "__qualname__", None) or cls.__name__
    return qualname if module in ("builtins", "") else f"{module}.{qualname}"


def first_line(error: BaseException) -> str:
    """The first line of an error's text, or its type name when it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def format_age(seconds: float | None, *, suffix: str = "") -> str:
    """A duration for people: ``4.2s``, ``75s``, ``12m``, ``3.5h``, ``2.0d`` (``-`` when unknown).

    Two units' worth before switching, so "75s" is not rounded to "1m" next to a 60 s threshold.
    """
    if seconds is None:
        return "-"
    if seconds < 10:
        text = f"{seconds:.1f}s"
    elif seconds < 120:
        text = f"{seconds:.0f}s"
    elif seconds < 7200:
        text = f"{seconds / 60:.0f}m"
    elif seconds < 172800:
        text = f"{seconds / 3600:.1f}h"
    else:
        text = f"{seconds / 86400:.1f}d"
    return text + suffix


# user:password@ in a URL, with or without a scheme (a malformed DATABASE_URL may have none, or an
# unencoded space in the password), and password=... in a libpq key/value string.  The driver
# echoes a bad connection string in its error text, so every message we print goes through this.
_URL_PASSWORD = re.compile(
    r"(?P<user>(?:://|^|(?<=[\s'\"(=]))[^\s:/@'\"]+):(?!//)(?P<password>[^'\"]*?)@(?=[\w.\-\[\]%]+)"
)
_KV_PASSWORD = re.compile(r"(?P<key>\bpassword\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every password of a connection string masked, for logs and error messages."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['user']}:***@", text)
    return _KV_PASSWORD.sub(lambda m: f"{m['key']}***", text)
