"""The pages (GET only, never a change): overview, dead-letter groups, list and detail, outbox, schedules.

(The jobs pages are in :mod:`.jobs`, beside their cancel action.)

Each page reads through the library, as the command line does, so the numbers match: the overview
is ``collect_health`` (``dramatiq-reliable status``), the dead-letter pages are
:class:`~dramatiq_reliable.PostgresDeadLetterStore` (``dead-letters stats|list|show``), the
outbox page ``outbox stats`` and its failing rows, the schedules page ``list_schedules``
(``schedules list``).  The endpoints are plain functions: Starlette runs them in its thread
pool, so the blocking psycopg calls never stall the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .._checks import shown
from ..dead_letters import DeadLetter, DeadLetterFilter
from ..dead_letters.validators import MAX_ID
from ..errors import ConfigurationError, SchemaNotReady
from ..health import collect_health
from ..outbox.admin import failing_rows, outbox_stats
from ..scheduler.admin import list_schedules
from ..tracing.propagation import TRACE_CONTEXT_KEY
from .rendering import render
from .settings import Settings

__all__ = []

#: The list's state choices, as ``dead-letters list --state`` takes them.
STATES = ("dead", "replayed", "discarded", "all")
#: The filter fields of the list, with the ``DeadLetterFilter`` field each one sets.
FILTER_FIELDS = {"queue": "queue_name", "actor": "actor_name", "fingerprint": "fingerprint", "error_type": "error_type"}
#: An unpublished outbox row older than this is drawn as a problem (a relay that stopped).
OUTBOX_AGE_PROBLEM_S = 60.0
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


# -- overview ------------------------------------------------------------------------------------


def overview(request: Request) -> Response:
    """Every queue's health numbers, the table refreshed in place every 5 s by htmx."""
    return render(request, "overview.html", {"page": "overview", **_health(request)})


def overview_fragment(request: Request) -> Response:
    """The overview table alone, for htmx to swap in."""
    return render(request, "_overview.html", _health(request), flash=False)


def _health(request: Request) -> dict[str, Any]:
    """The overview's reading: ``collect_health`` as ``status`` calls it, with its two full scans
    (every queue the outbox ever saw, the retries not yet due) run at most once per
    ``scan_interval_ms`` and remembered in between, so a page refreshing every 5 s in several
    tabs costs the partial-index backlog query, not a scan of the whole outbox, each time."""
    settings = settings_of(request)
    scan = settings.scan_due()
    _, known, retries = settings.last_scan()
    health = collect_health(
        database=settings.reads.get(),
        schema=settings.schema,
        rabbitmq=settings.rabbitmq,
        queues=[*settings.queues, *known],
        discover_queues=scan,
        retries_waiting=scan,
        statement_timeout_ms=settings.reads.statement_timeout_ms,
    )
    if scan and health.postgres_error is None:
        found = {item.queue: item.retries_waiting or 0 for item in health.queues}
        settings.remember_scan(list(found), found)
    elif scan:
        settings.forget_scan()
    else:
        # Between scans: the remembered count for the queues it covered, "-" for a queue new since.
        health = dataclasses.replace(
            health,
            queues=tuple(dataclasses.replace(item, retries_waiting=retries.get(item.queue)) for item in health.queues),
        )
    scanned_at, _, _ = settings.last_scan()
    problems = [problem for problem in (health.postgres_error, health.rabbitmq_error) if problem]
    if health.dead_letters_table is False:
        problems.append(
            "no dead-letter table in this schema, so dead letters are not counted; run 'dramatiq-reliable migrate'"
        )
    # Where Postgres and RabbitMQ both hold queues' messages, the cells say how each sum splits.
    both_sources = health.queue_sources == {"postgres", "rabbitmq"}
    return {
        "health": health,
        "totals": health.totals(),
        "both_sources": both_sources,
        "split_legend": both_sources
        and (
            health.postgres_error is not None
            or any(
                item.in_postgres is not None and (item.in_postgres.depth or item.in_postgres.delayed)
                for item in health.queues
            )
        ),
        "problems": problems,
        "outbox_age_problem_s": OUTBOX_AGE_PROBLEM_S,
        "scanned_ago_s": max(0.0, time.monotonic() - scanned_at) if scanned_at > float("-inf") else None,
    }


# -- dead letters --------------------------------------------------------------------------------


def dead_letter_groups(request: Request) -> Response:
    """Dead letters grouped by fingerprint, biggest first (``dead-letters stats``)."""
    store = settings_of(request).read_store()
    groups = store.stats(limit=100)
    total = store.count()
    return render(request, "dead_letters.html", {"page": "dead-letters", "groups": groups, "total": total})


def parse_filter(values: Mapping[str, Any]) -> DeadLetterFilter:
    """The filter fields of a query string or form (empty ones ignored) as a ``DeadLetterFilter``."""
    given = {
        field: str(values[name]).strip()
        for name, field in FILTER_FIELDS.items()
        if values.get(name) is not None and str(values[name]).strip()
    }
    return DeadLetterFilter(**given)  # type: ignore[arg-type]


