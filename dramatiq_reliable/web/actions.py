"""The actions (POST only): replay and discard dead letters, retry failing outbox rows, pause, resume, trigger schedules.

(Cancelling a job is in :mod:`.jobs`, beside the job page; cancelling a batch in :mod:`.batches`.)

By the time a handler runs, the gate in :mod:`.app` has let through only same-site POSTs from
users with full access.  A replay or discard first answers with a confirmation page saying how
many rows it will touch and how many the age rule refuses; only the re-post with ``confirm=1``
acts, through the same store calls as ``dramatiq-reliable dead-letters replay|discard`` (so the
same rules: only rows still dead, jobs first sent longer ago than the age limit left dead
unless forced), then redirects (303) to the list with a flash message of what happened.

Every action emits a :class:`WebAction` event (who, what, the selection, the counts), which the
events module also logs at INFO.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import events
from .._checks import shown
from .._util import format_age
from ..dead_letters.selection import Selection, Verb
from ..dead_letters.validators import MAX_ID
from ..errors import ConfigurationError, ScheduleDisabled, ScheduleNotFound
from ..outbox.admin import retry_failing
from ..scheduler.admin import pause_schedule, resume_schedule, trigger_schedule
from .access import Access
from .rendering import Flash, add_flash, link, render
from .views import FILTER_FIELDS, parse_filter, settings_of

__all__ = ["WebAction"]

logger = logging.getLogger("dramatiq_reliable.web")

_MAX_IDS = 10_000
_SCHEDULE_VERBS = ("pause", "resume", "trigger")


@dataclasses.dataclass(frozen=True)
class WebAction(events.Event):
    """Someone acted from the web page: ``who`` (the access hook's user, else the client address),
    ``action`` (``dead_letters.replay``, ``dead_letters.discard``, ``outbox.retry``,
    ``schedule.pause``, ``schedule.resume``, ``schedule.trigger``, ``job.cancel``, ``batch.cancel``,
    ``workflow.cancel``), ``selection`` (what it applied
    to, as people read it), ``matched`` (rows it found), ``done`` (rows changed) and ``refused``
    (rows left alone: too old, already handled)."""

    name: ClassVar[str] = "web.action"
    level: ClassVar[int] = logging.INFO
    action: str
    who: str
    selection: str
    matched: int
    done: int
    refused: int = 0
    forced: bool = False


def who(request: Request) -> str:
    """Who acts, for the events and the dead letters' ``handled_by``: ``web:<user>`` or ``web:<client address>``."""
    access: Access = request.state.access
    if access.user:
        return f"web:{access.user}"
    return f"web:{request.client.host if request.client else 'unknown'}"


def _fields(selection: Selection) -> list[tuple[str, str]]:
    """The form fields that pick the same rows again (for the confirmation's re-post)."""
    pairs = [("id", str(item)) for item in selection.ids or ()]
    for name, field in FILTER_FIELDS.items():
        value = getattr(selection.where, field)
        if value is not None:
            pairs.append((name, value))
    return pairs


def _list_query(selection: Selection) -> dict[str, str]:
    """The list page's query showing what is left of the selection's filter."""
    return {
        name: getattr(selection.where, field)
        for name, field in FILTER_FIELDS.items()
        if getattr(selection.where, field)
    }


def _selection(form: FormData) -> Selection:
    """The rows a form picks: ids, a filter (a group is its fingerprint), or both (their intersection).

    Raises ``ConfigurationError`` for a form that picks nothing: the page has no "every dead
    letter" button, as the command line takes ``--all`` for that.
    """
    ids: list[int] = []
    for value in (str(item) for item in form.getlist("id")):
        if not (value.isascii() and value.isdigit() and len(value) <= 19) or not 0 < int(value) <= MAX_ID:
            raise ConfigurationError(f"{shown(value)} is not a dead letter id")
        ids.append(int(value))
    if len(ids) > _MAX_IDS:
        raise ConfigurationError(f"{len(ids)} ids in one request; select at most {_MAX_IDS}, or use a filter")
    where = parse_filter(form)
    try:
        return Selection.of(ids, where)
    except ConfigurationError:
        raise ConfigurationError(
            "select at least one dead letter (tick its box), or act on a group or a filter"
        ) from None


def _back(request: Request, selection: Selection) -> str:
    if selection.ids is not None and len(selection.ids) == 1 and selection.where.is_empty:
        return link(request, "dead_letter", id=selection.ids[0])
    return link(request, "dead_letter_list", _list_query(selection))


def _refuse(request: Request, error: Exception, page: str) -> Response:
    return render(request, "error.html", {"page": page, "title": "Nothing done", "error": str(error)}, status_code=400)


def _age(ms: int | None) -> str | None:
    return None if ms is None else format_age(ms / 1000)


# -- dead letters --------------------------------------------------------------------------------


async def replay(request: Request) -> Response:
    """Confirm, then replay the selected dead letters (``dead-letters replay``)."""
    return await _dead_letter_action(request, "replay")


async def discard(request: Request) -> Response:
    """Confirm, then discard the selected dead letters (``dead-letters discard``)."""
    return await _dead_letter_action(request, "discard")


async def _dead_letter_action(request: Request, verb: Verb) -> Response:
    settings = settings_of(request)
    form = await request.form()
    try:
        selection = _selection(form)
    except ConfigurationError as error:
        return _refuse(request, error, "dead-letters")
    force = form.get("force") == "1"
    reason = str(form.get("reason") or "").strip() or None
    store = settings.actions
    if form.get("confirm") != "1":
        # The count is a dashboard query: on the bounded pool.  Previewed unforced, so the page
        # says how many the age rule refuses whether or not force is ticked yet.
        preview = await run_in_threadpool(selection.preview, settings.read_store(), verb)
        return render(
            request,
            "confirm.html",
            {
                "page": "dead-letters",
                "verb": verb,
                "total": preview.total,
                "too_old": preview.too_old,
                "max_age": _age(settings.replay_max_age_ms),
                "selection": selection.describe(),
                "fields": _fields(selection),
                "force": force,
                "action_url": link(request, verb),
                "back": _back(request, selection),
            },
        )
    actor = who(request)
    flashes: list[Flash] = []
    if verb == "replay":
        replayed = await run_in_threadpool(
            store.replay, ids=selection.ids, where=selection.where, force=force, by=actor
        )
        problems: Mapping[int, str] = replayed.problems
        done, refused = replayed.replayed, replayed.too_old + len(problems)
        where_to = (
            "their queues through the outbox; the relay publishes them"
            if settings.target == "outbox"
            else "their Postgres queues; PostgresBroker workers take them from the queue table"
        )
        flashes.append(Flash(f"replayed {done:,} dead letter(s) to {where_to}", "ok" if done else "warn"))
        if replayed.too_old:
            flashes.append(
                Flash(
                    f"{replayed.too_old:,} first sent more than {_age(settings.replay_max_age_ms)} ago stayed dead: "
                    "replay them with force ticked, or discard them",
                    "warn",
                )
            )
    else:
        discarded = await run_in_threadpool(
            store.discard, ids=selection.ids, where=selection.where, note=reason, by=actor
        )
        problems = discarded.problems
        done, refused = discarded.discarded, len(problems)
        flashes.append(Flash(f"discarded {done:,} dead letter(s)", "ok" if done else "warn"))
    flashes.extend(_problem_flashes(problems, verb))
    events.emit(
        WebAction(
            action=f"dead_letters.{verb}",
            who=actor,
            selection=selection.describe(),
            matched=done + refused,
            done=done,
            refused=refused,
            forced=force,
        )
    )
    response = RedirectResponse(link(request, "dead_letter_list", _list_query(selection)), status_code=303)
    add_flash(request, response, *flashes)
    return response


def _problem_flashes(problems: Mapping[int, str], verb: str) -> list[Flash]:
    if not problems:
        return []
    by_problem: dict[str, list[int]] = {}
    for dead_letter_id, problem in sorted(problems.items()):
        by_problem.setdefault(problem, []).append(dead_letter_id)
    return [Flash(f"{len(ids):,} not {verb}ed ({_ids(ids)}): {problem}", "warn") for problem, ids in by_problem.items()]


def _ids(ids: Sequence[int]) -> str:
    shown = ", ".join(str(item) for item in ids[:10])
    return f"id {shown}" if len(ids) == 1 else f"ids {shown}" + (", ..." if len(ids) > 10 else "")


# -- outbox --------------------------------------------------------------------------------------


async def outbox_retry(request: Request) -> Response:
    """Give every unpublished row that failed on its own a fresh start (``outbox retry``)."""
    settings = settings_of(request)

    def run() -> int:
        with settings.actions.database.connection() as conn:
            return retry_failing(conn, schema_name=settings.schema)

    reset = await run_in_threadpool(run)
    actor = who(request)
    events.emit(WebAction(action="outbox.retry", who=actor, selection="failing outbox rows", matched=reset, done=reset))
    response = RedirectResponse(link(request, "outbox"), status_code=303)
    add_flash(request, response, Flash(f"reset {reset:,} failing row(s); the relay publishes them on its next pass"))
    return response


# -- schedules -----------------------------------------------------------------------------------


async def schedule_action(request: Request) -> Response:
    """Pause, resume or trigger one schedule (``schedules pause|resume|trigger``)."""
    settings = settings_of(request)
    name = str(request.path_params["name"])
    verb = str(request.path_params["verb"])
    if verb not in _SCHEDULE_VERBS:
        return render(
            request,
            "error.html",
            {
                "page": "schedules",
                "title": "Not found",
                "error": f"no action {shown(verb)}; use one of {_SCHEDULE_VERBS!r}",
            },
            status_code=404,
        )
    database = settings.actions.database
    flash: Flash
    done = 0
    try:
        if verb == "pause":
            await run_in_threadpool(pause_schedule, database, name, schema=settings.schema)
            flash, done = Flash(f"paused {name!r}: it does not fire until resumed"), 1
        elif verb == "resume":
            status: Any = await run_in_threadpool(resume_schedule, database, name, schema=settings.schema)
            flash, done = Flash(f"resumed {name!r}: it fires again from its next tick"), 1
            del status
        else:
            message_id = await run_in_threadpool(
                trigger_schedule, database, name, schema=settings.schema, target=settings.target
            )
            flash, done = Flash(f"triggered {name!r}: one run sent now (message {message_id})"), 1
    except ConfigurationError as error:
        # A name no schedule can have (a NUL, a lone surrogate, 200+ characters): no link of
        # the page leads here, so it gets a page saying so, not a flash on the list.
        return _refuse(request, error, "schedules")
    except (ScheduleNotFound, ScheduleDisabled) as error:
        flash = Flash(str(error), "error")
    events.emit(
        WebAction(action=f"schedule.{verb}", who=who(request), selection=name, matched=1, done=done, refused=1 - done)
    )
    response = RedirectResponse(link(request, "schedules"), status_code=303)
    add_flash(request, response, flash)
    return response
