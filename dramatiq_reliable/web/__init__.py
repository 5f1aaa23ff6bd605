"""The web page for the person on call: health, dead letters by cause, replay and discard, outbox, schedules,
jobs by id and their cancel button.

An ASGI app (Starlette, Jinja2 templates, a vendored htmx; no JavaScript build) to mount inside
your own app or run alone with ``dramatiq-reliable web``.  Read-only on loopback unless an access
hook says otherwise; every action is a same-site POST, confirmed, and emitted as a
:class:`WebAction` event.  Needs the ``web`` extra: ``pip install 'dramatiq-reliable[web]'``.

>>> from dramatiq_reliable.web import Access, create_app                              # doctest: +SKIP
>>> app.mount("/jobs", create_app(broker, access=lambda request: Access("full", user="ann")))  # doctest: +SKIP
"""

try:
    import jinja2 as _jinja2  # noqa: F401
    import python_multipart as _multipart  # noqa: F401
    import starlette as _starlette  # noqa: F401
except ImportError as _error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"dramatiq_reliable.web needs the 'web' extra ({_error.name} is not installed); "
        "run: pip install 'dramatiq-reliable[web]'"
    ) from _error

from .access import Access
from .actions import WebAction
from .app import create_app, create_wsgi_app

__all__ = ["Access", "WebAction", "create_app", "create_wsgi_app"]
