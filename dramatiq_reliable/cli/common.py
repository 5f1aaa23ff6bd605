"""What every command shares: exit codes, the parser class, argument types, connection options.

Kept apart from ``cli/__init__.py`` (which builds the parser and runs ``main``) so each command
module imports from here and ``__init__`` imports the command modules: the dependencies of the
package run one way, with no import cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import decimal
import enum
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar, cast

import psycopg

from .. import _sql
from .._util import first_line, redact
from ..database import Database
from ..errors import JobNotFound
from . import output

if TYPE_CHECKING:
    from ..backing import SendsTo

__all__ = [
    "BIGINT_MAX",
    "DEFAULT_DATABASE_URL",
    "DEFAULT_RABBITMQ_URL",
    "DURATION",
    "MAX_DURATION_MS",
    "Actions",
    "Cancelled",
    "Duration",
    "ExitCode",
    "Integer",
    "Parser",
    "UsageError",
    "add_action",
    "add_cancel",
    "add_command",
    "add_json",
    "add_show",
    "cancel_one",
    "common_parents",
    "configured_rabbitmq_url",
    "connect",
    "database_url",
    "duration_ms",
    "open_database",
    "print_error",
    "queue_name",
    "rabbitmq_parameters",
    "rabbitmq_url",
    "report_cancel",
    "schema_name",
    "show_one",
]

T = TypeVar("T")
C = TypeVar("C")

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
#: How long a command waits for Postgres to accept a connection before it says it cannot.
CONNECT_TIMEOUT_S = 5
PROG = "dramatiq-reliable"


class ExitCode(enum.IntEnum):
    """Exit codes of the command, stable for scripts."""

    OK = 0
    ERROR = 1  # anything else; -v shows the traceback
    USAGE = 2  # a wrong argument, option or URL
    UNAVAILABLE = 3  # Postgres or RabbitMQ cannot be reached
    SCHEMA = 4  # tables missing or behind: run migrate
    CHECK_FAILED = 5  # a health check crossed a threshold
    ABORTED = 6  # the user declined a confirmation, or pressed Ctrl-C
    NOT_FOUND = 7  # an id asked for does not exist
    REFUSED = 8  # some rows were left alone (too old, already handled); the rest were handled


#: One line per exit code, for the top-level help and the README.
EXIT_CODE_HELP = {
    ExitCode.OK: "success",
    ExitCode.ERROR: "an unexpected error (-v shows the traceback)",
    ExitCode.USAGE: "a wrong argument, option, URL or environment variable",
    ExitCode.UNAVAILABLE: "Postgres or RabbitMQ cannot be reached",
    ExitCode.SCHEMA: "the tables are missing or behind: run 'dramatiq-reliable migrate'",
    ExitCode.CHECK_FAILED: "status --check: a threshold was crossed; doctor: a problem was found",
    ExitCode.ABORTED: "a confirmation was declined, or Ctrl-C",
    ExitCode.NOT_FOUND: "an id asked for does not exist",
    ExitCode.REFUSED: "some rows were left alone (too old, already handled); the others were handled",
}


class UsageError(Exception):
    """An argument found wrong after parsing (a malformed URL, say): exit 2, like argparse's own."""


