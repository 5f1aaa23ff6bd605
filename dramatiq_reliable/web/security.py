"""The page against hostile sites: which ``Host`` names it answers to, and the headers every response carries.

**DNS rebinding.**  A page on another site can point a name it controls at 127.0.0.1 once the
victim's browser has loaded it (``evil.example`` resolves first to the attacker, then to
loopback).  The browser then sends the attacker's script's requests to the loopback page with
``Host: evil.example``, same-origin for that script, which reads the answers: dead letters with
their arguments.  Loopback clients are exactly who the hook-less page trusts, so it answers only
to the names a person types for it (``localhost``, ``127.0.0.1``, ``[::1]``, any port) and to
those given in ``allowed_hosts``; any other ``Host`` gets 400.

With an access hook, the hook decides from credentials (a session cookie, a header the proxy
sets after authenticating), and a browser never sends the real site's credentials to a rebound
name, so the rebound request is just an anonymous one the hook refuses.  Behind a reverse proxy
the page has a real name the library cannot guess, so there the check applies only when
``allowed_hosts`` is given: pass it when the hook trusts the network (the client's address)
rather than credentials.

**Headers.**  Every response (pages, fragments, static files, refusals, errors) carries a
Content-Security-Policy that lets the page load only its own script and style and be framed by
nobody (``frame-ancestors 'none'``; ``X-Frame-Options: DENY`` for browsers that predate it), so
another site cannot show the page in a frame and trick a click on its buttons;
``X-Content-Type-Options: nosniff``, so a text answer is never run as a script; and
``Referrer-Policy: same-origin``, so the page's URLs (which name queues, actors and
fingerprints) never leave for another site, while requests within the page keep their referrer.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import Message, Send

from .._checks import shown
from ..errors import ConfigurationError

# Internal: the names below are used by other parts of the package, not by applications.
__all__: list[str] = []

#: The names the hook-less page always answers to: a person opening it on this machine.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")

#: The page's policy: its own script (htmx, vendored) and stylesheet, requests back to itself,
#: forms posted to itself, no frame anywhere around it, nothing else.  No inline script or style
#: is needed: the templates have none, and the page tells htmx not to inject its indicator style.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)

#: The headers of every response (see the module docstring).
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "same-origin"),
)

# A DNS name or an IPv4 address: ASCII labels (underscores too: container names have them).
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
_MAX_NAME_CHARS = 253


def host_of(header: str | None) -> str | None:
    """The host name of a ``Host`` header, lower-cased, without its port or a trailing dot
    (``[::1]`` keeps its brackets); ``None`` for anything that is not a host."""
    if not header:
        return None
    text = header.strip().lower()
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return None
        host = f"[{address}]"
        if not bracket:
            return None
    else:
        host, _, port = text.partition(":")
        rest = f":{port}" if ":" in text else ""
        host = host[:-1] if host.endswith(".") else host
        if len(host) > _MAX_NAME_CHARS or not _NAME.fullmatch(host):
            return None
    if rest and not (rest.startswith(":") and _PORT.fullmatch(rest[1:])):
        return None
    return host


def allowed_host(host: str | None, patterns: Iterable[str]) -> bool:
    """Whether ``host`` (from :func:`host_of`) is one of ``patterns``: a name, or ``*.domain`` for
    any name under ``domain`` (not ``domain`` itself)."""
    if host is None:
        return False
    for pattern in patterns:
        pattern = pattern.lower()
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


def check_allowed_hosts(value: Any) -> tuple[str, ...]:
    """``allowed_hosts=`` as a tuple of lower-cased names; ``ConfigurationError`` naming the fix."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigurationError(
            f"allowed_hosts must be a list of host names, got {shown(value)}; e.g. allowed_hosts=['jobs.example.com']"
        )
    checked: list[str] = []
    for item in value:
        name = item[2:] if isinstance(item, str) and item.startswith("*.") else item
        host = host_of(name) if isinstance(name, str) else None
        if host is None:
            raise ConfigurationError(
                f"allowed_hosts holds {shown(item)}, which cannot be a host name; give names as the browser "
                "sends them in Host, e.g. 'jobs.example.com', '10.0.0.5', '[::1]' or '*.example.com'"
            )
        if host != name.lower().rstrip("."):
            raise ConfigurationError(
                f"allowed_hosts holds {shown(item)}; give the name without a port or scheme, e.g. {host!r} "
                "(every port of an allowed name is allowed)"
            )
        checked.append(item.lower().rstrip("."))
    return tuple(checked)


def host_problem(header: str | None, allowed: Sequence[str] | None) -> str | None:
    """Why a request with ``Host: header`` is refused, or ``None`` when it may go on (or when
    ``allowed`` is ``None``: no check)."""
    if allowed is None:
        return None
    host = host_of(header)
    if allowed_host(host, allowed):
        return None
    named = shown(host if host is not None else header or "")
    return (
        f"refused: this page does not answer to Host {named} (a page on another site may be reaching it "
        "through a name it controls); open it as http://localhost:PORT/, or allow the name with "
        "allowed_hosts= (dramatiq-reliable web --allowed-host)"
    )


def secured(send: Send) -> Send:
    """``send`` with :data:`SECURITY_HEADERS` added to the response's start, unless already set."""

    async def send_secured(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = list(message.get("headers", ()))
            headers = MutableHeaders(scope=message)
            for name, value in SECURITY_HEADERS:
                if name not in headers:
                    headers.append(name, value)
        await send(message)

    return send_secured
