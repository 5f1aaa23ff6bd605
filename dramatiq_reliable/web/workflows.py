"""The workflows pages: the newest workflows, one workflow's stages and steps, and its cancel button.

The list is :func:`~dramatiq_reliable.workflows.list_workflows` filtered by state; one workflow's
page is :func:`~dramatiq_reliable.workflows.workflow_status` (what ``dramatiq-reliable workflows
show ID`` prints): its state, error and policy, then each stage's steps with their state, actor,
message id (linked to the job page), a preview of what they returned (``hidden`` under
``hide_args``) and when they were sent and finished.  A dead step that holds the workflow under ``if_step_dies="wait"`` is marked, with a
link to its job page, where its dead letter is one click away to replay.

Cancel is :func:`~dramatiq_reliable.workflows.cancel_workflow` behind the rules of the job
cancel: the gate in :mod:`.app` lets through only same-site POSTs from users with full access
(read-only users see no button, and their POST gets 403); the first POST answers with a
confirmation saying what cancelling does to this workflow's steps now; the re-post with
``confirm=1`` cancels, as the access hook's user, and redirects to the workflow's page.  The job
page links a step back to its workflow through
:func:`~dramatiq_reliable.workflows.state.step_of`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import events
from .._checks import check_text
from ..database import Database
from ..errors import ConfigurationError, JobNotFound
from ..workflows.state import STATES, StepOf, WorkflowStatus, cancel_workflow, list_workflows, step_of, workflow_status
from .actions import WebAction, who
from .rendering import Flash, add_flash, link, render
from .views import settings_of

__all__: list[str] = []

#: A workflow id is at most this long (``Workflow(id=...)`` refuses longer ones).
_MAX_ID_CHARS = 200
_REASON_CHARS = 2000
#: The most characters of a step's result the page shows; the whole is in ``workflows show --json``.
RESULT_PREVIEW_CHARS = 120


def _bad(request: Request, title: str, error: Exception | str, status_code: int = 400) -> Response:
    return render(
        request, "error.html", {"page": "workflows", "title": title, "error": str(error)}, status_code=status_code
    )


def _check_id(given: str) -> str:
    checked: str = check_text(
        "workflow id", given.strip(), max_chars=_MAX_ID_CHARS, fix="give the id of Workflow(...).id"
    )
    return checked


def preview(result: Any) -> str:
    """A step's result as one line of JSON, cut to :data:`RESULT_PREVIEW_CHARS` (``-`` for none)."""
    if result is None:
        return "-"
    text = json.dumps(result, ensure_ascii=False, separators=(", ", ": "), default=str)
    if len(text) <= RESULT_PREVIEW_CHARS:
        return text
    return text[: RESULT_PREVIEW_CHARS - 1] + "…"


def workflow_of_job(database: Database, schema: str, message_id: str) -> StepOf | None:
    """The workflow step ``message_id`` is, for the job page (``None`` if none, or before workflows)."""
    with database.autocommit() as conn:
        return step_of(conn, schema, message_id)


def workflow_list(request: Request) -> Response:
    """The newest workflows (``?state=`` running, succeeded, failed or cancelled), at most a page of them."""
    settings = settings_of(request)
    state = request.query_params.get("state") or None
    if state is not None and state not in STATES:
        error = ConfigurationError(f"state must be one of {', '.join(STATES)}, got {state[:60]!r}; or none for all")
        return _bad(request, "Bad filter", error)
    rows = list_workflows(settings.reads.get(), settings.schema, state=state, limit=settings.page_size)
    context = {"page": "workflows", "rows": rows, "state": state, "states": STATES, "limit": settings.page_size}
    return render(request, "workflows.html", context)


def _stages(status: WorkflowStatus, *, hide: bool) -> list[dict[str, Any]]:
    """The steps grouped by stage, in order, each with its result's preview (``hidden`` with
    ``hide_args``: a step's result is made from its arguments, and may hold the same personal data)."""
    stages: list[dict[str, Any]] = []
    for step in status.steps:
        if not stages or stages[-1]["number"] != step.stage:
            stages.append({"number": step.stage, "in_group": step.in_group, "steps": []})
        shown = "hidden" if hide and step.result is not None else preview(step.result)
        stages[-1]["steps"].append({"step": step, "preview": shown})
    return stages


def workflow(request: Request) -> Response:
    """One workflow by id (``workflows show ID``) and its steps; 404 if unknown."""
    settings = settings_of(request)
    try:
        id = _check_id(request.query_params.get("id", ""))
    except ConfigurationError as error:
        return _bad(request, "Not a workflow id", error)
    try:
        status = workflow_status(settings.reads.get(), settings.schema, id)
    except JobNotFound as error:
        return _bad(request, "No such workflow", error, status_code=404)
    context = {
        "page": "workflows",
        "title": f"Workflow {status.id}",
        "status": status,
        "stages": _stages(status, hide=settings.hide_args),
    }
    return render(request, "workflow.html", context)


async def cancel(request: Request) -> Response:
    """Confirm, then cancel one workflow (``workflows cancel``), and go back to its page."""
    settings = settings_of(request)
    form = await request.form()
    try:
        id = _check_id(str(form.get("id") or ""))
        reason = str(form.get("reason") or "").strip() or None
        check_text("reason", reason, max_chars=_REASON_CHARS, allow_none=True, fix="give a shorter reason")
    except ConfigurationError as error:
        return _bad(request, "Not a workflow id", error)
    if form.get("confirm") != "1":
        try:
            status = await run_in_threadpool(workflow_status, settings.reads.get(), settings.schema, id)
        except JobNotFound as error:
            return _bad(request, "No such workflow", error, status_code=404)
        context = {
            "page": "workflows",
            "title": f"Cancel workflow {status.id}",
            "status": status,
            "never_sent": sum(1 for step in status.steps if step.state == "waiting"),
            "sent": sum(1 for step in status.steps if step.state == "sent"),
            "reason": reason or "",
        }
        return render(request, "workflow_cancel.html", context)
    actor = who(request)
    try:
        result = await run_in_threadpool(
            cancel_workflow, settings.actions.database, settings.schema, id, by=actor, reason=reason
        )
    except JobNotFound as error:
        events.emit(WebAction(action="workflow.cancel", who=actor, selection=f"workflow {id}", matched=0, done=0))
        return _bad(request, "No such workflow", f"{error}; nothing was cancelled", status_code=404)
    events.emit(
        WebAction(
            action="workflow.cancel",
            who=actor,
            selection=f"workflow {id}",
            matched=1,
            done=1 if result.changed else 0,
            refused=0 if result.changed else 1,
        )
    )
    if result.changed:
        text = (
            f"workflow {id}: cancelled; {result.never_sent} step(s) will never be sent, "
            f"{len(result.jobs)} sent step(s) cancelled as jobs"
        )
        flash = Flash(text, "ok")
    else:
        flash = Flash(f"workflow {id}: already {result.state}; nothing changed", "warn")
    response = RedirectResponse(link(request, "workflow", {"id": id}), status_code=303)
    add_flash(request, response, flash)
    return response