def print_error(message: str, *, prog: str = PROG) -> None:
    """The one error printer: ``prog: error: message`` on stderr, one line, passwords masked."""
    line = " ".join(redact(str(message)).split()) or "unknown error"
    print(f"{prog}: error: {line}", file=sys.stderr)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and ``(default: X)`` after every option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS) and default != []
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Sub-commands whose ``--help`` opens with their one-line summary when they have no description."""

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        summary = kwargs.get("help")
        if not kwargs.get("description") and summary:
            kwargs["description"] = summary[:1].upper() + summary[1:] + "."
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is one ``--help`` away).

    Sub-parsers are made of the same class, so every command behaves the same.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def error(self, message: str) -> NoReturn:
        print_error(f"{message}; see '{self.prog} --help'", prog=self.prog)
        self.exit(ExitCode.USAGE)


# --------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------

BIGINT_MAX = 2**63 - 1
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")
#: The longest duration an option takes: 100 years, far below what Postgres and datetime hold.
MAX_DURATION_MS = 36_500 * 86_400_000


def duration_ms(text: str) -> int:
    """``500ms``, ``30s``, ``15m``, ``6h``, ``7d``, ``2w`` (a bare number is seconds) as ms."""
    match = DURATION.match(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write e.g. 30s, 15m, 7d")
    # Decimal, not float: a 400-digit number is an error to report, not an infinity to crash on.
    value = decimal.Decimal(match[1]) * _UNITS_MS[match[2] or "s"]
    if value > MAX_DURATION_MS:
        raise argparse.ArgumentTypeError(f"{text!r} is too long; the longest duration is 36500d (100 years)")
    return int(value)


class Duration:
    """An argparse type: a duration of at least ``minimum_ms``, as an int of milliseconds."""

    __name__ = "duration"

    def __init__(self, *, minimum_ms: int = 0) -> None:
        self.minimum_ms = minimum_ms

    def __call__(self, text: str) -> int:
        value = duration_ms(text)
        if value < self.minimum_ms:
            raise argparse.ArgumentTypeError(f"{text!r} is too short; the shortest is {self.minimum_ms}ms")
        return value


class Integer:
    """An argparse type: a whole number from ``minimum`` to ``maximum`` (a Postgres bigint)."""

    __name__ = "integer"

    def __init__(self, *, minimum: int = 0, maximum: int = BIGINT_MAX) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def __call__(self, text: str) -> int:
        stripped = text.strip()
        try:
            # Twenty digits bound the work int() does on a hostile string.
            value = int(stripped) if len(stripped) <= 20 else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value is None or not self.minimum <= value <= self.maximum:
            upper = "" if self.maximum == BIGINT_MAX else f" to {self.maximum}"
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range; give a whole number from {self.minimum}{upper}"
            )
        return value


def schema_name(text: str) -> str:
    """An argparse type: a schema name Postgres can create (``pg_`` names are the server's)."""
    from ..errors import ConfigurationError

    try:
        _sql.validate_schema(text)
    except ConfigurationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if text.startswith("pg_"):
        raise argparse.ArgumentTypeError(f"schema {text!r} starts with 'pg_', which Postgres reserves; choose another")
    return text


_QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")
# AMQP queue names are at most 255 bytes, and the .DQ and .XQ queues add three.
_MAX_QUEUE_NAME = 252


def queue_name(text: str) -> str:
    """An argparse type: a Dramatiq queue name (so also a valid RabbitMQ one, with its .DQ/.XQ)."""
    if not _QUEUE_NAME.fullmatch(text) or len(text) > _MAX_QUEUE_NAME:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not a queue name; Dramatiq queue names are letters, digits, '.', '_' and '-', "
            f"starting with a letter or '_', at most {_MAX_QUEUE_NAME} characters"
        )
    return text


# --------------------------------------------------------------------------------------------
# Connection options
# --------------------------------------------------------------------------------------------

_ENV = {"database_url": "DATABASE_URL", "rabbitmq_url": "RABBITMQ_URL"}


def _default(dest: str) -> str:
    """The local server's URL, read when used (so a test can point it elsewhere)."""
    return DEFAULT_DATABASE_URL if dest == "database_url" else DEFAULT_RABBITMQ_URL


