"""The rate-limits page: which keys are limited now, until when, and how many jobs wait on them.

It reads :func:`~dramatiq_reliable.flow.limited_keys`, the same rows ``dramatiq-reliable status``
lists under its table, so the page and the command agree.  GET only: a pause is the provider's
to lift, and the waiting jobs run on their own as their tokens come due.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import schema as _schema
from ..flow import limited_keys
from .rendering import render
from .views import settings_of

__all__ = []


def rate_limits(request: Request) -> Response:
    """The limited keys, most pressing first (paused, then most jobs waiting)."""
    settings = settings_of(request)
    with settings.reads.get().connection() as conn:
        found = _schema.table_exists(conn, settings.schema, "rate_limit_buckets")
        items = limited_keys(conn, settings.schema) if found else []
        conn.rollback()
    return render(request, "rate_limits.html", {"page": "rate-limits", "items": items, "table": found})
