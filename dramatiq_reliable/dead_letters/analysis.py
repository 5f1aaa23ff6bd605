"""Failure analysis: why a message died, the frame to blame, a fingerprint per bug, text Postgres can store."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import socket
import sysconfig
import time
import traceback as traceback_module
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from dramatiq.common import q_name
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import SkipMessage
from dramatiq.middleware.time_limit import TimeLimitExceeded

from .._checks import is_int
from .._util import type_name as _type_name
from ..classify import http_status_of
from ..errors import CommitOutcomeUnknown, DeliveryLimitReached, JobCommitFailed, Unrecoverable
from .records import _MAX_ERROR_MESSAGE_CHARS, _MAX_NAME_CHARS, FIRST_FAILURE_OPTION

__all__ = ["Culprit", "Failure", "find_culprit", "fingerprint", "format_traceback"]


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


# What Postgres text and jsonb refuse: NUL, and surrogate code points (a Python str holds one only
# when it is lone: from surrogateescape, or an unpaired "\\ud800" decoded from JSON).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def _escape_unstorable(match: re.Match[str]) -> str:
    return "\\x00" if match[0] == "\x00" else f"\\u{ord(match[0]):04x}"


def _clean_text(text: str) -> str:
    """``text`` as Postgres can store it: NUL becomes the four characters ``\\x00`` and a lone
    surrogate its escape, ``\\ud800``; everything else is kept as it is (readable, not reversible)."""
    return _UNSTORABLE.sub(_escape_unstorable, text)


def _storable(text: str) -> bool:
    return _UNSTORABLE.search(text) is None


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

    jsonb refuses NUL characters, lone surrogates and NaN, and ``json`` refuses objects; such
    values are stored in a readable but lossy form (see :func:`_clean_text`; NaN as ``"nan"``,
    objects as their ``repr``) rather than losing the whole dead letter.
    """
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(_jsonable(data), separators=(",", ":"), allow_nan=False), False
    if "\\u0000" in text or not _all_storable(data):
        return json.dumps(_jsonable(data), separators=(",", ":"), allow_nan=False), False
    return text, True