def common_parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The shared option parsers: (``--database-url`` and ``--schema``, ``--rabbitmq-url``).

    The URLs default to ``None`` and are resolved (option, then environment, then the local
    server) and checked by :func:`database_url` / :func:`rabbitmq_url` when a command uses
    them, so a malformed ``$RABBITMQ_URL`` never stops a command that does not need RabbitMQ.
    """
    common = Parser(add_help=False)
    common.add_argument("--database-url", metavar="URL", help=_url_help("database_url", "Postgres URL"))
    common.add_argument("--schema", type=schema_name, default=_sql.DEFAULT_SCHEMA, help="Postgres schema of the tables")
    rabbit = Parser(add_help=False)
    rabbit.add_argument(
        "--rabbitmq-url",
        metavar="URL",
        help=_url_help("rabbitmq_url", "RabbitMQ URL (several separated by ';' for a cluster)"),
    )
    return common, rabbit


def _url_help(dest: str, what: str) -> str:
    variable = _ENV[dest]
    current = os.environ.get(variable)
    if current:
        shown = f"${variable}, now {_safe_url(current)}"
    else:
        shown = f"${variable} if set, else {_safe_url(_default(dest))}"
    # argparse %-formats help texts: a URL's %2F must reach it as %%2F.
    return f"{what} (default: {shown})".replace("%", "%%")


def _resolve(args: argparse.Namespace, dest: str) -> tuple[str, str]:
    """The URL a command uses and where it came from (for messages)."""
    given = getattr(args, dest, None)
    option = "--" + dest.replace("_", "-")
    if given is not None:
        return given, option
    variable = _ENV[dest]
    from_env = os.environ.get(variable)
    if from_env:
        return from_env, f"${variable}"
    return _default(dest), option


def database_url(args: argparse.Namespace) -> str:
    """The Postgres URL of the command, checked; a malformed one raises :class:`UsageError`."""
    url, source = _resolve(args, "database_url")
    problem = _postgres_url_problem(url)
    if problem:
        raise UsageError(f"{source} is not a valid Postgres URL ({problem}); {_PG_EXAMPLE}")
    return url


def rabbitmq_url(args: argparse.Namespace) -> str:
    """The RabbitMQ URL of the command, checked; a malformed one raises :class:`UsageError`."""
    url, source = _resolve(args, "rabbitmq_url")
    problem = _rabbitmq_url_problem(url)
    if problem:
        raise UsageError(f"{source} is not a valid RabbitMQ URL ({problem}); {_AMQP_EXAMPLE}")
    return url


def configured_rabbitmq_url(args: argparse.Namespace) -> str | None:
    """The RabbitMQ URL given with ``--rabbitmq-url`` or ``$RABBITMQ_URL``, checked; ``None``
    when neither is set (the command would fall back to the local server's)."""
    given = getattr(args, "rabbitmq_url", None) is not None or bool(os.environ.get(_ENV["rabbitmq_url"]))
    return rabbitmq_url(args) if given else None


def rabbitmq_parameters(args: argparse.Namespace) -> Any:
    """pika connection parameters of the command's URL (a list for several URLs), with TCP
    keepalives and ``TCP_USER_TIMEOUT`` so a silent partition ends a command in seconds."""
    import pika

    from .._tcp import bound_tcp

    parameters = [pika.URLParameters(part.strip()) for part in rabbitmq_url(args).split(";") if part.strip()]
    return bound_tcp(parameters[0] if len(parameters) == 1 else parameters)


# No "word: ... @" before the example: redact() would take it for a user and password.
_PG_EXAMPLE = "write it like postgresql://app@db.example:5432/app, percent-encoding special characters"


def _postgres_url_problem(url: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict

    if not url.strip():
        return "it is empty"
    scheme = url.split("://", 1)[0] if "://" in url else None
    if scheme is None and "=" not in url:
        return "it has no postgresql:// scheme"
    if scheme is not None and scheme not in ("postgresql", "postgres"):
        return f"its scheme is {_safe_fragment(scheme, url)!r}, not postgresql://"
    try:
        options = conninfo_to_dict(url)
    except psycopg.Error as error:
        return _mask_fragments(first_line(error), url)
    # libpq checks these only when it connects, where a typo would read as "unreachable".
    for port in str(options.get("port") or "").split(","):
        if port and (not port.isdigit() or not 0 < int(port) < 65536):
            return f"port {_safe_fragment(port, url)!r} is not a number from 1 to 65535"
    timeout = str(options.get("connect_timeout") or "")
    if timeout and not timeout.lstrip("-").isdigit():
        return f"connect_timeout {_safe_fragment(timeout, url)!r} is not a whole number of seconds"
    return None


_AMQP_EXAMPLE = "write it like amqp://app@rabbitmq.example:5672/%2F, percent-encoding special characters"


def _rabbitmq_url_problem(urls: str) -> str | None:
    import pika

    parts = [part.strip() for part in urls.split(";")]
    if not any(parts):
        return "it is empty"
    for url in parts:
        if not url:
            return "it has an empty URL between two ';'"
        scheme = url.split("://", 1)[0] if "://" in url else None
        if scheme not in ("amqp", "amqps"):
            what = "no amqp:// scheme" if scheme is None else f"scheme {_safe_fragment(scheme, url)!r}"
            return f"it has {what}"
        try:
            pika.URLParameters(url)
        except Exception as error:  # pika raises ValueError, IndexError, TypeError... on bad input
            return _mask_fragments(first_line(error), url)
    return None


def _secret_free(url: str) -> str:
    """``url`` with its user-info and every ``password=`` value cut out: what may be shown."""
    # Up to the last @ of the string, not of the authority: a malformed password may hold a
    # "/" or a "?", and a URL with no scheme at all is still one a user meant to write.
    scheme, separator, rest = url.partition("://") if "://" in url else ("", "", url)
    if "@" in rest:
        url = f"{scheme}{separator}***@{rest.rsplit('@', 1)[1]}"
    return _KV_PASSWORD.sub(r"\1***", url)


# A key=value password runs to the next "key=" (an unquoted space in it is the mistake).
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('[^']*'?|.*?)(?=\s+\w+\s*=|$)", re.IGNORECASE)


def _safe_url(url: str) -> str:
    """A URL fit for help texts: the password masked, even in a string too malformed to parse."""
    url = _KV_PASSWORD.sub(r"\1***", url)
    masked = redact(url)
    if masked != url:
        return masked
    user_info = url.split("://", 1)[-1].rsplit("@", 1)[0] if "@" in url else ""
    # redact() saw no password, yet there may be one: then show nothing of the user-info.
    return _secret_free(url) if ":" in user_info else url


def _safe_fragment(fragment: str, url: str) -> str:
    return fragment if fragment in _secret_free(url) else "***"


def _mask_fragments(message: str, url: str) -> str:
    """The driver's message with every quoted piece of ``url`` that could be a secret masked.

    psycopg and pika quote the part of the string they choke on, which may be the password
    itself ('unexpected spaces found in "pa ss"'): a piece is kept only if it can be seen in the
    URL with its user-info and passwords cut out.
    """
    safe = _secret_free(url)

    def mask(match: re.Match[str]) -> str:
        quote, inner = match[1], match[2]
        return match[0] if inner in safe or len(inner) <= 1 else f"{quote}***{quote}"

    return redact(re.sub(r"([\"'])(.*?)\1", mask, message))


def _connect_options(url: str) -> dict[str, Any]:
    """A short connect timeout, unless the URL or ``$PGCONNECT_TIMEOUT`` sets one; no prepared statements.

    A command's connection lives for a few statements, so preparing saves nothing, and behind
    PgBouncer in transaction mode a statement prepared on one server process is missing (or
    already exists under the same name) on the next.
    """
    from psycopg.conninfo import conninfo_to_dict

    options: dict[str, Any] = {"prepare_threshold": None}
    if "connect_timeout" in conninfo_to_dict(url) or os.environ.get("PGCONNECT_TIMEOUT"):
        return options
    return {**options, "connect_timeout": CONNECT_TIMEOUT_S}


@contextlib.contextmanager
def connect(args: argparse.Namespace, **kwargs: Any) -> Iterator[psycopg.Connection[Any]]:
    """One direct connection to the command's database, failing fast.

    A direct connect reports a wrong host or password at once with the server's own reason,
    where a pool would retry in the background for its whole timeout and say only that.
    """
    url = database_url(args)
    with psycopg.connect(url, **{**_connect_options(url), **kwargs}) as conn:
        yield conn


def sends_to(args: argparse.Namespace, what: str) -> SendsTo:
    """``--to`` when given, else where the schema's deployment sends, read from its tables.

    A replay or a manual run written where no worker reads would wait for ever (an outbox row in
    a deployment without a relay), so when the tables cannot tell (nothing sent yet, or both the
    outbox and the queue table in use during a move) this asks for ``--to`` instead of guessing.
    """
    if args.to is not None:
        return cast("SendsTo", args.to)
    from ..backing import sends_to_of_schema, target_unknown

    with connect(args) as conn:
        found = sends_to_of_schema(conn, args.schema)
    if found is None:
        raise UsageError(str(target_unknown(what, args.schema, outbox="--to outbox", queue="--to queue")))
    return found


@contextlib.contextmanager
def open_database(args: argparse.Namespace, *, max_size: int = 2) -> Iterator[Database]:
    """A :class:`Database` for a command that calls the library, opened after one quick connect."""
    url = database_url(args)
    psycopg.connect(url, **_connect_options(url)).close()
    database = Database(url=url, max_size=max_size, timeout_ms=30_000)
    try:
        yield database
    finally:
        database.close()


def confirm(args: argparse.Namespace, question: str, what: str, *, unattended: bool = False) -> bool:
    """Whether to go ahead with ``what`` (``"delete 12 rows"``): ``--yes`` says so at once.

    On a terminal the user is asked ``question? [y/N]`` on stderr and only ``y`` or ``yes``
    goes ahead.  Without a terminal and without ``--yes`` it refuses, saying so in one line, so
    a script never deletes by accident; the caller then exits ``ABORTED``.  ``unattended=True``
    (the purges, which delete only what retention already expired and run from schedules) goes
    ahead without a terminal instead.
    """
    if args.yes:
        return True
    if not sys.stdin.isatty():
        if unattended:
            return True
        print_error(f"refusing to {what} without confirmation: stdin is not a terminal; pass --yes")
        return False
    print(f"{question}? [y/N] ", end="", file=sys.stderr, flush=True)
    if sys.stdin.readline().strip().lower() in ("y", "yes"):
        return True
    print("aborted; nothing changed", file=sys.stderr)
    return False


# The show / cancel actions of the commands that name one thing by id (jobs, batches, workflows):
# the same arguments, the same --json switch and the same exit codes, whatever the thing is.


Actions = argparse._SubParsersAction  # the sub-parsers of one command's actions


def add_command(
    subparsers: Actions[argparse.ArgumentParser], name: str, *, help: str, description: str
) -> tuple[argparse.ArgumentParser, Actions[argparse.ArgumentParser]]:
    """The command ``name`` (``jobs``, ``batches``...), and the sub-parsers its actions are added to."""
    parser = subparsers.add_parser(name, help=help, description=description)
    return parser, parser.add_subparsers(dest=f"{name}_command", required=True, metavar="ACTION")


def add_action(
    actions: Actions[argparse.ArgumentParser],
    name: str,
    parents: Sequence[argparse.ArgumentParser],
    handler: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add the action ``name`` (``show``, ``list``, ``cancel``), run by ``handler``."""
    parser = actions.add_parser(name, parents=list(parents), help=help, description=description)
    parser.set_defaults(handler=handler)
    return parser


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print JSON for scripts instead of text for people."""
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def add_show(
    actions: Actions[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
    handler: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str,
    id_help: str,
) -> argparse.ArgumentParser:
    """The ``show ID [--json]`` action."""
    parser = add_action(actions, "show", parents, handler, help=help, description=description)
    parser.add_argument("id", help=id_help)
    add_json(parser)
    return parser


def add_cancel(
    actions: Actions[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
    handler: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str,
    id_help: str,
    reason_help: str,
    id_metavar: str | None = None,
) -> argparse.ArgumentParser:
    """The ``cancel ID [--reason TEXT] [--by NAME] [--yes] [--json]`` action, run by :func:`cancel_one`."""
    parser = add_action(actions, "cancel", parents, handler, help=help, description=description)
    parser.add_argument("id", metavar=id_metavar, help=id_help)
    parser.add_argument("--reason", help=reason_help)
    parser.add_argument("--by", help="who cancels (default: user@host)")
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    add_json(parser)
    return parser


def show_one(
    args: argparse.Namespace,
    look_up: Callable[[psycopg.Connection[Any]], T],
    *,
    as_dict: Callable[[T], Any],
    describe: Callable[[T], str],
) -> int:
    """``show ID``: what ``look_up`` finds, as JSON or for people; ``NOT_FOUND`` when it raises ``JobNotFound``."""
    return _one(
        args, connect(args, autocommit=True), look_up, as_dict=as_dict, report=lambda found: print(describe(found))
    )


def cancel_one(
    args: argparse.Namespace,
    noun: str,
    cancel: Callable[[Database], T],
    *,
    as_dict: Callable[[T], Any],
    report: Callable[[T], None],
    exit_code: Callable[[T], int] = lambda _: ExitCode.OK,
) -> int:
    """``cancel ID``: confirmed first (``ABORTED`` if not), then ``cancel``, reported as JSON or by ``report``.

    Exits ``NOT_FOUND`` when ``cancel`` raises ``JobNotFound``, else what ``exit_code`` says of the result.
    """
    if not confirm(args, f"cancel {noun} {args.id}", f"cancel {noun} {args.id}"):
        return ExitCode.ABORTED
    return _one(args, open_database(args), cancel, as_dict=as_dict, report=report, exit_code=exit_code)


class Cancelled(Protocol):
    """What cancelling a batch or a workflow returns."""

    @property
    def id(self) -> str: ...
    @property
    def changed(self) -> bool: ...
    @property
    def state(self) -> str: ...


def report_cancel(noun: str, result: Cancelled, cancelled: str) -> None:
    """``batch b1: cancelled; <cancelled>``, or that it had finished already and nothing changed."""
    if result.changed:
        print(f"{noun} {result.id}: cancelled; {cancelled}")
    else:
        print(f"{noun} {result.id}: already {result.state}; nothing changed")


def _one(
    args: argparse.Namespace,
    opened: contextlib.AbstractContextManager[C],
    act: Callable[[C], T],
    *,
    as_dict: Callable[[T], Any],
    report: Callable[[T], None],
    exit_code: Callable[[T], int] = lambda _: ExitCode.OK,
) -> int:
    with opened as handle:
        try:
            result = act(handle)
        except JobNotFound as error:
            print_error(str(error))
            return ExitCode.NOT_FOUND
    if args.json:
        output.print_json(as_dict(result))
    else:
        report(result)
    return exit_code(result)
