"""The batches pages: the newest batches with their progress, and one batch's progress and children.

The list is :func:`~dramatiq_reliable.workflows.status.list_batches` (counts summed over each
batch's shards, as ``batches show`` sums them), filtered by state; one batch's page is
:func:`~dramatiq_reliable.batch_status` (what ``dramatiq-reliable batches show ID`` prints) plus
its children, dead and pending first, each linked to its job page.  The job page links back to a
child's batch (:func:`~dramatiq_reliable.workflows.status.batch_of_job`).

The one action is the cancel button (``batches cancel ID`` through
:func:`~dramatiq_reliable.cancel_batch`), behind the rules of the job page's cancel: the gate in
:mod:`.app` lets through only same-site POSTs from users with full access (read-only users see
no button, and their POST gets 403); the first POST answers with a confirmation saying what the
cancel does; the re-post with ``confirm=1`` cancels, as the access hook's user, and redirects to
the batch's page with what happened.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import events
from .._checks import check_text
from ..errors import ConfigurationError, JobNotFound
from ..workflows.status import (
    BATCH_STATES,
    CHILD_STATES,
    batch_children,
    batch_status,
    cancel_batch,
    list_batches,
)
from .actions import WebAction, who
from .rendering import Flash, add_flash, link, render
from .views import settings_of

__all__: list[str] = []

#: A batch id is at most this long (``Batch(id=...)`` refuses longer ones).
_MAX_ID_CHARS = 200
#: The longest reason the cancel takes (as the job cancel's).
_REASON_CHARS = 2000
#: The states a cancel can still stop.
CANCELLABLE = ("open", "running")


def _bad(request: Request, title: str, error: Exception, status_code: int = 400) -> Response:
    return render(
        request, "error.html", {"page": "batches", "title": title, "error": str(error)}, status_code=status_code
    )


def batch_list(request: Request) -> Response:
    """The newest batches (``?state=`` open, running, succeeded or failed), at most a page of them."""
    settings = settings_of(request)
    state = request.query_params.get("state") or None
    if state is not None and state not in BATCH_STATES:
        error = ConfigurationError(
            f"state must be one of {', '.join(BATCH_STATES)}, got {state[:60]!r}; or none for all"
        )
        return _bad(request, "Bad filter", error)
    rows = list_batches(settings.reads.get(), settings.schema, state=state, limit=settings.page_size)
    context = {"page": "batches", "rows": rows, "state": state, "states": BATCH_STATES, "limit": settings.page_size}
    return render(request, "batches.html", context)


def batch(request: Request) -> Response:
    """One batch by id (``batches show ID``) and its children (``?state=`` pending, done or dead); 404 if unknown."""
    settings = settings_of(request)
    given = request.query_params.get("id", "").strip()
    child_state = request.query_params.get("state") or None
    try:
        id = check_text("batch id", given, max_chars=_MAX_ID_CHARS, fix="give the id of Batch(...).id")
        if child_state is not None and child_state not in CHILD_STATES:
            raise ConfigurationError(
                f"state must be one of {', '.join(CHILD_STATES)}, got {child_state[:60]!r}; or none for every child"
            )
    except ConfigurationError as error:
        return _bad(request, "Not a batch id", error)
    database = settings.reads.get()
    try:
        status = batch_status(database, settings.schema, id)
    except JobNotFound as error:
        return _bad(request, "No such batch", error, status_code=404)
    children = batch_children(database, settings.schema, id, state=child_state, limit=settings.page_size)
    context = {
        "page": "batches",
        "title": f"Batch {status.id}",
        "status": status,
        "children": children,
        "child_state": child_state,
        "child_states": CHILD_STATES,
        "limit": settings.page_size,
        "cancellable": status.state in CANCELLABLE,
    }
    return render(request, "batch.html", context)


async def cancel(request: Request) -> Response:
    """Confirm, then cancel one batch by id (``batches cancel``), and go back to its page."""
    settings = settings_of(request)
    form = await request.form()
    given = str(form.get("id") or "").strip()
    try:
        id = check_text("batch id", given, max_chars=_MAX_ID_CHARS, fix="give the id of Batch(...).id")
        reason = str(form.get("reason") or "").strip() or None
        check_text("reason", reason, max_chars=_REASON_CHARS, allow_none=True, fix="give a shorter reason")
    except ConfigurationError as error:
        return _bad(request, "Not a batch id", error)
    if form.get("confirm") != "1":
        try:
            status = await run_in_threadpool(batch_status, settings.reads.get(), settings.schema, id)
        except JobNotFound as error:
            return _bad(request, "No such batch", error, status_code=404)
        context = {
            "page": "batches",
            "title": f"Cancel batch {status.id}",
            "status": status,
            "cancellable": status.state in CANCELLABLE,
            "reason": reason or "",
        }
        return render(request, "batch_cancel.html", context)
    actor = who(request)
    try:
        result = await run_in_threadpool(
            cancel_batch, settings.actions.database, settings.schema, id, by=actor, reason=reason
        )
    except JobNotFound as error:
        return _bad(request, "No such batch", error, status_code=404)
    events.emit(
        WebAction(
            action="batch.cancel",
            who=actor,
            selection=f"batch {id}",
            matched=1,
            done=1 if result.changed else 0,
            refused=0 if result.changed else 1,
        )
    )
    if result.changed:
        flash = Flash(
            f"batch {id}: cancelled; its callback never fires, {len(result.jobs):,} unfinished child(ren) cancelled"
        )
    else:
        flash = Flash(f"batch {id}: already {result.state}; nothing changed", "warn")
    response = RedirectResponse(link(request, "batch", {"id": id}), status_code=303)
    add_flash(request, response, flash)
    return response
