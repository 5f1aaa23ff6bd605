"""Dead letters: every message that failed for good, kept in Postgres with its error, replayable in one command.

Dramatiq rejects a message that fails for good, and RabbitMQ moves it to the queue's ``.XQ``
dead-letter queue: a body nobody reads, with the retry count and traceback of an earlier
attempt, gone after seven days.  :class:`DeadLetters` writes each of those messages to the
``dead_letters`` table instead, as the worker held it when it died: the whole message, the error
type and message, the full traceback of the last attempt, how many times the actor ran, why it
was not retried (retries exhausted, ``throws``, ``Unrecoverable``, age limit, time limit, unknown
actor), the HTTP status when there was one, first and last failure times, the worker host and
pid, and a fingerprint that groups a thousand failures from one bug into one row.

:class:`DeadLetterStore` reads and maintains that table: list and show, group by fingerprint,
replay through the outbox (the dead letter is marked in the same transaction as the outbox row,
so a replay is never lost and never doubled), discard, and purge past retention.  The
``dramatiq-reliable dead-letters`` command is a thin layer over it.

>>> broker = OutboxBroker(url=..., database=..., middleware=[..., DeadLetters(), ClassifiedRetries()])
... # doctest: +SKIP
>>> store = DeadLetterStore.from_broker(broker)                          # doctest: +SKIP
>>> store.replay(where=DeadLetterFilter(actor_name="send_receipt"))      # doctest: +SKIP
ReplayResult(replayed=12, too_old=0, problems={})

Every new dead letter is announced with ``NOTIFY`` on the channel ``"<schema>.dead_letters"``
(payload: JSON with ``id``, ``message_id``, ``queue_name``, ``actor_name``, ``error_type`` and
``fingerprint``) and passed to the ``on_dead_letter`` callable, so the person on call hears of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import getpass
import hashlib
import json
import logging
import math
import os
import socket
import sysconfig
import threading
import time
import traceback as traceback_module
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name, xq_name
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, SkipMessage

from . import _sql, events, schema
from ._util import check_ms as _check_ms
from ._util import first_line as _first_line
from ._util import type_name as _type_name
from .classify import http_status_of
from .database import Database, DatabaseLike
from .errors import ConfigurationError
from .outbox.binding import bound_connection
from .outbox.broker import OutboxBroker

__all__ = [
    "DEFAULT_REPLAY_MAX_AGE_MS",
    "DEFAULT_RETENTION_MS",
    "FIRST_FAILURE_OPTION",
    "RESET_OPTIONS",
    "Culprit",
    "DeadLetter",
    "DeadLetterCaptureFailed",
    "DeadLetterCaptured",
    "DeadLetterCount",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterPage",
    "DeadLetterStore",
    "DeadLetters",
    "DeadLettersDiscarded",
    "DeadLettersReplayed",
    "DiscardResult",
    "PurgeResult",
    "ReplayResult",
    "find_culprit",
    "fingerprint",
    "format_traceback",
    "notify_channel",
]

logger = logging.getLogger("dramatiq_reliable.dead_letters")

#: Replays of jobs first sent longer ago than this are refused unless forced: a welcome email
#: from three weeks ago should not go out now.  Seven days is also RabbitMQ's ``.XQ`` TTL.
DEFAULT_REPLAY_MAX_AGE_MS = 7 * 24 * 3600 * 1000
#: Dead letters nobody handled are purged this long after their last failure.
DEFAULT_RETENTION_MS = 30 * 24 * 3600 * 1000
#: The message option in which :class:`DeadLetters` records when a message first failed (epoch
#: ms).  Dramatiq keeps only the latest failure time (``requeue_timestamp``), so the middleware
#: copies the first one into this option as the first retry is enqueued.
FIRST_FAILURE_OPTION = "first_failure_ms"
#: Options a replay drops: they describe the failed run, not the job, and a replay starts with a
#: fresh retry budget.  Every other option (trace context, ``max_retries``...) is kept.
RESET_OPTIONS = ("retries", "traceback", "requeue_timestamp", "retry_decision", "eta", FIRST_FAILURE_OPTION)

State = Literal["dead", "replayed", "discarded"]
_STATES = ("dead", "replayed", "discarded")
_CHANNEL_SUFFIX = ".dead_letters"
_MAX_ERROR_MESSAGE_CHARS = 8000
_MAX_NAME_CHARS = 500
_DEFAULT_BATCH = 5000
_PRIOR_ATTR = "_dramatiq_reliable_prior_retries"
_RAN_ATTR = "_dramatiq_reliable_ran"
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_US = datetime.timedelta(microseconds=1)


class _Unset:
    def __repr__(self) -> str:
        return "<store default>"


_UNSET: Any = _Unset()


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a listing or a bulk command applies to; every field narrows it.

    ``since`` and ``until`` bound the last failure time (``since`` inclusive, ``until``
    exclusive) and must be timezone-aware.  ``DeadLetterFilter()`` matches everything.
    """

    actor_name: str | None = None
    queue_name: str | None = None
    error_type: str | None = None
    fingerprint: str | None = None
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None

    def __post_init__(self) -> None:
        for name in ("actor_name", "queue_name", "error_type", "fingerprint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigurationError(f"filter {name} must be a non-empty string or None, got {value!r}")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, datetime.datetime) or value.tzinfo is None:
                raise ConfigurationError(
                    f"filter {name} must be a timezone-aware datetime, got {value!r}; "
                    "pass e.g. datetime.now(timezone.utc) - timedelta(hours=1)"
                )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigurationError(
                f"filter since={self.since.isoformat()!r} is not before until={self.until.isoformat()!r}; "
                "swap them or widen the range"
            )

    @property
    def is_empty(self) -> bool:
        """True when the filter matches every dead letter."""
        return all(getattr(self, field.name) is None for field in dataclasses.fields(self))

    def describe(self) -> str:
        """The filter as people read it: ``actor_name='send_email', since=2024-05-01T00:00:00+00:00``."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, datetime.datetime):
                parts.append(f"{field.name}={value.isoformat()}")
            elif value is not None:
                parts.append(f"{field.name}={value!r}")
        return ", ".join(parts) or "all"

    def params(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """One dead letter.  ``message``, ``traceback`` and ``retry_decision`` are filled by
    :meth:`DeadLetterStore.get` and at capture; listings leave them ``None`` (and shorten
    ``error_message``) to stay fast."""

    id: int
    message_id: str
    queue_name: str
    actor_name: str
    error_type: str | None
    error_message: str
    attempts: int
    reason: str
    http_status: int | None
    fingerprint: str
    culprit: str | None
    state: State
    sent_at: datetime.datetime
    first_failed_at: datetime.datetime
    last_failed_at: datetime.datetime
    worker_host: str
    worker_pid: int
    captures: int = 1
    handled_at: datetime.datetime | None = None
    handled_by: str | None = None
    note: str | None = None
    replayed_to: str | None = None
    message: Mapping[str, Any] | None = None
    traceback: str | None = None
    retry_decision: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (datetimes as ISO 8601 strings); ``None`` fields are kept."""
        return {key: _jsonable_value(value) for key, value in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class DeadLetterPage:
    """One page of a listing; pass ``next_cursor`` back as ``cursor=`` for the next one
    (``None`` on the last page)."""

    items: tuple[DeadLetter, ...]
    next_cursor: str | None


@dataclasses.dataclass(frozen=True)
class DeadLetterGroup:
    """Dead letters sharing a fingerprint: most likely one bug.  The details (error, culprit,
    actor, queue, message) are those of the group's newest dead letter, ``latest_id``."""

    fingerprint: str
    count: int
    actors: int
    first_failed_at: datetime.datetime
    last_failed_at: datetime.datetime
    error_type: str | None
    culprit: str | None
    actor_name: str
    queue_name: str
    error_message: str
    latest_id: int

    def as_dict(self) -> dict[str, Any]:
        return {key: _jsonable_value(value) for key, value in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class DeadLetterCount:
    """How many dead letters one actor has with one error type (state ``dead`` only)."""

    actor_name: str
    error_type: str | None
    count: int
    oldest_failed_at: datetime.datetime
    newest_failed_at: datetime.datetime

    def as_dict(self) -> dict[str, Any]:
        return {key: _jsonable_value(value) for key, value in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What a replay did.

    ``replayed`` rows went to the outbox.  ``too_old`` matched but were first sent longer ago
    than the replay age limit, and stay dead (replay them with ``force=True`` or discard them).
    ``problems`` names, for each id asked for with ``ids=`` that was not replayed, why not.
    """

    replayed: int
    too_old: int = 0
    problems: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "too_old": self.too_old,
            "problems": {str(key): value for key, value in self.problems.items()},
        }


@dataclasses.dataclass(frozen=True)
class DiscardResult:
    """What a discard did; ``problems`` as for :class:`ReplayResult`."""

    discarded: int
    problems: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"discarded": self.discarded, "problems": {str(key): value for key, value in self.problems.items()}}


@dataclasses.dataclass(frozen=True)
class PurgeResult:
    """Rows a purge deleted: ``dead`` ones past retention, ``handled`` (replayed or discarded) ones."""

    dead: int
    handled: int

    @property
    def deleted(self) -> int:
        return self.dead + self.handled


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadLetterCaptured(events.Event):
    """A failed message was written to the dead letters (``captures`` > 1: a redelivered
    message that was already dead refreshed its row)."""

    name: ClassVar[str] = "dead_letter.stored"
    level: ClassVar[int] = logging.WARNING
    dead_letter_id: int
    message_id: str
    actor_name: str
    queue_name: str
    error_type: str | None
    reason: str
    attempts: int
    fingerprint: str
    captures: int


@dataclasses.dataclass(frozen=True)
class DeadLetterCaptureFailed(events.Event):
    """A failed message could not be written to Postgres; it is only in RabbitMQ's ``.XQ``.

    The middleware logs this itself at CRITICAL with the whole story, so the event's own log
    line is DEBUG; listeners (alerts, metrics) get it either way.
    """

    name: ClassVar[str] = "dead_letter.store_failed"
    level: ClassVar[int] = logging.DEBUG
    message_id: str
    actor_name: str
    queue_name: str
    dead_letter_queue: str
    error: str


@dataclasses.dataclass(frozen=True)
class DeadLettersReplayed(events.Event):
    """A replay wrote ``count`` dead letters to the outbox (one event per call, not per row).
    Inside a caller's transaction it is emitted before that transaction commits."""

    name: ClassVar[str] = "dead_letter.replayed"
    level: ClassVar[int] = logging.INFO
    count: int
    too_old: int
    schema: str
    queue_name: str | None
    delay_ms: int | None
    handled_by: str
    duration_ms: float


@dataclasses.dataclass(frozen=True)
class DeadLettersDiscarded(events.Event):
    """A discard marked ``count`` dead letters discarded (one event per call)."""

    name: ClassVar[str] = "dead_letter.discarded"
    level: ClassVar[int] = logging.INFO
    count: int
    schema: str
    handled_by: str
    note: str | None


# --------------------------------------------------------------------------------------------
# Pure helpers: names, culprit, fingerprint, traceback
# --------------------------------------------------------------------------------------------


def notify_channel(schema: str) -> str:
    """The NOTIFY channel of new dead letters in ``schema``: ``"<schema>.dead_letters"``.

    ``validate_schema`` keeps schema names short enough for this channel to fit Postgres'
    63-byte identifiers (LISTEN would silently truncate a longer one and never hear a thing).
    """
    return f"{_sql.validate_schema(schema)}{_CHANNEL_SUFFIX}"


@dataclasses.dataclass(frozen=True)
class Culprit:
    """The frame a failure is blamed on: the innermost frame of user code in the traceback.

    ``user`` is False when no frame of user code was found (an unknown actor, an expired
    message) and the innermost frame of all stands in.
    """

    module: str
    function: str
    lineno: int
    user: bool = True

    def __str__(self) -> str:
        return f"{self.module}:{self.lineno} in {self.function}"

    @property
    def key(self) -> str:
        """What the fingerprint uses: no line number, so an unrelated edit above the failing
        line (a deploy) does not split one bug into two groups."""
        return f"{self.module}:{self.function}"


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(name) for name in ("stdlib", "platstdlib")}
    roots |= {os.path.dirname(os.__file__)}
    return tuple(sorted(os.path.normcase(os.path.abspath(root)) + os.sep for root in roots if root))


_LIBRARY_MODULES = ("dramatiq", "dramatiq_reliable")


def _is_library_frame(module: str, filename: str) -> bool:
    if any(module == name or module.startswith(name + ".") for name in _LIBRARY_MODULES):
        return True
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return True
    path = os.path.normcase(os.path.abspath(filename))
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    return path.startswith(_library_roots())


def find_culprit(exception: BaseException | None) -> Culprit | None:
    """The innermost traceback frame of user code, else the innermost frame, else ``None``.

    Innermost, not outermost: the outermost user frame is the actor's own function, which every
    bug in that actor shares; the innermost is where this bug raised.  Frames of Dramatiq,
    dramatiq-reliable, installed packages and the standard library are skipped, so a
    ``JSONDecodeError`` is blamed on the line that called ``json.loads``.
    """
    if exception is None:
        return None
    frames: list[Culprit] = []
    tb: TracebackType | None = exception.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        module = frame.f_globals.get("__name__") or os.path.splitext(os.path.basename(code.co_filename))[0]
        function = getattr(code, "co_qualname", code.co_name)
        frames.append(
            Culprit(str(module), str(function), tb.tb_lineno, not _is_library_frame(str(module), code.co_filename))
        )
        tb = tb.tb_next
    for culprit in reversed(frames):
        if culprit.user:
            return culprit
    return frames[-1] if frames else None


def fingerprint(error_type: str | None, culprit: Culprit | None) -> str:
    """A short stable hash of the error type and the culprit frame (without its line number):
    the same bug on any host, before and after an unrelated deploy, has the same fingerprint."""
    key = f"{error_type or '-'}\n{culprit.key if culprit else '-'}"
    return hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()[:16]


def format_traceback(exception: BaseException | None, *, max_chars: int = 64 * 1024) -> str:
    """The full traceback of ``exception`` (with its chained causes), as Python prints it.

    Longer ones keep their head and their tail, where the error is, around a marker.
    """
    if exception is None:
        return ""
    try:
        text = "".join(traceback_module.format_exception(type(exception), exception, exception.__traceback__))
    except Exception as error:  # a broken __str__ must not lose the dead letter
        text = f"<traceback could not be formatted: {type(error).__name__}: {error}>"
    return _clip(_clean_text(text), max_chars)


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    marker = f"\n... [{len(text) - max_chars} characters cut] ...\n"
    head = max_chars // 4
    tail = max_chars - head - len(marker)
    return text[:head] + marker + text[len(text) - max(tail, 0) :]


def _clean_text(text: str) -> str:
    # Postgres text cannot hold NUL.
    return text.replace("\x00", "\ufffd")


def _error_message(exception: BaseException | None) -> str:
    if exception is None:
        return "the message was failed without an exception (a middleware called message.fail())"
    try:
        text = str(exception)
    except Exception as error:
        text = f"<str() of the exception failed: {type(error).__name__}>"
    return _clip(_clean_text(text), _MAX_ERROR_MESSAGE_CHARS)


def _http_status_of(exception: BaseException | None) -> int | None:
    """The HTTP status an error or one of the errors it wraps carries (requests, httpx, aiohttp,
    botocore, urllib), by :func:`~dramatiq_reliable.classify.http_status_of`'s duck typing."""
    seen = 0
    while exception is not None and seen < 8:
        status = http_status_of(exception)
        if status is not None:
            return status
        exception = exception.__cause__ or exception.__context__
        seen += 1
    return None


def _json_text(data: Mapping[str, Any]) -> tuple[str, bool]:
    """``data`` as JSON for a jsonb column, and whether it is exact.

    jsonb refuses NUL characters and NaN, and ``json`` refuses objects; such values are stored
    in a readable but lossy form rather than losing the whole dead letter.
    """
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(_jsonable(data), separators=(",", ":"), allow_nan=False), False
    if "\\u0000" in text:
        return json.dumps(_jsonable(data), separators=(",", ":"), allow_nan=False), False
    return text, True


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return repr(value)


def _jsonable_value(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return value


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@functools.lru_cache(maxsize=1)
def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in some containers
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


# --------------------------------------------------------------------------------------------
# What a failure looks like, computed from the in-memory message
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
    message_id: str
    queue_name: str
    actor_name: str
    message_json: str
    exact: bool
    error_type: str | None
    error_message: str
    traceback: str
    attempts: int
    reason: str
    http_status: int | None
    retry_decision: Mapping[str, Any] | None
    fingerprint: str
    culprit: str | None
    sent_ms: int
    first_failed_ms: int | None

    def params(self, channel: str) -> dict[str, Any]:
        decision = json.dumps(_jsonable(self.retry_decision)) if self.retry_decision is not None else None
        return {
            "message_id": self.message_id,
            "queue_name": self.queue_name,
            "actor_name": self.actor_name,
            "message": self.message_json,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "traceback": self.traceback,
            "attempts": self.attempts,
            "reason": self.reason,
            "http_status": self.http_status,
            "retry_decision": decision,
            "fingerprint": self.fingerprint,
            "culprit": self.culprit,
            "sent_ms": self.sent_ms,
            "first_failed_ms": self.first_failed_ms,
            "worker_host": socket.gethostname(),
            "worker_pid": os.getpid(),
            "channel": channel,
        }


def _describe_failure(
    data: Mapping[str, Any],
    exception: BaseException | None,
    *,
    ran: bool,
    prior_retries: int | None,
    throws: Any,
    max_traceback_chars: int,
) -> _Failure:
    """Everything about a dead message that the worker knows and RabbitMQ's ``.XQ`` copy does not.

    ``ran``: the actor ran in this delivery; ``prior_retries``: ``options["retries"]`` as the
    delivery arrived (``None`` when the middleware's before-hook did not run).
    """
    options: Mapping[str, Any] = data.get("options") or {}
    retries_now = _as_int(options.get("retries")) or 0
    decision = options.get("retry_decision")
    if isinstance(decision, str):
        with contextlib.suppress(ValueError):
            decision = json.loads(decision)
    decision = decision if isinstance(decision, Mapping) else None
    # A decision is about this death only if the actor ran now and it said "do not retry"; a
    # leftover "retry" decision belongs to an earlier attempt (the message then died otherwise).
    fresh = decision is not None and ran and decision.get("retry") is False

    if prior_retries is not None:
        attempts = prior_retries + (1 if ran else 0)
    elif fresh and decision is not None and _as_int(decision.get("attempt")) is not None:
        attempts = int(decision["attempt"])
    elif ran:
        # An earlier middleware raised before ours ran; the retry middleware counted this run.
        attempts = max(retries_now, 1)
    else:
        attempts = retries_now

    if isinstance(exception, ActorNotFound):
        reason = "actor_not_found"
    elif isinstance(exception, SkipMessage):
        reason = "max_age" if "age limit" in str(exception).lower() else "skipped"
    elif fresh and decision is not None:
        outcome = decision.get("outcome")
        if outcome == "exhausted":
            reason = "retries_exhausted"
        elif outcome == "deadline":
            reason = "retry_deadline"
        else:
            reason = str(decision.get("reason") or "failed")[:64]
    elif throws and exception is not None and _isinstance(exception, throws):
        reason = "throws"
    elif exception is not None and ran:
        reason = "retries_exhausted"
    else:
        reason = "failed"

    http_status = _as_int(decision.get("http_status")) if fresh and decision is not None else None
    if http_status is None:
        http_status = _http_status_of(exception)

    error_type = _type_name(type(exception))[:_MAX_NAME_CHARS] if exception is not None else None
    culprit = find_culprit(exception)
    message_json, exact = _json_text(data)
    replay_of = options.get("replay_of")
    sent_ms = _as_int(replay_of.get("sent_at_ms")) if isinstance(replay_of, Mapping) else None
    if sent_ms is None:
        sent_ms = _as_int(data.get("message_timestamp")) or int(time.time() * 1000)
    return _Failure(
        message_id=str(data.get("message_id")),
        queue_name=q_name(str(data.get("queue_name"))),
        actor_name=str(data.get("actor_name")),
        message_json=message_json,
        exact=exact,
        error_type=error_type,
        error_message=_error_message(exception),
        traceback=format_traceback(exception, max_chars=max_traceback_chars),
        attempts=attempts,
        reason=reason,
        http_status=http_status,
        retry_decision=decision,
        fingerprint=fingerprint(error_type, culprit),
        culprit=_clean_text(str(culprit))[:_MAX_NAME_CHARS] if culprit else None,
        sent_ms=sent_ms,
        first_failed_ms=_as_int(options.get(FIRST_FAILURE_OPTION)),
    )


def _isinstance(exception: BaseException, throws: Any) -> bool:
    try:
        return isinstance(exception, throws)
    except TypeError:  # a malformed throws option
        return False


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------


class DeadLetterStore:
    """Reads and maintains the ``dead_letters`` table: list, show, group, replay, discard, purge.

    Parameters:
      database: where the table lives: a URL, a ``psycopg_pool.ConnectionPool`` or a
        :class:`~dramatiq_reliable.Database` to share (a broker's, say).
      schema: the Postgres schema of the tables (migrated to version 3 or later).
      replay_max_age_ms: replays of jobs first sent longer ago than this are refused unless
        forced; ``None`` never refuses.
      retention_ms: :meth:`purge` deletes dead letters whose last failure is older than this;
        ``None`` keeps them until discarded.
      batch_size: rows per transaction in bulk replays, discards and purges.

    Replays and discards run in the transaction bound with
    :func:`~dramatiq_reliable.outbox.bind` (or ``broker.transaction()``), or the one you pass as
    ``conn=``, and then commit or roll back with it; otherwise each batch commits on its own.
    """

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        replay_max_age_ms: int | None = DEFAULT_REPLAY_MAX_AGE_MS,
        retention_ms: int | None = DEFAULT_RETENTION_MS,
        batch_size: int = _DEFAULT_BATCH,
    ) -> None:
        _check_ms("replay_max_age_ms", replay_max_age_ms, allow_none=True, fix="e.g. 7 days = 604800000")
        _check_ms("retention_ms", retention_ms, allow_none=True, fix="e.g. 30 days = 2592000000")
        _check_batch(batch_size)
        self.schema = _sql.validate_schema(schema)
        self.channel = notify_channel(self.schema)
        self.replay_max_age_ms = replay_max_age_ms
        self.retention_ms = retention_ms
        self.batch_size = batch_size
        self._owned = not isinstance(database, Database)
        self.database = Database.of(database)
        self._ready = False

    @classmethod
    def from_broker(cls, broker: OutboxBroker, **options: Any) -> DeadLetterStore:
        """A store on ``broker``'s pool and schema."""
        if not isinstance(broker, OutboxBroker):
            raise ConfigurationError(
                f"DeadLetterStore.from_broker() needs an OutboxBroker, got {type(broker).__name__!r}; "
                "build DeadLetterStore(database=...) instead"
            )
        options.setdefault("schema", broker.schema)
        return cls(database=broker.database, **options)

    def close(self) -> None:
        """Close the pool if this store created it."""
        if self._owned:
            self.database.close()

    def __enter__(self) -> DeadLetterStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- connections ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self, conn: psycopg.Connection[Any] | None) -> Iterator[psycopg.Connection[Any]]:
        """The caller's transaction on ``conn``, or a pooled one that commits on exit.

        On a non-autocommit ``conn`` with no transaction open yet, the first statement opens
        the caller's transaction and committing it stays the caller's job, as with ``bind()``;
        ``conn.transaction()`` there would commit on exit.  Inside an open transaction a
        savepoint wraps the statements; on an autocommit connection a transaction does.
        """
        if conn is not None:
            if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self._check_ready(conn)
                yield conn
                return
            with conn.transaction():
                self._check_ready(conn)
                yield conn
            return
        with self.database.connection() as pooled, pooled.transaction():
            self._check_ready(pooled)
            yield pooled

    def _check_ready(self, conn: psycopg.Connection[Any]) -> None:
        if not self._ready:
            schema.ensure_ready(conn, schema=self.schema, required=schema.DEAD_LETTERS_VERSION, feature="dead letters")
            self._ready = True

    def _query(self, name: str) -> Any:
        return _sql.query(name, self.schema)

    # -- capture -------------------------------------------------------------------------------

    def _store(self, failure: _Failure, *, timeout_ms: int) -> DeadLetter:
        with self.database.connection() as conn, conn.transaction():
            self._check_ready(conn)
            # Bounds lock waits (a concurrent replay of the same message) so a nack is never held long.
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(timeout_ms),))
            row = (
                _sql.tuples(conn).execute(self._query("dead_letters_capture"), failure.params(self.channel)).fetchone()
            )
        assert row is not None
        dead_letter_id, captures, sent_at, first_failed_at, last_failed_at = row[:5]
        return DeadLetter(
            id=dead_letter_id,
            message_id=failure.message_id,
            queue_name=failure.queue_name,
            actor_name=failure.actor_name,
            error_type=failure.error_type,
            error_message=failure.error_message,
            attempts=failure.attempts,
            reason=failure.reason,
            http_status=failure.http_status,
            fingerprint=failure.fingerprint,
            culprit=failure.culprit,
            state="dead",
            sent_at=sent_at,
            first_failed_at=first_failed_at,
            last_failed_at=last_failed_at,
            worker_host=socket.gethostname(),
            worker_pid=os.getpid(),
            captures=captures,
            message=json.loads(failure.message_json),
            traceback=failure.traceback,
            retry_decision=failure.retry_decision,
        )

    # -- reading -------------------------------------------------------------------------------

    def get(self, dead_letter_id: int) -> DeadLetter | None:
        """One dead letter with its message, traceback and retry decision, in any state."""
        _check_id(dead_letter_id)
        with self._transaction(None) as conn:
            row = _sql.tuples(conn).execute(self._query("dead_letters_get"), {"id": dead_letter_id}).fetchone()
        return _record(row, full=True) if row else None

    def list(
        self,
        *,
        where: DeadLetterFilter | None = None,
        state: State | None = "dead",
        limit: int = 50,
        cursor: str | None = None,
    ) -> DeadLetterPage:
        """Dead letters newest first (by last failure), ``limit`` at a time.

        ``state=None`` lists every state.  Pagination is keyset-based: a page costs the same
        however deep it is, and rows that die meanwhile do not shift the pages.
        """
        where = _check_filter(where)
        if state is not None and state not in _STATES:
            raise ConfigurationError(f"state must be one of {_STATES!r} or None, got {state!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise ConfigurationError(f"limit must be an int from 1 to 10000, got {limit!r}")
        before_at, before_id = _decode_cursor(cursor)
        params = {**where.params(), "state": state, "before_at": before_at, "before_id": before_id, "limit": limit}
        with self._transaction(None) as conn:
            # prepare=False: planned with the actual values, so unused filters fold away.
            rows = _sql.tuples(conn).execute(self._query("dead_letters_list"), params, prepare=False).fetchall()
        items = tuple(_record(row, full=False) for row in rows)
        next_cursor = _encode_cursor(items[-1].last_failed_at, items[-1].id) if len(items) == limit else None
        return DeadLetterPage(items, next_cursor)

    def count(
        self, *, where: DeadLetterFilter | None = None, ids: Sequence[int] | None = None, state: State | None = "dead"
    ) -> int:
        """How many dead letters match (state ``dead`` by default)."""
        return self._count(None, _check_filter(where), _check_ids(ids), state, None)[0]

    def _count(
        self,
        conn: psycopg.Connection[Any] | None,
        where: DeadLetterFilter,
        ids: Sequence[int] | None,
        state: State | None,
        max_age_ms: int | None,
    ) -> tuple[int, int, int]:
        params = {**where.params(), "ids": ids, "state": state, "max_age_s": _seconds(max_age_ms)}
        with self._transaction(conn) as tx:
            row = _sql.tuples(tx).execute(self._query("dead_letters_count"), params, prepare=False).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2])

    def replay_preview(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        force: bool = False,
        max_age_ms: int | None = _UNSET,
    ) -> tuple[int, int]:
        """What :meth:`replay` with the same arguments would find: (dead letters matching, how
        many of them it would refuse as too old).  For confirmation prompts."""
        if max_age_ms is _UNSET:
            max_age_ms = self.replay_max_age_ms
        _check_ms("max_age_ms", max_age_ms, allow_none=True, fix="or pass force=True")
        where = _check_filter(where)
        total, too_old, _ = self._count(None, where, _check_ids(ids), "dead", None if force else max_age_ms)
        return total, too_old

    def stats(self, *, where: DeadLetterFilter | None = None, limit: int = 20) -> tuple[DeadLetterGroup, ...]:
        """Dead letters grouped by fingerprint, biggest group first."""
        where = _check_filter(where)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise ConfigurationError(f"limit must be an int from 1 to 10000, got {limit!r}")
        with self._transaction(None) as conn:
            rows = (
                _sql.tuples(conn)
                .execute(self._query("dead_letters_stats"), {**where.params(), "limit": limit}, prepare=False)
                .fetchall()
            )
        return tuple(
            DeadLetterGroup(
                fingerprint=row[0],
                count=row[1],
                actors=row[2],
                first_failed_at=row[3],
                last_failed_at=row[4],
                error_type=row[5],
                culprit=row[6],
                actor_name=row[7],
                queue_name=row[8],
                error_message=row[9],
                latest_id=row[10],
            )
            for row in rows
        )

    def counts(self) -> tuple[DeadLetterCount, ...]:
        """Dead letters (state ``dead``) by actor and error type, biggest first: for status
        pages, alert rules and metrics gauges."""
        with self._transaction(None) as conn:
            rows = _sql.tuples(conn).execute(self._query("dead_letters_counts")).fetchall()
        return tuple(DeadLetterCount(row[0], row[1], row[2], row[3], row[4]) for row in rows)

    # -- replay and discard --------------------------------------------------------------------

    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        queue_name: str | None = None,
        delay_ms: int | None = None,
        force: bool = False,
        max_age_ms: int | None = _UNSET,
        by: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayResult:
        """Send dead letters again, through the outbox, and mark them replayed.

        Pick rows with ``ids=``, ``where=`` (``DeadLetterFilter()`` for all) or both (their
        intersection).  Each replayed message keeps its ``message_id`` (one logical job from
        end to end; it never committed an idempotency key, since it failed) and its options,
        except :data:`RESET_OPTIONS`, so it starts with a fresh retry budget;
        ``options["replay_of"]`` records the dead letter's id, when the job was first sent,
        and how many times it was replayed.  ``queue_name`` sends it to another queue (same
        actor), ``delay_ms`` delays it.

        The outbox row and the state change are one statement, so they commit together: a
        replay is never lost, and a row is replayed at most once (only rows still ``dead`` are
        picked, under a row lock).  Jobs first sent more than ``max_age_ms`` ago (default: the
        store's ``replay_max_age_ms``) are left dead unless ``force=True``.

        The messages reach RabbitMQ when the relay publishes them (``WorkerRelay`` or
        ``dramatiq-reliable relay``).  ``progress(done, total)`` is called after each batch.
        """
        started = time.perf_counter()
        id_list, where = _check_target(ids, where, "replay")
        if queue_name is not None and (
            not isinstance(queue_name, str) or not queue_name or queue_name != q_name(queue_name)
        ):
            raise ConfigurationError(
                f"queue_name must be a queue's canonical name (not its .DQ or .XQ), got {queue_name!r}"
            )
        if delay_ms is not None:
            _check_ms("delay_ms", delay_ms, allow_none=False, fix="e.g. delay_ms=60000 for one minute")
        if not isinstance(force, bool):
            raise ConfigurationError(f"force must be a bool, got {force!r}")
        if max_age_ms is _UNSET:
            max_age_ms = self.replay_max_age_ms
        _check_ms("max_age_ms", max_age_ms, allow_none=True, fix="or pass force=True")
        age_limit = None if force else max_age_ms
        handled_by = _check_by(by)
        bound = conn if conn is not None else bound_connection()

        before = self._states(bound, id_list, age_limit) if id_list is not None else {}
        total, too_old, upto = self._count(bound, where, id_list, "dead", age_limit)
        params = {
            **where.params(),
            "ids": id_list,
            "upto_id": upto,
            "max_age_s": _seconds(age_limit),
            "to_queue": queue_name,
            "delay_ms": delay_ms,
            "handled_by": handled_by,
            "reset_options": list(RESET_OPTIONS),
            "batch": self.batch_size,
        }
        replayed = self._batches("dead_letters_replay", params, bound, total - too_old, progress) if upto else 0
        problems = self._problems(bound, id_list, before, "replayed", age_limit) if id_list is not None else {}
        events.emit(
            DeadLettersReplayed(
                count=replayed,
                too_old=too_old,
                schema=self.schema,
                queue_name=queue_name,
                delay_ms=delay_ms,
                handled_by=handled_by,
                duration_ms=(time.perf_counter() - started) * 1000,
            )
        )
        return ReplayResult(replayed, too_old, problems)

    def discard(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        note: str | None = None,
        by: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DiscardResult:
        """Mark dead letters discarded, on purpose: they stay (with ``note``, who and when) for
        the audit trail until :meth:`purge`.  Rows are picked as for :meth:`replay`."""
        id_list, where = _check_target(ids, where, "discard")
        if note is not None and not isinstance(note, str):
            raise ConfigurationError(f"note must be a string or None, got {note!r}")
        handled_by = _check_by(by)
        bound = conn if conn is not None else bound_connection()
        before = self._states(bound, id_list, None) if id_list is not None else {}
        total, _, upto = self._count(bound, where, id_list, "dead", None)
        params = {
            **where.params(),
            "ids": id_list,
            "upto_id": upto,
            "handled_by": handled_by,
            "note": _clean_text(note)[:_MAX_ERROR_MESSAGE_CHARS] if note else None,
            "batch": self.batch_size,
        }
        discarded = self._batches("dead_letters_discard", params, bound, total, progress) if upto else 0
        problems = self._problems(bound, id_list, before, "discarded", None) if id_list is not None else {}
        events.emit(DeadLettersDiscarded(count=discarded, schema=self.schema, handled_by=handled_by, note=note))
        return DiscardResult(discarded, problems)

    def _batches(
        self,
        name: str,
        params: dict[str, Any],
        conn: psycopg.Connection[Any] | None,
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> int:
        # Keyset batches on (last_failed_at, id), the order of the filters' indexes, up to the
        # highest id counted beforehand: each batch is short, its own transaction unless the
        # caller's, and rows that die meanwhile are left alone.
        done = 0
        after_at: datetime.datetime | None = None
        after_id = 0
        while True:
            with self._transaction(conn) as tx:
                row = (
                    _sql.tuples(tx)
                    .execute(self._query(name), {**params, "after_at": after_at, "after_id": after_id}, prepare=False)
                    .fetchone()
                )
            assert row is not None
            handled = int(row[0])
            done += handled
            if progress is not None and handled:
                progress(done, max(total, done))
            # total came from the count: stopping there saves a last scan that finds nothing.
            if handled < self.batch_size or row[2] is None or done >= total:
                return done
            after_at, after_id = row[1], int(row[2])

    def _states(
        self, conn: psycopg.Connection[Any] | None, ids: Sequence[int], max_age_ms: int | None
    ) -> dict[int, tuple[str, bool]]:
        with self._transaction(conn) as tx:
            rows = (
                _sql.tuples(tx)
                .execute(self._query("dead_letters_states"), {"ids": ids, "max_age_s": _seconds(max_age_ms)})
                .fetchall()
            )
        return {row[0]: (row[1], bool(row[3])) for row in rows}

    def _problems(
        self,
        conn: psycopg.Connection[Any] | None,
        ids: Sequence[int],
        before: Mapping[int, tuple[str, bool]],
        done_state: str,
        age_limit: int | None,
    ) -> dict[int, str]:
        after = self._states(conn, ids, None)
        problems: dict[int, str] = {}
        for dead_letter_id in ids:
            if dead_letter_id not in before:
                problems[dead_letter_id] = "not found"
            elif before[dead_letter_id][0] != "dead":
                problems[dead_letter_id] = f"already {before[dead_letter_id][0]}"
            elif after.get(dead_letter_id, ("",))[0] == done_state:
                continue
            elif before[dead_letter_id][1]:
                age = _format_duration_ms(age_limit or 0)
                problems[dead_letter_id] = f"first sent more than {age} ago; pass force to replay it, or discard it"
            else:
                problems[dead_letter_id] = (
                    "not handled: it does not match the filter, or a concurrent replay or discard held it"
                )
        return problems

    # -- retention -----------------------------------------------------------------------------

    def purge(
        self,
        *,
        older_than_ms: int | None = _UNSET,
        handled_older_than_ms: int | None = 0,
        batch: int | None = None,
    ) -> PurgeResult:
        """Delete handled rows and dead rows past retention, in short batches.

        ``older_than_ms`` (default: the store's ``retention_ms``; ``None`` keeps them): dead
        rows whose last failure is older.  ``handled_older_than_ms`` (default 0, all of them;
        ``None`` keeps them): replayed and discarded rows handled longer ago.
        """
        if older_than_ms is _UNSET:
            older_than_ms = self.retention_ms
        _check_ms("older_than_ms", older_than_ms, allow_none=True, fix="e.g. 30 days = 2592000000")
        _check_ms("handled_older_than_ms", handled_older_than_ms, allow_none=True, fix="0 purges every handled row")
        size = self.batch_size if batch is None else _check_batch(batch)
        dead = self._purge("dead_letters_purge_dead", older_than_ms, size) if older_than_ms is not None else 0
        handled = (
            self._purge("dead_letters_purge_handled", handled_older_than_ms, size)
            if handled_older_than_ms is not None
            else 0
        )
        return PurgeResult(dead, handled)

    def _purge(self, name: str, older_than_ms: int, batch: int) -> int:
        total = 0
        while True:
            with self._transaction(None) as conn:
                deleted = conn.execute(
                    self._query(name), {"older_than_s": older_than_ms / 1000, "batch": batch}
                ).rowcount
            total += deleted
            if deleted < batch:
                return total


# --------------------------------------------------------------------------------------------
# The middleware
# --------------------------------------------------------------------------------------------


class DeadLetters(Middleware):
    """Writes every message that fails for good to the ``dead_letters`` table.

    It captures every way a message dies, because it hooks the nack itself rather than the
    reasons for it: retries exhausted, ``Unrecoverable`` or another error classified permanent
    by ``ClassifiedRetries``, an actor's ``throws``, ``AgeLimit``, ``TimeLimit`` (after its
    retries), and messages for an actor this worker does not know.

    **Never lose the message.**  The row is written in ``before_nack``, from the message and
    exception the worker holds in memory (the ``.XQ`` copy has a stale retry count and
    traceback), *before* the nack reaches RabbitMQ:

    * if the write fails (Postgres down, schema not migrated), the failure is logged at
      CRITICAL with the message id and emitted as :class:`DeadLetterCaptureFailed`, the hook
      returns normally and the nack still happens: the message is in the ``.XQ`` queue;
    * if the worker dies between the write and the nack, RabbitMQ redelivers the message; if
      it dies again, the row is refreshed (``captures`` counts it), never doubled.

    Writing after the nack (``after_nack``) would open the opposite window: a crash between the
    nack and the write leaves the message in ``.XQ`` only.  The hook raises nothing: Dramatiq
    would skip the nack for a ``MiddlewareError``.

    **Where it goes** in the middleware list: anywhere before the retry middleware, which must
    stay last; after ``Tracing``, so the trace context is in the stored options (the whole
    list: docs/middleware-order.md).

    Parameters:
      database: where to write (a URL, a pool or a ``Database``); by default the
        ``OutboxBroker``'s pool.
      schema: the schema of the tables; by default the ``OutboxBroker``'s (else
        ``dramatiq_reliable``).
      on_dead_letter: called with each stored :class:`DeadLetter`, in the worker thread, after
        the row committed (alerting); its exceptions are logged and ignored.
      timeout_ms: longest wait for a pooled connection (when this middleware owns the pool) and
        for the insert, so an outage delays a nack by at most about this long.
      max_traceback_chars: longer tracebacks keep their head and tail.

    >>> broker = OutboxBroker(url=..., database=..., middleware=build_middleware(  # doctest: +SKIP
    ...     middleware=[AgeLimit(), TimeLimit(), ShutdownNotifications(), Idempotency(),
    ...                 DeadLetters(on_dead_letter=page_the_on_call)],
    ...     retries=ClassifiedRetries()))
    """

    def __init__(
        self,
        *,
        database: DatabaseLike | None = None,
        schema: str | None = None,
        on_dead_letter: Callable[[DeadLetter], None] | None = None,
        timeout_ms: int = 5000,
        max_traceback_chars: int = 64 * 1024,
    ) -> None:
        if schema is not None:
            notify_channel(schema)
        if on_dead_letter is not None and not callable(on_dead_letter):
            raise ConfigurationError(f"on_dead_letter must be a callable taking a DeadLetter, got {on_dead_letter!r}")
        _check_ms("timeout_ms", timeout_ms, allow_none=False, fix="e.g. timeout_ms=5000", minimum=1)
        if (
            isinstance(max_traceback_chars, bool)
            or not isinstance(max_traceback_chars, int)
            or max_traceback_chars < 1000
        ):
            raise ConfigurationError(
                f"max_traceback_chars must be an int of at least 1000, got {max_traceback_chars!r}"
            )
        self.schema = schema
        self.on_dead_letter = on_dead_letter
        self.timeout_ms = timeout_ms
        self.max_traceback_chars = max_traceback_chars
        self._database = database if isinstance(database, Database) else None
        self._owned_database: Database | None = None
        if database is not None and not isinstance(database, Database):
            self._owned_database = Database.of(database, max_size=4, timeout_ms=timeout_ms)
        self._store: DeadLetterStore | None = None
        self._lock = threading.Lock()

    def store(self, broker: Broker) -> DeadLetterStore:
        """The store this middleware writes to (built on first use)."""
        if self._store is not None:
            return self._store
        with self._lock:
            if self._store is None:
                database = self._owned_database or self._database
                if isinstance(broker, OutboxBroker):
                    database = database or broker.database
                    schema_name = self.schema or broker.schema
                elif database is None:
                    raise ConfigurationError(
                        f"DeadLetters on a {type(broker).__name__} needs database=; "
                        "or use dramatiq_reliable.OutboxBroker, whose pool it shares"
                    )
                else:
                    schema_name = self.schema or _sql.DEFAULT_SCHEMA
                self._store = DeadLetterStore(database=database, schema=schema_name)
            return self._store

    # -- lifecycle -----------------------------------------------------------------------------

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        # Say so at boot, not at the first failure, if nothing will be stored; in a thread, so
        # an unreachable Postgres does not hold up the worker's start.
        threading.Thread(
            target=self._check_at_boot, args=(broker,), name="dramatiq-reliable-dead-letters-check", daemon=True
        ).start()

    def _check_at_boot(self, broker: Broker) -> None:
        try:
            store = self.store(broker)
            with store.database.connection() as conn:
                store._check_ready(conn)
        except Exception as error:
            logger.critical(
                "dead letters will NOT be stored in Postgres (%s: %s); failed messages go only to RabbitMQ's "
                ".XQ queues until this is fixed",
                type(error).__name__,
                _first_line(error),
            )

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self._owned_database is not None:
            self._owned_database.close()

    # -- what the capture needs from earlier hooks ---------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int) -> None:
        # The first retry is enqueued right after the first failure, whose time the retry
        # middleware put in requeue_timestamp; later retries overwrite that, so keep a copy.
        options = message.options
        if FIRST_FAILURE_OPTION not in options:
            first = _as_int(options.get("requeue_timestamp"))
            if first is not None:
                options[FIRST_FAILURE_OPTION] = first

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        # The retry middleware increments "retries" in its after-hook, before the nack: keep the
        # count as the delivery arrived to know how many times the actor ran.
        with contextlib.suppress(AttributeError, dataclasses.FrozenInstanceError):
            setattr(message, _PRIOR_ATTR, _as_int(message.options.get("retries")) or 0)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        with contextlib.suppress(AttributeError, dataclasses.FrozenInstanceError):
            setattr(message, _RAN_ATTR, True)

    # -- the capture ---------------------------------------------------------------------------

    def before_nack(self, broker: Broker, message: MessageProxy) -> None:
        """Store the dying message; never raises, so the nack always follows."""
        try:
            self.capture(broker, message)
        except Exception:  # pragma: no cover - capture() already catches; belt and braces
            logger.critical("dead letter capture of message %s failed", getattr(message, "message_id", "?"))

    def capture(self, broker: Broker, message: MessageProxy) -> DeadLetter | None:
        """Write ``message`` (failed, with its stuffed exception) to the store; return the row,
        or ``None`` when it could not be written (then logged at CRITICAL)."""
        message_id = str(getattr(message, "message_id", "?"))
        actor_name = str(getattr(message, "actor_name", "?"))
        queue_name = q_name(str(getattr(message, "queue_name", "?")))
        try:
            exception = getattr(message, "_exception", None)
            failure = _describe_failure(
                message.asdict(),
                exception if isinstance(exception, BaseException) else None,
                ran=bool(getattr(message, _RAN_ATTR, False)),
                prior_retries=_as_int(getattr(message, _PRIOR_ATTR, None)),
                throws=_throws(broker, message),
                max_traceback_chars=self.max_traceback_chars,
            )
            if not failure.exact:
                logger.warning(
                    "message %s has values JSON cannot hold exactly (NUL characters, NaN, objects); its dead "
                    "letter stores a readable copy, and a replay would send that copy",
                    message_id,
                )
            dead_letter = self.store(broker)._store(failure, timeout_ms=self.timeout_ms)
        except Exception as error:
            logger.critical(
                "dead letter of message %s (actor %r, queue %r) was NOT stored in Postgres: %s: %s; "
                "the message is only in RabbitMQ's dead-letter queue %r",
                message_id,
                actor_name,
                queue_name,
                type(error).__name__,
                _first_line(error),
                xq_name(queue_name),
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            events.emit(
                DeadLetterCaptureFailed(
                    message_id=message_id,
                    actor_name=actor_name,
                    queue_name=queue_name,
                    dead_letter_queue=xq_name(queue_name),
                    error=f"{type(error).__name__}: {_first_line(error)}",
                )
            )
            return None
        events.emit(
            DeadLetterCaptured(
                dead_letter_id=dead_letter.id,
                message_id=dead_letter.message_id,
                actor_name=dead_letter.actor_name,
                queue_name=dead_letter.queue_name,
                error_type=dead_letter.error_type,
                reason=dead_letter.reason,
                attempts=dead_letter.attempts,
                fingerprint=dead_letter.fingerprint,
                captures=dead_letter.captures,
            )
        )
        if self.on_dead_letter is not None:
            try:
                self.on_dead_letter(dead_letter)
            except Exception:
                logger.exception(
                    "on_dead_letter hook %r failed for dead letter %d; the dead letter is stored",
                    self.on_dead_letter,
                    dead_letter.id,
                )
        return dead_letter


def _throws(broker: Broker, message: MessageProxy) -> Any:
    throws = message.options.get("throws")
    if throws:
        return throws
    try:
        return broker.get_actor(message.actor_name).options.get("throws")
    except ActorNotFound:
        return None


# --------------------------------------------------------------------------------------------
# Validation and conversions
# --------------------------------------------------------------------------------------------


def _check_batch(batch: Any) -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 100_000:
        raise ConfigurationError(f"batch_size must be an int from 1 to 100000, got {batch!r}; e.g. 5000")
    return int(batch)


def _check_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"a dead letter id is a positive int, got {value!r}")
    return int(value)


def _check_ids(ids: Sequence[int] | None) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ConfigurationError(f"ids must be a sequence of dead letter ids, got {ids!r}")
    checked = [_check_id(item) for item in ids]
    if not checked:
        raise ConfigurationError("ids is empty; pass at least one dead letter id, or where= to pick by filter")
    return sorted(set(checked))


def _check_filter(where: DeadLetterFilter | None) -> DeadLetterFilter:
    if where is None:
        return DeadLetterFilter()
    if not isinstance(where, DeadLetterFilter):
        raise ConfigurationError(f"where must be a DeadLetterFilter, got {type(where).__name__!r}")
    return where


def _check_target(
    ids: Sequence[int] | None, where: DeadLetterFilter | None, verb: str
) -> tuple[list[int] | None, DeadLetterFilter]:
    if ids is None and where is None:
        raise ConfigurationError(
            f"{verb}() needs ids= or where=; to {verb} every dead letter pass where=DeadLetterFilter()"
        )
    return _check_ids(ids), _check_filter(where)


def _check_by(by: str | None) -> str:
    if by is None:
        return _who()
    if not isinstance(by, str) or not by:
        raise ConfigurationError(f"by must be a non-empty string naming who acts, got {by!r}")
    return by[:_MAX_NAME_CHARS]


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _encode_cursor(last_failed_at: datetime.datetime, dead_letter_id: int) -> str:
    return f"{(last_failed_at - _EPOCH) // _US}.{dead_letter_id}"


def _decode_cursor(cursor: str | None) -> tuple[datetime.datetime | None, int | None]:
    if cursor is None:
        return None, None
    try:
        micros, dead_letter_id = (int(part) for part in str(cursor).split("."))
    except ValueError:
        raise ConfigurationError(
            f"cursor {cursor!r} is not one a listing returned; pass next_cursor unchanged"
        ) from None
    return _EPOCH + micros * _US, dead_letter_id


def _record(row: Sequence[Any], *, full: bool) -> DeadLetter:
    return DeadLetter(
        id=row[0],
        message_id=row[1],
        queue_name=row[2],
        actor_name=row[3],
        error_type=row[4],
        error_message=row[5],
        attempts=row[6],
        reason=row[7],
        http_status=row[8],
        fingerprint=row[9],
        culprit=row[10],
        state=row[11],
        sent_at=row[12],
        first_failed_at=row[13],
        last_failed_at=row[14],
        worker_host=row[15],
        worker_pid=row[16],
        captures=row[17],
        handled_at=row[18],
        handled_by=row[19],
        note=row[20],
        replayed_to=row[21],
        message=row[22] if full else None,
        traceback=row[23] if full else None,
        retry_decision=row[24] if full else None,
    )


def _format_duration_ms(ms: int) -> str:
    """``7d``, ``36h``, ``15m``, ``30s``: the largest unit that divides ``ms`` evenly, else ms."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
