"""The web app: its routes, the access gate in front of them, and the error pages.

:func:`create_app` returns a Starlette app to mount in your own (``app.mount("/jobs", ...)``) or
to run alone (``dramatiq-reliable web``); :func:`create_wsgi_app` wraps the same app for
Django and Flask.  Every request passes the gate first: a ``Host`` the page does not answer to
gets 400 (DNS rebinding, see :mod:`.security`), the access hook (or the loopback-only, read-only
default) decides, forbidden requests get 403, and a POST must be same-site and come from a user
with full access.  Every response, refusals and errors included, carries the security headers.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import q_name
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import _sql
from .._checks import check_bool, check_choice, check_int, check_ms, check_queue_name
from .._util import redact
from ..backing import SENDS_TO, SendsTo, postgres_backed
from ..dead_letters import DEFAULT_REPLAY_MAX_AGE_MS, PostgresDeadLetterStore
from ..errors import ConfigurationError, DatabaseUnavailable, SchemaNotReady
from ..queue_depths import QueueDepths
from . import actions, batches, jobs, rate_limits, views, workflows
from .access import Access, AccessHook, cross_site_problem, resolve
from .pools import ReadPool, action_database
from .rendering import render
from .security import LOOPBACK_HOSTS, SECURITY_HEADERS, check_allowed_hosts, host_problem, secured
from .settings import Settings

__all__ = ["create_app", "create_wsgi_app"]

logger = logging.getLogger("dramatiq_reliable.web")

_STATIC = Path(__file__).parent / "static"


def create_app(
    database: Any = None,
    *,
    schema: str | None = None,
    access: AccessHook | None = None,
    hide_args: bool = False,
    statement_timeout_ms: int = 2000,
    broker: Any = None,
    target: SendsTo | None = None,
    rabbitmq_url: str | None = None,
    queues: Iterable[str] = (),
    replay_max_age_ms: int | None = DEFAULT_REPLAY_MAX_AGE_MS,
    page_size: int = 50,
    scan_interval_ms: int = 60_000,
    allowed_hosts: Iterable[str] | None = None,
) -> Starlette:
    """The web page for the person on call, as a Starlette (ASGI) app.

    Parameters:
      database: where the tables are: a URL, a ``psycopg_pool.ConnectionPool`` or a
        :class:`~dramatiq_reliable.Database` (a broker's, say); optional with ``broker=``.
      schema: the schema of the tables (default: the broker's, else ``dramatiq_reliable``).
      access: the access hook, called with each request, returning an :class:`Access` (or
        ``"full"``, ``"read"``, ``"forbidden"``).  ``None``: read-only, loopback clients only.
      hide_args: show ``hidden`` instead of the messages' arguments, and of what workflow steps
        returned (they may hold personal data).
      statement_timeout_ms: the bound of every query a page runs; a page over it shows an error
        panel.  Actions are not bounded by it (they run as the command line runs them).
      broker: an ``OutboxBroker`` or ``PostgresBroker`` to take the database, schema, target and
        RabbitMQ connection from.
      target: where replays and manual schedule runs go: ``"outbox"`` (``OutboxBroker``: the relay
        publishes them) or ``"queue"`` (``PostgresBroker``'s queue table).  Default: from
        ``broker``, else ``"outbox"``.
      rabbitmq_url: read queue depths from this RabbitMQ (default: the ``OutboxBroker``'s, if
        given; none otherwise, and the depths show ``-``).
      queues: queues the overview always lists, besides those found in the tables.
      replay_max_age_ms: replays of jobs first sent longer ago are refused unless forced, as
        ``dead-letters replay --max-age`` (default 7 days); ``None`` never refuses.
      page_size: rows per page of the dead-letter list, and the most jobs the jobs list shows.
      scan_interval_ms: how often the overview runs ``status``'s two full scans of the outbox
        (the queues it ever saw, the retries not yet due); in between it reads the backlog
        through the outbox's partial index and shows the retries counted by the last scan.
      allowed_hosts: the ``Host`` names the page answers to besides ``localhost``, ``127.0.0.1``
        and ``[::1]`` (any port): exact names, or ``*.example.com`` for the names under it.  Any
        other ``Host`` gets 400, which stops DNS rebinding.  With no access hook the check always
        applies; with a hook only when ``allowed_hosts`` is given (see :mod:`.security` for why).

    >>> from starlette.applications import Starlette                                 # doctest: +SKIP
    >>> app = Starlette()                                                            # doctest: +SKIP
    >>> app.mount("/jobs", create_app("postgresql://app@localhost/app"))             # doctest: +SKIP
    """
    backed = postgres_backed(broker)
    if broker is not None and backed is None:
        raise ConfigurationError(
            f"broker= must be a Postgres-backed broker (OutboxBroker or PostgresBroker), got "
            f"{type(broker).__name__!r}; or pass database= and target= instead"
        )
    if database is None:
        if backed is None:
            raise ConfigurationError(
                "create_app() needs database= (a Postgres URL, a pool or a Database) or broker=; "
                "for example create_app('postgresql://app@localhost/app')"
            )
        database = backed.database
    if schema is None:
        schema = backed.schema if backed is not None else _sql.DEFAULT_SCHEMA
    _sql.validate_schema(schema)
    if target is None:
        target = backed.sends_to if backed is not None else "outbox"
    check_choice("target", target, SENDS_TO, fix="'outbox' for OutboxBroker, 'queue' for PostgresBroker")
    check_ms("statement_timeout_ms", statement_timeout_ms, minimum=1, fix="e.g. statement_timeout_ms=2000")
    check_ms("replay_max_age_ms", replay_max_age_ms, allow_none=True, fix="e.g. 7 days = 604800000, or None")
    check_bool("hide_args", hide_args)
    if access is not None and not callable(access):
        raise ConfigurationError(
            f"access= must be a callable of the request returning an Access, got {type(access).__name__!r}"
        )
    check_int("page_size", page_size, minimum=1, maximum=1000)
    queue_list = [str(name) for name in queues]
    for name in queue_list:
        check_queue_name("a name in queues=", q_name(name))
    check_ms("scan_interval_ms", scan_interval_ms, minimum=0, fix="e.g. scan_interval_ms=60000; 0 scans every time")
    # No hook: loopback clients are trusted, so only the names a person types for this machine
    # (and those given) are answered.  A hook: checked when the names are given (see .security).
    hosts = None if allowed_hosts is None else check_allowed_hosts(allowed_hosts)
    answered = LOOPBACK_HOSTS + (hosts or ()) if access is None or hosts is not None else None

    rabbitmq: QueueDepths | None = None
    if rabbitmq_url is not None:
        rabbitmq = QueueDepths(rabbitmq_url=rabbitmq_url, timeout_ms=statement_timeout_ms)
    elif isinstance(broker, RabbitmqBroker):
        rabbitmq = QueueDepths(parameters=broker.parameters)

    acting = action_database(database)
    settings = Settings(
        schema=schema,
        reads=ReadPool(database, statement_timeout_ms=statement_timeout_ms),
        actions=PostgresDeadLetterStore(
            database=acting, schema=schema, replay_to=target, replay_max_age_ms=replay_max_age_ms
        ),
        access=access,
        hide_args=hide_args,
        target=target,
        replay_max_age_ms=replay_max_age_ms,
        rabbitmq=rabbitmq,
        queues=queue_list,
        page_size=page_size,
        scan_interval_ms=scan_interval_ms,
        allowed_hosts=answered,
        owned=[acting] if acting.owned else [],
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            settings.close()

    app = Starlette(
        routes=_routes(),
        middleware=[Middleware(_Gate, settings=settings)],
        lifespan=lifespan,
        exception_handlers={
            psycopg.errors.QueryCanceled: _timed_out,
            psycopg.OperationalError: _unreachable,
            PoolTimeout: _unreachable,
            DatabaseUnavailable: _unreachable,
            SchemaNotReady: _schema_not_ready,
            Exception: _server_error,
        },
    )
    app.state.settings = settings
    return app


def create_wsgi_app(database: Any = None, **options: Any) -> Any:
    """:func:`create_app` as a WSGI app (through ``a2wsgi``), for Django and Flask.

    Takes the same arguments.  Mount it under a path with your framework's means (Werkzeug's
    ``DispatcherMiddleware``, a Django URL to a WSGI view); links follow ``SCRIPT_NAME``.  The
    Starlette app is its ``.app``; its connections close when the process exits (WSGI has no
    shutdown hook), or call ``.app.state.settings.close()``.
    """
    from a2wsgi import ASGIMiddleware

    return _WsgiClient(ASGIMiddleware(create_app(database, **options)))  # type: ignore[arg-type]


class _WsgiClient:
    """Hands a2wsgi an environ it can convert, whatever the client sent.

    - The client address passes through even from servers that set no ``REMOTE_PORT``: a2wsgi
      gives the ASGI app a client only with both ``REMOTE_ADDR`` and ``REMOTE_PORT``; ``wsgiref``
      (Django's ``runserver``) sets only the first, and without a client the loopback-only
      default would refuse every request.
    - The path and query are made convertible: a WSGI server hands ``PATH_INFO`` over
      percent-decoded (``/dead-letters/%FF`` is ``"/dead-letters/\xff"``), which a2wsgi decodes as
      UTF-8, and a raw byte in the query fails its ASCII encoding: both raised inside a2wsgi, a
      500 before the page could answer.  Bytes that are not UTF-8 become U+FFFD, as an ASGI server
      decodes them, and non-ASCII query bytes are percent-encoded, so the page answers 400 or 404.
    """

    def __init__(self, wsgi: Any) -> None:
        self.wsgi = wsgi
        self.app = wsgi.app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        environ = dict(environ)
        if environ.get("REMOTE_ADDR") and not environ.get("REMOTE_PORT"):
            environ["REMOTE_PORT"] = "0"
        for key in ("SCRIPT_NAME", "PATH_INFO"):
            if key in environ:
                raw = str(environ[key]).encode("latin-1", "replace")
                environ[key] = raw.decode("utf-8", "replace").encode("utf-8").decode("latin-1")
        if "QUERY_STRING" in environ:
            raw = str(environ["QUERY_STRING"]).encode("latin-1", "replace")
            environ["QUERY_STRING"] = _NOT_ASCII.sub(lambda byte: b"%%%02X" % byte[0][0], raw).decode("ascii")
        return self.wsgi(environ, start_response)


_NOT_ASCII = re.compile(rb"[\x80-\xff]")


def _routes() -> list[Route | Mount]:
    return [
        Route("/", views.overview, name="overview"),
        Route("/fragments/overview", views.overview_fragment, name="overview_fragment"),
        Route("/dead-letters", views.dead_letter_groups, name="dead_letters"),
        Route("/dead-letters/list", views.dead_letter_list, name="dead_letter_list"),
        Route("/dead-letters/replay", actions.replay, methods=["POST"], name="replay"),
        Route("/dead-letters/discard", actions.discard, methods=["POST"], name="discard"),
        # Not {id:int}: Starlette's int() of a 5000-digit path would raise (a 500); the view parses.
        Route("/dead-letters/{id}", views.dead_letter, name="dead_letter"),
        Route("/outbox", views.outbox, name="outbox"),
        Route("/outbox/retry", actions.outbox_retry, methods=["POST"], name="outbox_retry"),
        Route("/jobs", jobs.job_list, name="jobs"),
        # The id in the query, not the path: an idempotency key may hold "/", "?" or "#".
        Route("/jobs/show", jobs.job, name="job"),
        Route("/jobs/cancel", jobs.cancel, methods=["POST"], name="job_cancel"),
        Route("/batches", batches.batch_list, name="batches"),
        # The id in the query, as the job page's: Batch(id=...) may hold "/".
        Route("/batches/show", batches.batch, name="batch"),
        Route("/batches/cancel", batches.cancel, methods=["POST"], name="batch_cancel"),
        Route("/workflows", workflows.workflow_list, name="workflows"),
        # The id in the query, as the job page's: Workflow(id=...) may hold "/".
        Route("/workflows/show", workflows.workflow, name="workflow"),
        Route("/workflows/cancel", workflows.cancel, methods=["POST"], name="workflow_cancel"),
        Route("/schedules", views.schedules, name="schedules"),
        Route("/rate-limits", rate_limits.rate_limits, name="rate_limits"),
        Route("/schedules/{name:str}/{verb:str}", actions.schedule_action, methods=["POST"], name="schedule_action"),
        Mount("/static", app=StaticFiles(directory=_STATIC), name="static"),
    ]


class _Gate:
    """Decides before any route runs: a ``Host`` the page does not answer to gets 400, forbidden
    requests and unsafe POSTs 403; and every response passing through gets the security headers."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = secured(send)
        request = Request(scope, receive)
        # First, and before the hook: a rebound name must learn nothing, not even who may enter.
        wrong_host = host_problem(request.headers.get("host"), self.settings.allowed_hosts)
        if wrong_host is not None:
            await PlainTextResponse(wrong_host, status_code=400)(scope, receive, send)
            return
        decision = await resolve(request, self.settings.access)
        request.state.access = decision
        response = self._refusal(request, decision)
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request, decision: Access) -> Response | None:
        if decision.level == "forbidden":
            if self.settings.access is None:
                why = (
                    "with no access hook the page answers loopback clients only; pass access= to create_app "
                    "(--access to 'dramatiq-reliable web') to let others in"
                )
            else:
                why = "the access hook refused this request"
            return PlainTextResponse(f"forbidden: {why}", status_code=403)
        if request.method not in ("GET", "HEAD"):
            problem = cross_site_problem(request)
            if problem is not None:
                logger.warning("refused %s %s: %s", request.method, request.url.path, problem)
                return PlainTextResponse(problem, status_code=403)
            if not decision.can_act:
                return PlainTextResponse(
                    "read-only access: this request would change something; ask for full access "
                    "(the access hook decides)",
                    status_code=403,
                )
        return None


def _timed_out(request: Request, exc: Exception) -> Response:
    timeout = request.app.state.settings.reads.statement_timeout_ms
    return render(
        request,
        "error.html",
        {
            "page": "",
            "title": "The database did not answer in time",
            "error": f"a query ran longer than the page's statement timeout ({timeout} ms) and was cancelled: "
            "a table may be locked, or Postgres overloaded. Reload to try again; raise statement_timeout_ms "
            "(--statement-timeout) if the tables are simply large.",
            "testid": "timeout",
        },
        status_code=503,
    )


def _unreachable(request: Request, exc: Exception) -> Response:
    return render(
        request,
        "error.html",
        {
            "page": "",
            "title": "Postgres cannot be reached",
            "error": f"cannot reach Postgres: {redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)}",
            "testid": "unreachable",
        },
        status_code=503,
    )


def _server_error(request: Request, exc: Exception) -> Response:
    """A short page for a failure nobody foresaw (the server logs the traceback; the page shows none).

    Starlette sends it from outside the gate, so it carries the security headers itself.
    """
    response = PlainTextResponse(
        "internal error: the page failed unexpectedly; the server log has the details", status_code=500
    )
    response.headers.update(dict(SECURITY_HEADERS))
    return response


def _schema_not_ready(request: Request, exc: Exception) -> Response:
    return render(
        request,
        "error.html",
        {"page": "", "title": "The tables are not ready", "error": str(exc), "testid": "schema"},
        status_code=503,
    )
