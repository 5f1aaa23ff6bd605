"""The ``dramatiq-reliable`` command: schema, relay, outbox, idempotency keys, dead letters, schedules, status, web.

The only place that reads the environment: ``DATABASE_URL`` and ``RABBITMQ_URL`` give the
defaults of ``--database-url`` and ``--rabbitmq-url``.  Command output goes to stdout; errors,
progress and logs (WARNING and up, INFO for the relay, DEBUG with ``-v``) go to stderr.  An
error is one line (the traceback only with ``-v``) and exits with a named :class:`ExitCode`.

The package is laid out one way round: :mod:`.common` (exit codes, the parser class, argument
types, connection options) and :mod:`.output` (tables, ages, JSON) at the bottom, one module per
command group above them, and this module, which assembles the parser and runs ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, cast

import psycopg

from .._util import first_line, rabbitmq_reason, redact
from ..errors import BrokerUnavailable, ConfigurationError, DatabaseUnavailable, ReliableError, SchemaNotReady
from . import (
    batches,
    dead_letters,
    dev,
    doctor,
    idempotency,
    jobs,
    metrics,
    migrate,
    outbox,
    partitions,
    relay,
    scheduler,
    schedules,
    status,
    web,
    workflows,
)
from .common import EXIT_CODE_HELP, PROG, ExitCode, Parser, UsageError, common_parents, duration_ms, print_error

__all__ = ["ExitCode", "build_parser", "common_parents", "duration_ms", "main"]

logger = logging.getLogger("dramatiq_reliable.cli")

_DESCRIPTION = """\
Outbox, idempotency, retries and dead letters for Dramatiq on Postgres: create the tables,
run the relay, see and replay dead letters, and check the health of every queue.

Run 'dramatiq-reliable COMMAND --help' for a command's options."""


def _epilog() -> str:
    codes = "\n".join(f"  {int(code)}  {text}" for code, text in EXIT_CODE_HELP.items())
    return f"""\
environment:
  DATABASE_URL  default of --database-url (postgresql://USER:PASSWORD@HOST:5432/DBNAME)
  RABBITMQ_URL  default of --rabbitmq-url (amqp://USER:PASSWORD@HOST:5672/%2F)
  Passwords are never printed: help, errors and logs mask them.

exit codes:
{codes}"""


def build_parser() -> Parser:
    """The whole command line: every command and option (the docs' CLI reference reads it too)."""
    from .. import __version__

    parser = Parser(prog=PROG, description=_DESCRIPTION, epilog=_epilog())
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common, rabbit = common_parents()
    # -v after the command too ('dramatiq-reliable status -v'); SUPPRESS keeps the sub-parser
    # from resetting a -v given before the command.
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    # Sub-parsers are Parsers too (one-line errors); the registrars take any ArgumentParser's.
    commands = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )
    migrate.register(commands, [common])
    relay.register(commands, [common, rabbit])
    outbox.register(commands, [common])
    idempotency.register(commands, [common])
    partitions.register(commands, [common])
    dead_letters.register(commands, [common])
    jobs.register(commands, [common])
    batches.register(commands, [common])
    workflows.register(commands, [common])
    schedules.register(commands, [common])
    status.register(commands, [common, rabbit])
    doctor.register(commands, [common, rabbit])
    metrics.register(commands, [common, rabbit])
    scheduler.register(commands, [common])
    web.register(commands, [common, rabbit])
    dev.register(commands, [])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``) and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else ExitCode.USAGE
    with _logging(verbose=args.verbose, level=getattr(args, "log_level", logging.WARNING)):
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        _check_text(parser, args)
        return int(args.handler(args))
    except UsageError as error:
        return _fail(args, error, ExitCode.USAGE)
    except ConfigurationError as error:
        # The library refused a value: on the command line, every value is an argument.
        return _fail(args, error, ExitCode.USAGE)
    except SchemaNotReady as error:
        return _fail(args, error, ExitCode.SCHEMA)
    except (BrokerUnavailable, DatabaseUnavailable) as error:
        return _fail(args, error, ExitCode.UNAVAILABLE)
    except ReliableError as error:
        return _fail(args, error, ExitCode.ERROR)
    except psycopg.Error as error:
        return _fail(args, error, *_postgres_problem(error))
    except Exception as error:
        import pika.exceptions

        if isinstance(error, pika.exceptions.AMQPError):
            return _fail(args, error, ExitCode.UNAVAILABLE, f"cannot reach RabbitMQ: {rabbitmq_reason(error)}")
        if isinstance(error, BrokenPipeError):
            # The reader went away ('| head'): stop quietly, as other command-line tools do.
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return ExitCode.ERROR
        return _fail(
            args, error, ExitCode.ERROR, f"unexpected {type(error).__name__}: {first_line(error)} (-v shows where)"
        )
    except KeyboardInterrupt:
        print_error("interrupted")
        return ExitCode.ABORTED