def dead_letter_list(request: Request) -> Response:
    """The dead letters matching a filter, newest first, a page at a time (``dead-letters list``)."""
    settings = settings_of(request)
    params = request.query_params
    try:
        where = parse_filter(params)
    except ConfigurationError as error:
        return render(
            request, "error.html", {"page": "dead-letters", "title": "Bad filter", "error": str(error)}, status_code=400
        )
    state = params.get("state") or "dead"
    if state not in STATES:
        return render(
            request,
            "error.html",
            {
                "page": "dead-letters",
                "title": "Bad filter",
                "error": f"state must be one of {STATES!r}, got {shown(state)}",
            },
            status_code=400,
        )
    cursor = params.get("cursor") or None
    store = settings.read_store()
    try:
        page = store.list(where=where, state=None if state == "all" else state, limit=settings.page_size, cursor=cursor)  # type: ignore[arg-type]
    except ConfigurationError as error:
        return render(
            request, "error.html", {"page": "dead-letters", "title": "Bad page", "error": str(error)}, status_code=400
        )
    total = store.count(where=where, state=None if state == "all" else state)  # type: ignore[arg-type]
    filters = {name: params.get(name) or "" for name in FILTER_FIELDS}
    return render(
        request,
        "dead_letter_list.html",
        {
            "page": "dead-letters",
            "items": page.items,
            "next_cursor": page.next_cursor,
            "first_page": cursor is None,
            "total": total,
            "filters": filters,
            "state": state,
            "states": STATES,
            "described": where.describe(),
        },
    )


def dead_letter(request: Request) -> Response:
    """One dead letter: its error, traceback, attempts, classification, trace id, arguments (``dead-letters show``)."""
    settings = settings_of(request)
    given = str(request.path_params["id"])
    # ASCII digits of a bigint only: int() also takes "1_0" and other scripts' digits.
    dead_letter_id = int(given) if given.isascii() and given.isdigit() and len(given) <= 19 else 0
    item = settings.read_store().get(dead_letter_id) if 0 < dead_letter_id <= MAX_ID else None
    if item is None:
        return render(
            request,
            "error.html",
            {
                "page": "dead-letters",
                "title": "Not found",
                "error": f"dead letter {dead_letter_id or shown(given)} not found; it may have been purged",
            },
            status_code=404,
        )
    return render(
        request,
        "dead_letter.html",
        {
            "page": "dead-letters",
            "item": item,
            "trace_id": trace_id(item),
            "arguments": None if settings.hide_args else arguments(item),
            "options": options(item),
            "retry_decision": json.dumps(item.retry_decision, indent=2, sort_keys=True, default=str)
            if item.retry_decision
            else None,
        },
    )


def trace_id(item: DeadLetter) -> str | None:
    """The W3C trace id the job was sent under, when ``Tracing`` recorded one."""
    context = (item.message or {}).get("options", {}).get(TRACE_CONTEXT_KEY)
    if isinstance(context, Mapping):
        match = _TRACEPARENT.match(str(context.get("traceparent", "")))
        if match:
            return match.group(1)
    return None


def arguments(item: DeadLetter) -> str:
    """The message's ``args`` and ``kwargs`` as indented JSON."""
    message = item.message or {}
    return json.dumps(
        {"args": message.get("args"), "kwargs": message.get("kwargs")}, indent=2, sort_keys=True, default=str
    )


def options(item: DeadLetter) -> str:
    """The message's options without the traceback copy Dramatiq keeps there (it is shown once, apart)."""
    shown = dict((item.message or {}).get("options") or {})
    shown.pop("traceback", None)
    return json.dumps(shown, indent=2, sort_keys=True, default=str)


# -- outbox --------------------------------------------------------------------------------------


def outbox(request: Request) -> Response:
    """The backlog per queue and the rows that fail on their own, with their last error (``outbox stats``)."""
    settings = settings_of(request)
    health = collect_health(
        database=settings.reads.get(),
        schema=settings.schema,
        queues=settings.queues,
        discover_queues=False,
        statement_timeout_ms=settings.reads.statement_timeout_ms,
    )
    if health.postgres_error:
        return render(
            request,
            "error.html",
            {
                "page": "outbox",
                "title": "Postgres cannot be read",
                "error": health.postgres_error,
                "testid": "unreachable",
            },
            status_code=503,
        )
    with settings.reads.get().connection() as conn:
        stats = outbox_stats(conn, schema_name=settings.schema)
        poison = failing_rows(conn, schema_name=settings.schema, limit=100)
    rows = [item for item in health.queues if item.outbox_backlog or item.outbox_scheduled]
    return render(
        request,
        "outbox.html",
        {
            "page": "outbox",
            "rows": rows,
            "stats": stats,
            "poison": poison,
            "outbox_age_problem_s": OUTBOX_AGE_PROBLEM_S,
        },
    )


# -- schedules -----------------------------------------------------------------------------------


def schedules(request: Request) -> Response:
    """Every stored schedule with its last and next run and its state (``schedules list``)."""
    settings = settings_of(request)
    try:
        items = list_schedules(settings.reads.get(), schema=settings.schema)
    except SchemaNotReady as error:
        return render(request, "schedules.html", {"page": "schedules", "items": [], "not_ready": str(error)})
    return render(request, "schedules.html", {"page": "schedules", "items": items, "not_ready": None})
