"""Small private helpers shared by the modules of the package (one copy of each)."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "first_line",
    "format_age",
    "rabbitmq_address",
    "rabbitmq_error",
    "rabbitmq_reason",
    "redact",
    "type_name",
]


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
    # After "//" (a scheme, or a scheme missing its colon) the password runs to the last "@"
    # before the host and may hold unencoded spaces.
    r"(?P<user>//[^\s:/@'\"]*):(?P<password>[^'\"]*?)@(?=[\w.\-\[\]%]+)"
    # Without a scheme, user:password@host where the password holds no colon: an unencoded
    # space is still masked, but prose ("note: see a:b@c") is not swallowed from its first colon.
    r"|(?P<bare>(?:^|(?<=[\s'\"(=]))[^\s:/@'\"]+):(?!//)[^'\"@:]*?@(?=[\w.\-\[\]%]+)"
)
# libpq quotes only the offending part of a URL with an unencoded space: often the password.
_SPACES_FOUND = re.compile(r'(?P<head>unexpected spaces found in )"[^"]*"')
_KV_PASSWORD = re.compile(r"(?P<key>\bpassword\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every password of a connection string masked, for logs and error messages."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['user'] if m['user'] is not None else m['bare']}:***@", text)
    text = _SPACES_FOUND.sub(lambda m: f'{m["head"]}"***"', text)
    return _KV_PASSWORD.sub(lambda m: f"{m['key']}***", text)


def rabbitmq_address(parameters: Any) -> str:
    """``host:port`` of pika connection parameters (a list gives each, comma-separated).

    Never the credentials: it reads only ``host`` and ``port``, so it is safe in any message.
    """
    items = parameters if isinstance(parameters, (list, tuple)) else [parameters]
    addresses = []
    for item in items:
        host, port = getattr(item, "host", None), getattr(item, "port", None)
        host = f"[{host}]" if isinstance(host, str) and ":" in host else host
        addresses.append(f"{host}:{port}" if host is not None else "?")
    return ", ".join(addresses) or "?"


def rabbitmq_reason(error: BaseException) -> str:
    """Why pika could not talk to RabbitMQ, said once: ``connection refused``, ``login refused ...``.

    pika nests its connection errors three deep (``AMQPConnectionError`` holding an
    ``AMQPConnectorSocketConnectError`` holding the ``OSError``), and each level's text repeats
    the ones below; this walks down to the innermost error and names it in plain words.
    """
    import socket

    import pika.exceptions

    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "exception", None)
        if not isinstance(inner, BaseException):
            nested = getattr(error, "exceptions", None)
            inner = nested[-1] if isinstance(nested, (list, tuple)) and nested else None
        if not isinstance(inner, BaseException) and error.args and isinstance(error.args[0], BaseException):
            inner = error.args[0]
        if not isinstance(inner, BaseException):
            break
        error = inner
    text = " ".join(str(part) for part in error.args if not isinstance(part, BaseException)).strip()
    if isinstance(error, pika.exceptions.ProbableAuthenticationError):
        return "login refused: check the user and password"
    if isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        return f"access refused ({_closed_reason(text)}): check the virtual host and the user's permissions"
    if isinstance(error, pika.exceptions.IncompatibleProtocolError):
        return "the server does not speak AMQP 0-9-1: is this RabbitMQ's port?"
    if isinstance(error, pika.exceptions.ConnectionClosed) and len(error.args) == 2:
        return f"RabbitMQ closed the connection ({error.args[0]} {error.args[1]})"
    if isinstance(error, socket.gaierror):
        return f"cannot resolve the host name ({error.strerror or text})"
    if isinstance(error, (TimeoutError, socket.timeout)) or type(error).__name__.endswith("Timeout"):
        return "timed out"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror[:1].lower() + error.strerror[1:]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _closed_reason(text: str) -> str:
    # "ConnectionClosedByBroker: (530) 'NOT_ALLOWED - vhost x not found'" -> "530 NOT_ALLOWED - vhost x not found"
    match = re.search(r"\((\d+)\)\s*'?(.*?)'?$", text)
    return f"{match[1]} {match[2]}" if match else text


def rabbitmq_error(error: BaseException, parameters: Any) -> str:
    """``cannot reach RabbitMQ at host:port: <reason>``: one line, no credentials."""
    return f"cannot reach RabbitMQ at {rabbitmq_address(parameters)}: {redact(rabbitmq_reason(error))}"
