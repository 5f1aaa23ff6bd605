"""The jobs pages: find a job by id, its page, the lists by state, and its cancel button.

The job page is what ``dramatiq-reliable jobs show ID`` prints, read through the same
:func:`~dramatiq_reliable.show_job` (plus, in its snapshot, the cancellation's who and when and the
dead letter to link to); the list is ``jobs list``; the cancel button is ``jobs cancel`` through
:func:`~dramatiq_reliable.cancel_job`.  The search box in every page's header sends the id it is
given (a message id, or an idempotency key) to the job page, which looks it up as ``jobs show``
does.

Cancel sits behind the rules replay does: the gate in :mod:`.app` lets through only same-site
POSTs from users with full access (read-only users see no button, and their POST gets 403); the
first POST answers with a confirmation saying what cancelling this job does where it is now; the
re-post with ``confirm=1`` cancels, as the access hook's user, and redirects to the job page,
which then says "cancelled by ... at ...".  A job that already finished is left alone, and the
page says so.

The pages never show a message's arguments (``show_job`` does not read them): what the job ran
with is on its dead letter's page, which honours ``hide_args``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import events
from .._checks import MAX_QUEUE_BYTES, check_text, shown
from ..errors import ConfigurationError, JobNotFound
from ..idempotency.keys import MAX_KEY_BYTES
from ..jobs.cancel import UNKNOWN, cancel_job
from ..jobs.detail import JobDetail, job_detail
from ..jobs.lookup import LISTABLE_STATES, list_jobs
from ..workflows.status import batch_of_job
from .actions import WebAction, who
from .rendering import Flash, add_flash, link, render
from .views import settings_of
from .workflows import workflow_of_job

__all__: list[str] = []

#: What the page calls each state (``jobs show`` prints the names).
STATE_LABELS = {
    "waiting": "waiting",
    "scheduled": "scheduled",
    "published_no_news": "published, no news",
    "retrying": "retrying",
    "running": "running",
    "done": "done",
    "dead": "dead",
    "cancelled": "cancelled",
}
#: The states a cancel can still stop; the others are over (done, dead) or already cancelled.
CANCELLABLE = ("waiting", "scheduled", "published_no_news", "retrying", "running")
#: What a cancel does, by the state the job is in when the confirmation is drawn.
CANCEL_EFFECTS = {
    "waiting": "its row is deleted from the outbox or the Postgres queue table: it never runs",
    "scheduled": "its row is deleted from the outbox or the Postgres queue table: it never runs",
    "retrying": "a retry still waiting in Postgres is deleted; one waiting in RabbitMQ is skipped when it "
    "is delivered (workers need the Cancellation middleware)",
    "published_no_news": "it is in RabbitMQ: a worker skips it when it is delivered, and a job already "
    "running stops at its next is_cancelled() check (workers need the Cancellation middleware)",
    "running": "a worker holds it: it stops at its next is_cancelled() check, or is skipped if it is "
    "delivered again (workers need the Cancellation middleware)",
}
#: An actor or queue name longer than this matches no job: refused before the query.
_MAX_NAME_CHARS = 255
_REASON_CHARS = 2000


def check_job_id(value: Any) -> str:
    """A searched id as ``show_job`` can look it up: non-empty, storable text, within the key size.

    The longest id worth a look-up is an idempotency key (message ids are 36 characters), which
    ``send()`` refuses past :data:`~dramatiq_reliable.idempotency.keys.MAX_KEY_BYTES` bytes.
    Whitespace around a pasted id is dropped.
    """
    text = value.strip() if isinstance(value, str) else value
    fix = "paste a message id (a UUID) or an idempotency key"
    check_text("job id", text, max_chars=MAX_KEY_BYTES, fix=fix)
    if len(text.encode()) > MAX_KEY_BYTES:
        raise ConfigurationError(f"job id must be at most {MAX_KEY_BYTES} bytes in UTF-8, got {shown(text)}; {fix}")
    return str(text)


def _bad(request: Request, error: Exception, given: str = "") -> Response:
    return render(
        request,
        "error.html",
        {"page": "jobs", "title": "Not a job id", "error": str(error), "search": given},
        status_code=400,
    )


def _missing(request: Request, id: str, error: str) -> Response:
    return render(
        request,
        "error.html",
        {"page": "jobs", "title": "No such job", "error": error, "search": id, "testid": "job-missing"},
        status_code=404,
    )


def _draw(request: Request, id: str, template: str, context: Callable[[JobDetail], dict[str, Any]]) -> Response:
    """``template`` for the job ``id`` (looked up as ``jobs show`` does), or the 404 page."""
    settings = settings_of(request)
    try:
        found = job_detail(settings.reads.get(), settings.schema, id)
    except JobNotFound as error:
        return _missing(request, id, str(error))
    status = found.status
    label = STATE_LABELS.get(status.state, status.state)
    return render(request, template, {"page": "jobs", "status": status, "label": label, **context(found)})


# -- pages ---------------------------------------------------------------------------------------


def job(request: Request) -> Response:
    """One job by message id or idempotency key (``jobs show``); 404 with the search box for an unknown id."""
    given = request.query_params.get("id", "")
    try:
        id = check_job_id(given)
    except ConfigurationError as error:
        return _bad(request, error, given[:200])
    return _draw(
        request,
        id,
        "job.html",
        lambda found: {
            "title": f"Job {found.status.message_id}",
            "searched": id if id != found.status.message_id else None,
            "cancellation": found.cancellation,
            "dead_letter_id": found.dead_letter_id,
            "cancellable": found.status.state in CANCELLABLE,
            "batch": batch_of_job(
                settings_of(request).reads.get(), settings_of(request).schema, found.status.message_id
            ),
            "step": workflow_of_job(
                settings_of(request).reads.get(), settings_of(request).schema, found.status.message_id
            ),
        },
    )


def job_list(request: Request) -> Response:
    """The jobs retrying, dead or waiting, filtered by actor and queue (``jobs list``)."""
    settings = settings_of(request)
    params = request.query_params
    state = params.get("state") or "retrying"
    filters = {name: (params.get(name) or "").strip() for name in ("actor", "queue")}
    try:
        if state not in LISTABLE_STATES:
            raise ConfigurationError(f"state must be one of {LISTABLE_STATES!r}, got {shown(state)}")
        check_text(
            "actor", filters["actor"] or None, max_chars=_MAX_NAME_CHARS, allow_none=True, fix="give an actor name"
        )
        check_text(
            "queue", filters["queue"] or None, max_chars=MAX_QUEUE_BYTES, allow_none=True, fix="give a queue name"
        )
    except ConfigurationError as error:
        return render(
            request, "error.html", {"page": "jobs", "title": "Bad filter", "error": str(error)}, status_code=400
        )
    rows = list_jobs(
        settings.reads.get(),
        settings.schema,
        state=state,
        actor=filters["actor"] or None,
        queue=filters["queue"] or None,
        limit=settings.page_size,
    )
    return render(
        request,
        "jobs.html",
        {
            "page": "jobs",
            "rows": rows,
            "state": state,
            "states": LISTABLE_STATES,
            "filters": filters,
            "limit": settings.page_size,
        },
    )


# -- cancel --------------------------------------------------------------------------------------


async def cancel(request: Request) -> Response:
    """Confirm, then cancel one job by message id (``jobs cancel``), and go back to its page."""
    settings = settings_of(request)
    form = await request.form()
    given = str(form.get("id") or "")
    try:
        id = check_job_id(given)
        reason = _reason(form)
    except ConfigurationError as error:
        return _bad(request, error, given[:200])
    if form.get("confirm") != "1":
        return await run_in_threadpool(
            _draw,
            request,
            id,
            "job_cancel.html",
            lambda found: {
                "title": f"Cancel job {found.status.message_id}",
                "effect": CANCEL_EFFECTS.get(found.status.state),
                "reason": reason or "",
            },
        )
    actor = who(request)
    try:
        result = await run_in_threadpool(
            cancel_job, settings.actions.database, settings.schema, id, by=actor, reason=reason
        )
    except ConfigurationError as error:  # an id longer than a message id can be
        return _bad(request, error, given[:200])
    events.emit(
        WebAction(
            action="job.cancel",
            who=actor,
            selection=f"job {id}",
            matched=0 if result.outcome == UNKNOWN else 1,
            done=1 if result.changed else 0,
            refused=0 if result.changed or result.outcome == UNKNOWN else 1,
        )
    )
    if result.outcome == UNKNOWN:
        return _missing(
            request,
            id,
            f"no job with message id {id!r} in Postgres, so nothing was cancelled; check the id, or it was "
            "purged by retention",
        )
    kind = "ok" if result.changed else "warn"
    response = RedirectResponse(link(request, "job", {"id": id}), status_code=303)
    add_flash(request, response, Flash(f"job {id}: {result.describe()}", kind))
    return response


def _reason(form: FormData) -> str | None:
    reason = str(form.get("reason") or "").strip() or None
    check_text("reason", reason, max_chars=_REASON_CHARS, allow_none=True, fix="give a shorter reason")
    return reason
