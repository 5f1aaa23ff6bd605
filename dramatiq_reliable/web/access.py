"""Who may see and act on the web page: the access hook, the loopback default and the cross-site rule.

Every request goes through :func:`resolve` (what the hook, or the default, allows) and every POST
through :func:`cross_site_problem` as well.  Both are pure functions of the request, so the
rules are tested without a database.

- With no hook, the page is read-only and answers loopback clients only: a page started on a
  laptop or a server's localhost is safe to leave running; anything wider needs a hook.
- A hook is any callable of the request returning an :class:`Access` (or one of the level
  names ``"full"``, ``"read"``, ``"forbidden"``); it may be ``async``.  It runs for every
  request, static files included, so keep it cheap (read a header or a session).
- A POST is refused when the browser says it came from another site: ``Sec-Fetch-Site`` other
  than ``same-origin`` or ``none``, or, from browsers that do not send it, an ``Origin`` that is
  not this host.  Browsers set both headers themselves and scripts on other sites cannot forge
  them, so no token has to be stored, rendered or rotated.
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Literal
from urllib.parse import urlsplit

from starlette.requests import Request

from .._checks import shown
from ..errors import ConfigurationError

__all__ = ["LEVELS", "Access", "AccessHook"]

Level = Literal["full", "read", "forbidden"]
#: The access levels, from most to least allowed.
LEVELS: tuple[Level, ...] = ("full", "read", "forbidden")


@dataclasses.dataclass(frozen=True)
class Access:
    """What one request may do: ``"full"`` (see and act), ``"read"`` (see only) or ``"forbidden"``.

    ``user`` names who is asking, for the header and for the events every action emits; without
    it an action is attributed to the client's address.

    >>> def access(request):
    ...     if request.headers.get("x-role") == "oncall":
    ...         return Access("full", user=request.headers.get("x-user"))
    ...     return Access("read")
    """

    level: Level = "read"
    user: str | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigurationError(
                f"access level must be one of {LEVELS!r}, got {self.level!r}; return e.g. Access('read')"
            )
        if self.user is not None and not isinstance(self.user, str):
            raise ConfigurationError(f"Access.user must be a string or None, got {type(self.user).__name__!r}")

    @property
    def can_act(self) -> bool:
        """Whether this request may replay, discard, pause, resume or trigger."""
        return self.level == "full"

    @property
    def label(self) -> str:
        """What the page header shows: ``full`` or ``read-only``."""
        return "full" if self.level == "full" else "read-only" if self.level == "read" else "forbidden"


#: The access hook: decides per request; may return an awaitable.
AccessHook = Callable[[Request], Access | str | Awaitable[Access | str]]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a client address) is this machine: 127.0.0.0/8 or ::1."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


async def resolve(request: Request, hook: AccessHook | None) -> Access:
    """The access of ``request``: the hook's answer, or read-only for loopback clients and forbidden
    for the others when there is no hook."""
    if hook is None:
        client = request.client.host if request.client else None
        return Access("read") if is_loopback(client) else Access("forbidden")
    answer = hook(request)
    if inspect.isawaitable(answer):
        answer = await answer
    if isinstance(answer, Access):
        return answer
    if isinstance(answer, str) and answer in LEVELS:
        return Access(answer)
    raise ConfigurationError(
        f"the access hook returned {answer!r}; return an Access or one of {LEVELS!r} (e.g. Access('read', user='ann'))"
    )


def cross_site_problem(request: Request) -> str | None:
    """Why a state-changing request must be refused as cross-site, or ``None`` when it may go on.

    ``Sec-Fetch-Site`` decides when present (``same-origin``, or ``none`` for a user-typed
    request, pass).  Browsers too old to send it send ``Origin`` on a cross-site POST, which must
    then name this host.  A request with neither header is not from a browser's cross-site form
    (curl, a script on the same machine) and passes: the access hook still applies to it.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        if site.lower() in ("same-origin", "none"):
            return None
        return (
            f"cross-site request refused: the browser sent Sec-Fetch-Site: {shown(site)}; "
            "act from this page itself, not from another site or a link in another page"
        )
    origin = request.headers.get("origin")
    if origin is None:
        return None
    host = request.headers.get("host", "")
    try:
        origin_host = urlsplit(origin).netloc if "://" in origin else ""
    except ValueError:  # "http://[::1": not an origin a browser sends
        origin_host = ""
    if origin_host and origin_host.lower() == host.lower():
        return None
    return (
        f"cross-site request refused: Origin {shown(origin)} is not this page's host {shown(host)}; "
        "act from this page itself (a proxy in front of it must pass the Host header through unchanged)"
    )