def _all_storable(value: Any) -> bool:
    if isinstance(value, str):
        return _storable(value)
    if isinstance(value, Mapping):
        return all(_all_storable(key) and _all_storable(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return all(_all_storable(item) for item in value)
    return True


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return _clean_text(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {_clean_text(str(key)): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return repr(value)


def _as_int(value: Any) -> int | None:
    return value if is_int(value) else None


# --------------------------------------------------------------------------------------------
# What a failure looks like, computed from the in-memory message
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a store writes for one dead message: computed from it by the middleware (or from an
    ``.XQ`` body by the import), so every store stores the same thing."""

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
) -> Failure:
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

    if isinstance(exception, DeliveryLimitReached):
        attempts = exception.deliveries  # each delivery ran until the worker died; none was counted
    elif prior_retries is not None:
        attempts = prior_retries + (1 if ran else 0)
    elif fresh and decision is not None and _as_int(decision.get("attempt")) is not None:
        attempts = int(decision["attempt"])
    elif ran:
        # An earlier middleware raised before ours ran; the retry middleware counted this run.
        attempts = max(retries_now, 1)
    else:
        attempts = retries_now

    reason = _reason(
        exception,
        decision if fresh else None,
        ran=ran,
        counted=retries_now > prior_retries if prior_retries is not None else retries_now >= 1,
        throws=throws,
    )

    http_status = _as_int(decision.get("http_status")) if fresh and decision is not None else None
    if http_status is None:
        http_status = _http_status_of(exception)

    error_type = _clean_text(_type_name(type(exception)))[:_MAX_NAME_CHARS] if exception is not None else None
    culprit = find_culprit(exception)
    message_json, exact = _json_text(data)
    message_id, queue_name, actor_name = (
        str(data.get("message_id")),
        q_name(str(data.get("queue_name"))),
        str(data.get("actor_name")),
    )
    exact = exact and all(_storable(name) for name in (message_id, queue_name, actor_name))
    replay_of = options.get("replay_of")
    sent_ms = _as_int(replay_of.get("sent_at_ms")) if isinstance(replay_of, Mapping) else None
    if sent_ms is None:
        sent_ms = _as_int(data.get("message_timestamp")) or int(time.time() * 1000)
    return Failure(
        message_id=_clean_text(message_id),
        queue_name=_clean_text(queue_name),
        actor_name=_clean_text(actor_name),
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


def _reason(
    exception: BaseException | None,
    decision: Mapping[str, Any] | None,
    *,
    ran: bool,
    counted: bool,
    throws: Any,
) -> str:
    """One of :data:`~.records.REASONS`, from the strongest evidence the worker holds.

    ``decision``: the retry middleware's verdict on this very death (``None`` if it gave none);
    ``counted``: the retry middleware counted this run in ``options["retries"]``, i.e. looked at
    the failure and still let the message die (Dramatiq's ``Retries`` does that only when the
    budget is spent).  Nothing falls back to ``retries_exhausted``: without evidence it is ``failed``.
    """
    if _in_chain(exception, CommitOutcomeUnknown) or (
        decision is not None and decision.get("outcome") == "outcome_unknown"
    ):
        return "commit_outcome_unknown"
    if isinstance(exception, SkipMessage) and "age limit" in str(exception).lower():
        return "age_limit"
    if isinstance(exception, TimeLimitExceeded):
        return "time_limit"
    if isinstance(exception, DeliveryLimitReached):
        return "delivery_limit"
    if decision is not None:
        outcome = decision.get("outcome")
        if outcome in ("exhausted", "deadline"):
            return "retries_exhausted"
        if outcome == "fail" and decision.get("category") == "permanent":
            return "unrecoverable"
        return "failed"
    if isinstance(exception, Unrecoverable) or (throws and exception is not None and _isinstance(exception, throws)):
        return "unrecoverable"
    if exception is not None and ran and counted and not isinstance(exception, (ActorNotFound, JobCommitFailed)):
        return "retries_exhausted"
    return "failed"


def _in_chain(exception: BaseException | None, kind: type[BaseException]) -> bool:
    seen = 0
    while exception is not None and seen < 8:
        if isinstance(exception, kind):
            return True
        exception = exception.__cause__ or exception.__context__
        seen += 1
    return False


def _isinstance(exception: BaseException, throws: Any) -> bool:
    try:
        return isinstance(exception, throws)
    except TypeError:  # a malformed throws option
        return False


_LAST_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")


def _describe_imported(data: Mapping[str, Any], *, max_traceback_chars: int = 64 * 1024) -> Failure:
    """A dead letter from a message body found in RabbitMQ's ``.XQ`` queue: whatever it holds.

    The body is the message as last published, so its ``retries``, ``traceback`` (Dramatiq's
    retry middleware copies it into the options) and ``retry_decision`` may be those of an
    earlier attempt; the error type and message are read from the traceback's last line.
    """
    options: Mapping[str, Any] = data.get("options") or {}
    traceback_text = options.get("traceback") if isinstance(options.get("traceback"), str) else ""
    error_type: str | None = None
    error_message = "no error was recorded in the message found in .XQ"
    lines = [line for line in (traceback_text or "").strip().splitlines() if line.strip()]
    if lines and (match := _LAST_LINE.match(lines[-1].strip())):
        error_type = _clean_text(match["type"])[:_MAX_NAME_CHARS]
        error_message = _clip(_clean_text(match["message"] or ""), _MAX_ERROR_MESSAGE_CHARS)
    decision = options.get("retry_decision")
    message_json, exact = _json_text(data)
    replay_of = options.get("replay_of")
    sent_ms = _as_int(replay_of.get("sent_at_ms")) if isinstance(replay_of, Mapping) else None
    return Failure(
        message_id=_clean_text(str(data.get("message_id"))),
        queue_name=_clean_text(q_name(str(data.get("queue_name")))),
        actor_name=_clean_text(str(data.get("actor_name"))),
        message_json=message_json,
        exact=exact,
        error_type=error_type,
        error_message=error_message,
        traceback=_clip(_clean_text(traceback_text or ""), max_traceback_chars),
        attempts=_as_int(options.get("retries")) or 0,
        reason="imported_from_xq",
        http_status=_as_int(decision.get("http_status")) if isinstance(decision, Mapping) else None,
        retry_decision=decision if isinstance(decision, Mapping) else None,
        fingerprint=fingerprint(error_type, None),
        culprit=None,
        sent_ms=sent_ms or _as_int(data.get("message_timestamp")) or int(time.time() * 1000),
        first_failed_ms=_as_int(options.get(FIRST_FAILURE_OPTION)),
    )


def _replayed_from(data: Mapping[str, Any]) -> int:
    """The dead letter a message was replayed from (0 if never): its death is new if no row of
    its message id is newer than that one."""
    options = data.get("options") or {}
    replay_of = options.get("replay_of") if isinstance(options, Mapping) else None
    return (_as_int(replay_of.get("dead_letter_id")) or 0) if isinstance(replay_of, Mapping) else 0
