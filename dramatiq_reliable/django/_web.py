"""The web page inside Django's URLconf, behind Django's authentication.

The page is the Starlette app of :mod:`dramatiq_reliable.web`, called as a WSGI app from a
Django view.  The view decides who gets in (Django's user); the page's own access hook only
reads that decision from a header the view sets, after removing any copy the client sent.
"""

from __future__ import annotations

import io
import threading
from typing import Any
from urllib.parse import quote, unquote

from django.conf import settings as django_settings
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from ..errors import ConfigurationError
from ._settings import get_broker, on_reset, reliable_settings

__all__ = ["close_page", "default_access", "page"]

_LEVEL = "HTTP_X_DRAMATIQ_RELIABLE_ACCESS"
_USER = "HTTP_X_DRAMATIQ_RELIABLE_USER"
_lock = threading.Lock()
_app: tuple[Any, Any] | None = None


def default_access(user: Any) -> str:
    """Staff act (replay, discard, pause); other signed-in users are refused (set ``WEB_ACCESS``)."""
    return "full" if user.is_active and user.is_staff else "forbidden"


def _from_view(request: Any) -> Any:
    """The page's access hook: what the Django view decided, carried in the two headers it set."""
    from ..web import Access

    level = request.headers.get("x-dramatiq-reliable-access", "forbidden")
    user = request.headers.get("x-dramatiq-reliable-user")
    return Access(level, user=unquote(user) if user else None)


def _wsgi_app() -> Any:
    """The page's app for the current broker (rebuilt, the old one closed, when the broker was rebuilt)."""
    global _app
    broker = get_broker()
    with _lock:
        if _app is None or _app[0] is not broker:
            from ..web import create_wsgi_app

            if _app is not None:
                _app[1].app.state.settings.close()
            options = dict(reliable_settings().web_options)
            _app = (broker, create_wsgi_app(broker=broker, access=_from_view, **options))
        return _app[1]


def close_page() -> None:
    """Close the page's pools (the broker they were built on is being closed)."""
    global _app
    with _lock:
        if _app is not None:
            _app[1].app.state.settings.close()
            _app = None


on_reset(close_page)


def _level(request: HttpRequest) -> str:
    decide = reliable_settings().web_access or default_access
    level = decide(request.user)
    if level not in ("full", "read", "forbidden"):
        raise ConfigurationError(
            f"DRAMATIQ_RELIABLE['WEB_ACCESS'] returned {level!r}; return 'full', 'read' or 'forbidden'"
        )
    return str(level)


@csrf_exempt  # type: ignore[untyped-decorator]  # the page refuses cross-site POSTs itself (Sec-Fetch-Site / Origin), see web/access.py
def page(request: HttpRequest, path: str = "") -> HttpResponse | StreamingHttpResponse:
    """Serve the page's ``path`` to a user Django signed in; anonymous users go to ``LOGIN_URL``."""
    if not request.user.is_authenticated:
        if request.method in ("GET", "HEAD"):
            from django.contrib.auth.views import redirect_to_login

            return redirect_to_login(request.get_full_path(), django_settings.LOGIN_URL)
        return HttpResponseForbidden("sign in first")
    level = _level(request)
    if level == "forbidden":
        return HttpResponseForbidden("your account may not see the jobs page; ask for staff access")
    environ = _environ(request, path)
    environ[_LEVEL] = level
    environ[_USER] = quote(request.user.get_username())
    return _call(_wsgi_app(), environ)


def _environ(request: HttpRequest, path: str) -> dict[str, Any]:
    """A WSGI environ for the page: mounted where the URLconf matched, headers the client set to
    pass our access decision removed, and the body re-readable (Django may have read it)."""
    environ = {key: value for key, value in request.META.items() if key not in (_LEVEL, _USER)}
    tail = "/" + path
    # PATH_INFO is latin-1 text of UTF-8 bytes in WSGI; the URL kwarg is decoded text.
    raw_tail = tail.encode("utf-8").decode("latin-1")
    raw_path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", request.path))
    mount = raw_path[: len(raw_path) - len(raw_tail)] if raw_path.endswith(raw_tail) else raw_path.rstrip("/")
    environ["SCRIPT_NAME"] = mount.rstrip("/")
    environ["PATH_INFO"] = raw_tail
    environ["wsgi.input"] = io.BytesIO(request.body)
    environ["CONTENT_LENGTH"] = str(len(request.body))
    environ.setdefault("wsgi.url_scheme", request.scheme)
    environ.setdefault("wsgi.errors", io.StringIO())
    environ.setdefault("wsgi.version", (1, 0))
    environ.setdefault("SERVER_PROTOCOL", "HTTP/1.1")
    return environ


def _call(app: Any, environ: dict[str, Any]) -> HttpResponse:
    started: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started["status"], started["headers"] = status, headers
        return lambda data: None

    chunks = app(environ, start_response)
    try:
        body = b"".join(chunks)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    response = HttpResponse(body, status=int(started["status"].split(" ", 1)[0]))
    for name, value in started["headers"]:
        if name.lower() == "set-cookie":
            response.cookies.load(value)
        elif name.lower() != "content-length":
            response[name] = value
    return response
