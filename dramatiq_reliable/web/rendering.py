"""How a page is drawn: the Jinja2 templates, their helpers (links, ages, numbers) and flash messages.

Links are paths built from the route names with ``request.url_for``, so they carry the prefix
the app is mounted under (``/jobs/dead-letters``), and are written without scheme and host so a
TLS-terminating proxy in front does not turn them into ``http://`` links.

Flash messages (what an action did) travel from the POST to the page it redirects to in a
short-lived cookie scoped to the app's path, read and cleared by the next page drawn: no server
session to keep, and no message text in a URL that anyone could craft.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from .._util import format_age
from .access import Access

__all__ = []

_FLASH_COOKIE = "dramatiq_reliable_flash"


@dataclasses.dataclass(frozen=True)
class Flash:
    """One message for the next page: ``kind`` is ``ok``, ``warn`` or ``error`` (its colour)."""

    text: str
    kind: str = "ok"


def link(request: Request, name: str, /, query: Mapping[str, Any] | None = None, **path_params: Any) -> str:
    """The path of route ``name`` under the app's mount point, with ``query`` (``None`` values dropped)."""
    path = request.url_for(name, **path_params).path
    if query:
        pairs = [(key, value) for key, value in query.items() if value not in (None, "")]
        if pairs:
            path += "?" + urlencode(pairs, doseq=True)
    return path


def ago(seconds: float | None) -> str:
    """``3m 12s`` style ages; ``-`` for none."""
    return "-" if seconds is None else format_age(float(seconds))


def since(moment: datetime.datetime | None) -> str:
    """How long ago ``moment`` was (``-`` for none)."""
    if moment is None:
        return "-"
    return format_age(max(0.0, (datetime.datetime.now(datetime.timezone.utc) - moment).total_seconds())) + " ago"


def until(moment: datetime.datetime | None) -> str:
    """How long until ``moment`` (``due`` when it has passed, ``-`` for none)."""
    if moment is None:
        return "-"
    seconds = (moment - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    return "due" if seconds <= 0 else "in " + format_age(seconds)


def when(moment: datetime.datetime | None) -> str:
    """A UTC time to the second, ``2024-05-01 12:00:00Z``."""
    if moment is None:
        return "-"
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def epoch(seconds: float) -> str:
    """A Unix time as :func:`when` shows it."""
    return when(datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc))


def number(value: int | None) -> str:
    """``1,234``; ``-`` for unknown."""
    return "-" if value is None else f"{value:,}"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("dramatiq_reliable.web", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(ago=ago, since=since, until=until, when=when, epoch=epoch, number=number)
    env.globals["link"] = jinja2.pass_context(
        lambda context, route, /, query=None, **params: link(context["request"], route, query, **params)
    )
    env.globals["static"] = jinja2.pass_context(
        lambda context, path: context["request"].url_for("static", path=path).path
    )
    return env


templates = Jinja2Templates(env=_environment())


def render(
    request: Request, template: str, context: Mapping[str, Any], *, status_code: int = 200, flash: bool = True
) -> Response:
    """Draw ``template`` with the request's access and pending flash messages, clearing the flash
    cookie; ``flash=False`` for a fragment, which has no place to show them and leaves them be."""
    access: Access = getattr(request.state, "access", Access("read"))
    flashes = _read_flashes(request) if flash else []
    response = templates.TemplateResponse(
        request,
        template,
        {"access": access, "flashes": flashes, **context},
        status_code=status_code,
    )
    if flashes:
        response.delete_cookie(_FLASH_COOKIE, path=_cookie_path(request))
    return response


def add_flash(request: Request, response: Response, *messages: Flash) -> None:
    """Carry ``messages`` to the next page drawn (see the module docstring)."""
    data = json.dumps([[message.kind, message.text] for message in messages])
    response.set_cookie(
        _FLASH_COOKIE,
        quote(data),
        max_age=60,
        path=_cookie_path(request),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _read_flashes(request: Request) -> list[Flash]:
    raw = request.cookies.get(_FLASH_COOKIE)
    if not raw:
        return []
    try:
        items = json.loads(unquote(raw))
        return [
            Flash(text=_printable(str(text)[:2000]), kind=kind if kind in ("ok", "warn", "error") else "ok")
            for kind, text in items
        ]
    except (ValueError, TypeError):
        return []


def _printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: the cookie is the browser's, and its JSON may escape a lone
    surrogate that no page could be encoded with."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _cookie_path(request: Request) -> str:
    return (request.scope.get("root_path") or "") + "/"
