"""Dead-letter records: what a listing, a bulk command and the events hand back, and the constants they share."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from .. import _sql, events
from .._checks import check_text
from ..errors import ConfigurationError

__all__ = [
    "DEFAULT_REPLAY_MAX_AGE_MS",
    "DEFAULT_RETENTION_MS",
    "FIRST_FAILURE_OPTION",
    "REASONS",
    "RESET_OPTIONS",
    "DeadLetter",
    "DeadLetterCaptureFailed",
    "DeadLetterCaptured",
    "DeadLetterCount",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterPage",
    "DeadLettersDiscarded",
    "DeadLettersReplayed",
    "DiscardResult",
    "PurgeResult",
    "ReplayResult",
    "notify_channel",
]

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

#: Why a message died, the values of ``DeadLetter.reason``, each with what it means.  The retry
#: middleware's finer verdict (``http_404``, ``timeout``...) stays in ``retry_decision``.
REASONS: Mapping[str, str] = {
    "retries_exhausted": "it failed on every attempt its retry budget allowed (max_retries, retry_when or "
    "retry_deadline_ms)",
    "unrecoverable": "its error was classified permanent (Unrecoverable, throws, a rule, or an error such as "
    "HTTP 404 that no retry can fix), so it was not retried",
    "commit_outcome_unknown": "the actor returned but the connection broke during COMMIT, again and again: its "
    "writes may or may not have landed; a replay is safe, the processed key skips a job that did commit",
    "time_limit": "its last attempt was killed by the actor's time_limit",
    "age_limit": "it was older than its max_age when a worker got it, so it never ran",
    "imported_from_xq": "it was moved from RabbitMQ's .XQ queue by 'dead-letters import-xq'; the error and "
    "attempts are what the queued body held, which may be from an earlier attempt",
    "delivery_limit": "it was delivered delivery_limit times on a quorum queue and never acked: each time the "
    "worker died or lost its connection while running it (a crash, the OOM killer, SIGKILL), so it was not run "
    "again",
    "failed": "it failed for good for another reason (an unknown actor, a middleware that failed it, a "
    "commit Postgres refused): see the error",
}

State = Literal["dead", "replayed", "discarded"]
#: The states a dead letter can be in, as ``State`` lists them.
STATES: tuple[State, ...] = ("dead", "replayed", "discarded")
_CHANNEL_SUFFIX = ".dead_letters"
_MAX_ERROR_MESSAGE_CHARS = 8000
_MAX_NAME_CHARS = 500
_DEFAULT_BATCH = 5000
_PRIOR_ATTR = "_dramatiq_reliable_prior_retries"
_RAN_ATTR = "_dramatiq_reliable_ran"


class _Unset:
    def __repr__(self) -> str:
        return "<store default>"


#: The default of an argument whose default is the store's own setting (``max_age_ms`` of a
#: replay is the store's ``replay_max_age_ms`` unless given; ``None`` there means "no limit").
UNSET: Any = _Unset()


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
            # No stored name is longer (they are cut at capture) or holds what Postgres text
            # refuses (escaped at capture): such a value could match nothing, and would reach
            # the driver as its error rather than ours.
            check_text(
                f"filter {name}",
                getattr(self, name),
                max_chars=_MAX_NAME_CHARS,
                allow_none=True,
                fix="give a name as the list shows it",
            )
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
    :meth:`PostgresDeadLetterStore.get` and at capture; listings leave them ``None`` (and shorten
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

    @property
    def explanation(self) -> str:
        """What :attr:`reason` means, in a sentence (rows stored before the reasons were fixed
        may hold older values, explained as such)."""
        return REASONS.get(self.reason, f"stored with the reason {self.reason!r} of an earlier version")

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


def _jsonable_value(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return value
