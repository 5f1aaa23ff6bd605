"""Bounds on the RabbitMQ sockets the package opens, so a silent partition ends in seconds.

A partition that drops packets (no RST) leaves a blocked socket read waiting for as long as the
kernel retransmits, many minutes.  AMQP heartbeats notice it eventually (pika waits for the
server's 60 s timeout, measured here at 65-130 s), but only while pika's I/O loop runs.  TCP
keepalives on an idle socket and ``TCP_USER_TIMEOUT`` on unacknowledged data make the kernel
itself break the connection within about 11 s, whatever the caller is blocked in; this is the
same bound :data:`dramatiq_reliable.database.CONNECTION_DEFAULTS` gives Postgres.
"""

from __future__ import annotations

from typing import Any

from ._checks import check_ms

__all__ = ["DEFAULT_TCP_USER_TIMEOUT_MS", "bound_tcp", "check_tcp_user_timeout_ms", "tcp_options"]

#: How long sent data may stay unacknowledged (and an idle peer silent, with the keepalives
#: below) before the kernel drops a RabbitMQ connection: about 10-11 s from the cut.
DEFAULT_TCP_USER_TIMEOUT_MS = 10_000

# Keepalive probes start after 5 s of silence, every 2 s; with TCP_USER_TIMEOUT set, Linux drops
# the connection at the first probe past the user timeout (11 s) rather than counting probes.
_KEEPALIVE = {"TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}
_MAX_TCP_USER_TIMEOUT_MS = 2**31 - 1  # the kernel takes an int


def check_tcp_user_timeout_ms(value: Any) -> int | None:
    """``value`` if it is a valid ``tcp_user_timeout_ms`` (``None`` leaves the sockets as the URL sets them)."""
    result: int | None = check_ms(
        "tcp_user_timeout_ms",
        value,
        minimum=1,
        maximum=_MAX_TCP_USER_TIMEOUT_MS,
        allow_none=True,
        fix="e.g. tcp_user_timeout_ms=10000; None leaves the sockets to the URL's tcp_options",
    )
    return result


def tcp_options(tcp_user_timeout_ms: int) -> dict[str, int]:
    """pika's ``tcp_options`` for keepalives plus ``TCP_USER_TIMEOUT`` (in milliseconds)."""
    return {**_KEEPALIVE, "TCP_USER_TIMEOUT": tcp_user_timeout_ms}


def bound_tcp(parameters: Any, *, tcp_user_timeout_ms: int | None = DEFAULT_TCP_USER_TIMEOUT_MS) -> Any:
    """``parameters`` (one ``pika`` parameters object or a list) with :func:`tcp_options` set on
    each that has none (a URL's ``?tcp_options=...`` wins); ``None`` changes nothing."""
    if tcp_user_timeout_ms is not None:
        for item in parameters if isinstance(parameters, list) else [parameters]:
            if getattr(item, "tcp_options", None) is None:
                item.tcp_options = tcp_options(tcp_user_timeout_ms)
    return parameters