def _postgres_problem(error: psycopg.Error) -> tuple[ExitCode, str]:
    """The exit code and message of a Postgres error: unreachable (3), or refused (1)."""
    from psycopg_pool import PoolTimeout

    text = first_line(error)
    sqlstate = error.sqlstate
    if isinstance(error, (PoolTimeout, psycopg.InterfaceError)) or sqlstate is None or sqlstate[:2] in ("08", "57"):
        return ExitCode.UNAVAILABLE, f"cannot reach Postgres: {text}"
    return ExitCode.ERROR, f"Postgres refused the command: {text} (SQLSTATE {sqlstate})"


def _fail(args: argparse.Namespace, error: BaseException, code: ExitCode, message: str | None = None) -> int:
    print_error(message or first_line(error))
    if getattr(args, "verbose", False):
        print(redact("".join(traceback.format_exception(error))), end="", file=sys.stderr)
    return int(code)


def _check_text(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse text Postgres cannot store: a NUL, or bytes that are not UTF-8.

    Python hands undecodable argv bytes over as lone surrogates ('surrogateescape'); they would
    fail deep in the driver.  Checked here once for every option, present and future.
    """
    options = _option_names(parser)
    for dest, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            option = options.get(dest, dest)
            if "\x00" in text:
                raise UsageError(f"{option} contains a NUL character, which Postgres cannot store")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raw = text.encode("utf-8", "surrogateescape")[:40]
                raise UsageError(f"{option} is not valid UTF-8 ({raw!r}); check the terminal's encoding") from None


def _option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    names: dict[str, str] = {}
    stack: list[argparse.ArgumentParser] = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.dest not in names:
                long = [option for option in action.option_strings if option.startswith("--")]
                metavar = action.metavar if isinstance(action.metavar, str) else action.dest
                names[action.dest] = (long or action.option_strings or [metavar])[0]
    return names


class _RedactingFormatter(logging.Formatter):
    """Log lines with every connection-string password masked, whoever logged them.

    The message and the traceback are redacted, not the whole line: the timestamp's colons
    must not read as a user and password.
    """

    def format(self, record: logging.LogRecord) -> str:
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = redact(record.getMessage()), None
        return super().format(copy)

    def formatException(self, ei: Any) -> str:
        return redact(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return redact(super().formatStack(stack_info))


@contextlib.contextmanager
def _logging(*, verbose: bool, level: int) -> Iterator[None]:
    """Logs on stderr for the length of one command; the previous setup is restored after.

    Ours at ``level`` (WARNING for commands, INFO for the relay, DEBUG with -v); other
    libraries at WARNING, pika silent and psycopg_pool's per-attempt warnings hidden unless
    -v (our own messages already say when a service is down, once).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    levels: dict[str, int] = {
        "": logging.INFO if verbose else logging.WARNING,
        "dramatiq_reliable": logging.DEBUG if verbose else level,
        "pika": logging.WARNING if verbose else logging.CRITICAL,
        "psycopg.pool": logging.DEBUG if verbose else logging.ERROR,
    }
    loggers = {name: logging.getLogger(name) for name in levels}
    saved: dict[str, Any] = {name: item.level for name, item in loggers.items()}
    for name, item in loggers.items():
        item.setLevel(levels[name])
    root = loggers[""]
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        for name, item in loggers.items():
            item.setLevel(saved[name])
