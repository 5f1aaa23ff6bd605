"""``dramatiq-reliable web``: the web page for the person on call, served alone by uvicorn.

::

    dramatiq-reliable web [--host 127.0.0.1] [--port 8080] [--access module:callable] [--hide-args]
                          [--allowed-host NAME ...]

Needs the ``web`` extra.  Without ``--access`` the page is read-only and answers loopback
clients only, so binding it to another address without ``--access`` is refused: every remote
request would get 403 anyway.  It also answers only to the ``Host`` names ``localhost``,
``127.0.0.1`` and ``[::1]`` plus those given with ``--allowed-host`` (DNS rebinding).
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigurationError
from .common import (
    Duration,
    ExitCode,
    Integer,
    UsageError,
    configured_rabbitmq_url,
    database_url,
    rabbitmq_url,
    sends_to,
)

__all__ = ["register"]

logger = logging.getLogger("dramatiq_reliable.cli.web")

_DESCRIPTION = """\
Serve the web page (overview, dead letters by cause with replay and discard, outbox, schedules)
on HOST:PORT with uvicorn, until SIGTERM or Ctrl-C.  Needs the web extra:
pip install 'dramatiq-reliable[web]'.

Without --access the page is read-only and answers loopback clients only.  --access names a
callable of the request (app.web:access) returning an Access or 'full', 'read', 'forbidden';
it is imported with the current directory first on the path.  Binding to an address other
than loopback needs --access: a reverse proxy in front should authenticate, and the hook
trust what it says.

The page answers only to the Host names localhost, 127.0.0.1 and [::1] (any port) and to those
given with --allowed-host, so that a page on another site cannot reach it through a name it
points at this machine (DNS rebinding).  With --access, the Host is checked only when
--allowed-host is given."""

_CALLABLE = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
)


def _callable_name(text: str) -> str:
    if not _CALLABLE.fullmatch(text) or len(text) > 300:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise argparse.ArgumentTypeError(f"{shown!r} is not module:callable; write e.g. app.web:access")
    return text


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``web``; ``parents`` supply ``--database-url``, ``--schema`` and ``--rabbitmq-url``."""
    parser = subparsers.add_parser(
        "web",
        parents=list(parents),
        help="serve the web page for the person on call",
        description=_DESCRIPTION,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=Integer(minimum=1, maximum=65535), default=8080, help="port to listen on")
    parser.add_argument(
        "--access",
        type=_callable_name,
        metavar="MODULE:CALLABLE",
        help="the access hook deciding per request (default: read-only, loopback clients only)",
    )
    parser.add_argument("--hide-args", action="store_true", help="show 'hidden' instead of message arguments")
    parser.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host name the page answers to besides localhost, 127.0.0.1 and [::1], e.g. jobs.internal or "
        "*.example.com (repeatable; any port)",
    )
    parser.add_argument(
        "--to",
        choices=("outbox", "queue"),
        default=None,
        help="where replays and manual schedule runs go: the outbox (OutboxBroker) or the Postgres queues "
        "(PostgresBroker); default: read from the schema (required with --access when the schema cannot tell)",
    )
    parser.add_argument(
        "--skip-rabbitmq",
        action="store_true",
        help="do not read queue depths from RabbitMQ (with --to queue and no RabbitMQ URL configured, none is read)",
    )
    parser.add_argument(
        "--statement-timeout",
        type=Duration(minimum_ms=1),
        default="2s",
        metavar="DURATION",
        help="bound of every query a page runs",
    )
    parser.add_argument(
        "--root-path",
        metavar="PATH",
        help="the path prefix a reverse proxy serves the page under, e.g. /jobs (default: none)",
    )
    parser.set_defaults(handler=_web, log_level=logging.INFO)
    return parser


def _web(args: argparse.Namespace) -> int:
    if args.access is None and not _is_loopback(args.host):
        raise UsageError(
            f"refusing to listen on {args.host!r} without --access: with no access hook the page answers "
            "loopback clients only, so every remote request would get 403; pass --access module:callable "
            "(see 'dramatiq-reliable web --help'), or listen on 127.0.0.1 behind a proxy"
        )
    try:
        import uvicorn

        from ..web import create_app
    except ImportError as error:
        raise UsageError(
            str(error)
            if "dramatiq-reliable[web]" in str(error)
            else (f"{error}; the web page needs the web extra: pip install 'dramatiq-reliable[web]'")
        ) from None
    from ..web.security import check_allowed_hosts

    if args.allowed_host is not None:
        try:
            check_allowed_hosts(args.allowed_host)
        except ConfigurationError as error:
            raise UsageError(f"--allowed-host: {error}") from None
    access = _import_hook(args.access) if args.access else None
    if args.to is None:
        try:
            args.to = sends_to(args, "replays and manual runs")
        except (UsageError, psycopg.Error):
            if access is not None:
                raise  # the page may act: it must know where replays and runs go
            args.to = "outbox"  # read-only: nothing is written (the page says when Postgres is down)
    app = create_app(
        database_url(args),
        schema=args.schema,
        access=access,
        hide_args=args.hide_args,
        statement_timeout_ms=args.statement_timeout,
        target=args.to,
        rabbitmq_url=_rabbitmq_url(args),
        allowed_hosts=args.allowed_host,
    )
    logger.info(
        "serving the web page for schema %r on http://%s:%d%s (%s)",
        args.schema,
        args.host,
        args.port,
        (args.root_path or "") + "/",
        ("access hook " + args.access if args.access else "read-only, loopback only")
        + (f"; also answering to {', '.join(args.allowed_host)}" if args.allowed_host else ""),
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the handler
    # it found; a handler that does nothing here lets the command exit 0, as the relay and the
    # scheduler do.
    previous = {number: signal.signal(number, _ignore) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        uvicorn.run(app, host=args.host, port=args.port, root_path=args.root_path or "", log_level="warning")
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    logger.info("web page stopped")
    return ExitCode.OK


def _rabbitmq_url(args: argparse.Namespace) -> str | None:
    """Where the page reads queue depths: a configured URL (``--rabbitmq-url``, ``$RABBITMQ_URL``)
    always; otherwise the local default for an ``OutboxBroker`` deployment (``--to outbox``), and
    none for a ``PostgresBroker`` one (``--to queue``), whose page must not show a RabbitMQ it
    does not have as down."""
    if args.skip_rabbitmq:
        return None
    configured = configured_rabbitmq_url(args)
    if configured is not None or args.to == "queue":
        return configured
    return rabbitmq_url(args)


def _ignore(signum: int, frame: Any) -> None:
    """Stands in for the default handlers while uvicorn serves (see ``_web``)."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_hook(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise UsageError(
                f"--access {spec!r}: no module {module_name!r} on the path; run from the directory it is in"
            ) from None
        raise
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--access {spec!r}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"--access {spec!r} is a {type(target).__name__}, not a callable of the request")
    return target
