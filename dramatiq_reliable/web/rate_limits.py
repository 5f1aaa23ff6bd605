"""The flow-control page: which keys hold jobs back now, and why.

Three kinds of key, each read by the function ``dramatiq-reliable status`` reads, so the page and
the command agree: rate-limited keys (:func:`~dramatiq_reliable.flow.limited_keys`: paused until
when, jobs waiting on a token), order keys with jobs waiting (:func:`~dramatiq_reliable.flow.order_waiting`:
a dead head parks its key until its dead letter is replayed or discarded) and concurrency keys
with parked jobs (:func:`~dramatiq_reliable.flow.concurrency_waiting`).  GET only: a pause is the
provider's to lift, and parked jobs run on their own as their turn or slot comes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .. import schema as _schema
from ..flow import concurrency_waiting, limited_keys, order_waiting
from .rendering import render
from .views import settings_of

__all__ = []


def rate_limits(request: Request) -> Response:
    """The held keys, most pressing first: rate limits (paused, then most waiting), order, concurrency."""
    settings = settings_of(request)
    with settings.reads.get().connection() as conn:
        found = _schema.table_exists(conn, settings.schema, "rate_limit_buckets")
        items = limited_keys(conn, settings.schema) if found else []
        keyed = _schema.table_exists(conn, settings.schema, "order_jobs")
        ordered = order_waiting(conn, schema=settings.schema) if keyed else []
        parked = concurrency_waiting(conn, schema=settings.schema) if keyed else []
        conn.rollback()
    context = {"page": "rate-limits", "items": items, "table": found, "ordered": ordered, "parked": parked}
    return render(request, "rate_limits.html", context)
