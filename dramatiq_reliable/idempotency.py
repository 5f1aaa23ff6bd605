"""Idempotency: one effect per message, with the processed key committed in the job's own transaction.

Delivery is at least once: a worker that dies after the work but before the ack, a relay that
republishes after a lost confirm, or a producer that sends twice all run a job again.  The
:class:`Idempotency` middleware gives every job a key and keeps the keys that ran in the
``processed_jobs`` table, so a second run is recognised and acked without running the actor.

* **transactional** (the default): before the actor runs, the middleware borrows a pooled
  connection, opens a transaction and inserts the key as its first statement; the connection is
  bound (:func:`~dramatiq_reliable.outbox.bind`) while the actor runs, so the actor's writes
  (through :func:`connection`) and its ``send()`` calls join that transaction.  It commits when
  the actor returns and rolls back when it raises: the key exists exactly when the effect does.
  A concurrent duplicate waits on the uncommitted key's row lock, then sees it and skips.
* **record**: for actors whose effect is outside Postgres.  The key is checked before the actor
  runs and recorded after it returned, in its own short transaction.  A crash between the effect
  and the record runs the job again, so pass :func:`external_key` to the provider.
* **off**: the middleware leaves the actor alone.

The key is the ``message_id`` (stable across retries, delay-queue moves and relay republishes)
unless the actor option ``idempotency_key`` derives a business key from the arguments, or the
message option ``idempotency_key`` names one.  Keys are namespaced by actor.  Reusing a key with
other arguments fails the message with :class:`IdempotencyConflict` instead of skipping it, and
a key that cannot be computed fails it with :class:`IdempotencyKeyError`: both are dead-lettered
without running the actor.  If Postgres cannot be reached for the check the middleware fails
closed: it raises :class:`~dramatiq_reliable.errors.DatabaseUnavailable`, the actor does not run
and the retry middleware retries the message.

>>> broker = OutboxBroker(url="amqp://localhost", database="postgresql://app@localhost/app")  # doctest: +SKIP
>>> broker.add_middleware(Idempotency(), before=Callbacks)     # before actors are declared  # doctest: +SKIP
>>> @dramatiq.actor(idempotency_key=lambda order_id: f"invoice-{order_id}")   # doctest: +SKIP
... def issue_invoice(order_id):
...     job_connection().execute("INSERT INTO invoices (order_id) VALUES (%s)", (order_id,))
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal, NoReturn, TypeVar, cast

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Callbacks, Middleware, MiddlewareError, Pipelines, SkipMessage
from dramatiq.worker import ConsumerThread
from psycopg_pool import ConnectionPool, PoolTimeout

from . import _sql, events
from ._util import first_line as _first_line
from ._util import type_name
from .classify import Decision, backoff_ms, is_connection_failure
from .database import Database, DatabaseLike
from .errors import (
    ActorOptionError,
    CommitOutcomeUnknown,
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyConflict,
    IdempotencyKeyError,
    JobCommitFailed,
    MiddlewareFailed,
    NoCurrentJob,
    SchemaNotReady,
)
from .outbox.binding import bind
from .outbox.broker import OutboxBroker
from .postgres.broker import PostgresBroker
from .retries import (
    RETRY_DECISION_KEY,
    ClassifiedRetries,
    RetryGaveUp,
    RetryScheduled,
    decision_record,
    delays_disabled,
    retry_event,
)
from .schema import IDEMPOTENCY_VERSION, ensure_ready

__all__ = [
    "ActorOptionError",
    "Idempotency",
    "IdempotencyCommitFailed",
    "IdempotencyConflict",
    "IdempotencyDuplicateSkipped",
    "IdempotencyKeyError",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyReused",
    "IdempotencyKeysPurged",
    "IdempotencyRecordFailed",
    "IdempotencyUnavailable",
    "Job",
    "JobCommitFailed",
    "Mode",
    "NoCurrentJob",
    "current_job",
    "external_key",
    "make_purge_actor",
    "payload_hash",
    "purge_expired",
]

logger = logging.getLogger("dramatiq_reliable.idempotency")


Mode = Literal["transactional", "record", "off"]
MODES: tuple[Mode, ...] = ("transactional", "record", "off")

#: Keys past this many UTF-8 bytes are refused: they must fit a btree index entry with room to spare.
MAX_KEY_BYTES = 1000
DEFAULT_RETENTION_MS = 7 * 86_400_000
#: Retries of a job whose COMMIT had an unknown outcome, apart from its ``max_retries``.
DEFAULT_UNKNOWN_OUTCOME_RETRIES = 10
#: The first of those retries waits this long, doubling (with jitter) up to a minute.
DEFAULT_UNKNOWN_OUTCOME_BACKOFF_MS = 1000
_MAX_UNKNOWN_OUTCOME_BACKOFF_MS = 60_000
#: The message option counting those retries.
UNKNOWN_OUTCOME_RETRIES_KEY = "unknown_outcome_retries"
_OPTIONS = frozenset({"idempotency", "idempotency_key", "idempotency_retention_ms"})
# Pauses between tries on fresh connections: a reset socket fails in microseconds, so the
# first retry is quick; a server that is restarting gets up to a second between tries.
_FIRST_PAUSE_S = 0.05
_MAX_PAUSE_S = 1.0
_T = TypeVar("_T")


# -- events -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IdempotencyDuplicateSkipped(events.Event):
    """A job whose key already ran was acked without running the actor."""

    name: ClassVar[str] = "idempotency.duplicate"
    actor_name: str
    message_id: str
    key: str
    mode: str
    first_message_id: str
    queue_name: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeyReused(events.Event):
    """A key that ran was reused with other arguments; the message failed."""

    name: ClassVar[str] = "idempotency.conflict"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    key: str
    first_message_id: str


@dataclasses.dataclass(frozen=True)
class IdempotencyUnavailable(events.Event):
    """The key could not be checked (Postgres unreachable, schema missing): the actor did not run."""

    name: ClassVar[str] = "idempotency.unavailable"
    level: ClassVar[int] = logging.WARNING
    actor_name: str
    message_id: str
    mode: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeyInvalid(events.Event):
    """The key could not be computed; the message failed without running the actor."""

    name: ClassVar[str] = "idempotency.key_invalid"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyCommitFailed(events.Event):
    """The actor returned but its transaction did not commit; the message was not acked as done."""

    name: ClassVar[str] = "idempotency.commit_failed"
    level: ClassVar[int] = logging.ERROR
    actor_name: str
    message_id: str
    key: str
    error: str
    #: ``"unknown"``: the connection broke during COMMIT (the message is retried apart from its
    #: budget); ``"failed"``: Postgres refused the commit (the retry middleware decides).
    outcome: str


@dataclasses.dataclass(frozen=True)
class IdempotencyRecordFailed(events.Event):
    """Record mode: the actor succeeded but its key could not be recorded; a redelivery would run it again."""

    name: ClassVar[str] = "idempotency.record_failed"
    level: ClassVar[int] = logging.WARNING
    actor_name: str
    message_id: str
    key: str
    error: str


@dataclasses.dataclass(frozen=True)
class IdempotencyKeysPurged(events.Event):
    """Expired keys were deleted."""

    name: ClassVar[str] = "idempotency.purged"
    count: int
    schema: str
    duration_ms: float


class _Swallowed(psycopg.errors.InFailedSqlTransaction):
    """The actor caught a database error inside the job's transaction, so it cannot commit."""


# -- the job ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """The idempotency identity of one message: which key it runs under, and how."""

    actor_name: str
    key: str
    mode: Mode
    message_id: str

    def external_key(self, step: str) -> str:
        """A key for an external API call made by this job, the same on every run of the job."""
        return _external_key(self.actor_name, self.key, step)


@dataclasses.dataclass(eq=False)
class _Running:
    """What the middleware holds between the before- and after-hooks of one message."""

    job: Job
    message: MessageProxy
    payload_hash: bytes
    retention_s: float
    token: contextvars.Token[_Running | None] | None = None
    conn: psycopg.Connection[Any] | None = None
    pool: ConnectionPool[Any] | None = None
    binding: contextlib.AbstractContextManager[Any] | None = None
    restore_autocommit: bool = False


# Before- and after-hooks of one message run in the same worker thread and context, so a
# context variable carries the job from one to the other and is visible to the actor.
_current: contextvars.ContextVar[_Running | None] = contextvars.ContextVar(
    "dramatiq_reliable_idempotency_job", default=None
)


def current_job() -> Job:
    """The job the calling actor is running as; raises :class:`NoCurrentJob` outside one."""
    running = _current.get()
    if running is None:
        raise NoCurrentJob(
            "current_job() was called outside a job run by the Idempotency middleware; call it from an "
            "actor whose idempotency mode is 'transactional' or 'record'"
        )
    return running.job


def job_connection() -> psycopg.Connection[Any]:
    """The connection of the running job's transaction (transactional mode).

    Write on it and the writes commit with the job's key or not at all.  Do not commit or roll
    it back yourself; ``with conn.transaction():`` inside the actor makes a savepoint, which is fine.
    """
    running = _current.get()
    if running is None or running.conn is None:
        where = "outside a job" if running is None else f"in a job of mode {running.job.mode!r}"
        raise NoCurrentJob(
            f"job_connection() was called {where}; the job connection exists only while an actor with "
            "idempotency='transactional' runs under the Idempotency middleware"
        )
    return running.conn


def external_key(step: str) -> str:
    """A deterministic idempotency key for one external call of the running job.

    Derived from the actor, the job key and ``step`` (never random), so every retry and every
    redelivery of the job sends the same key and the provider can recognise the repeat.

    >>> stripe.PaymentIntent.create(..., idempotency_key=external_key("charge"))   # doctest: +SKIP
    """
    return current_job().external_key(step)


def _external_key(actor_name: str, key: str, step: str) -> str:
    if not isinstance(step, str) or not step:
        raise ConfigurationError(f"step must be a non-empty string, got {step!r}; name the call, e.g. 'charge'")
    digest = hashlib.sha256("\x00".join((actor_name, key, step)).encode()).hexdigest()
    # 64 hex chars: far under every provider's limit (Stripe: 255) and free of separators.
    return f"dr-{digest}"


# What json.dumps(..., sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=False)
# builds on every call, built once: the same bytes, so hashes stored by earlier versions still match.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=False)


def payload_hash(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> bytes:
    """sha256 of the canonical JSON of the arguments (keyword order does not matter).

    An argument may hold a lone surrogate (JSON carries ``"\\ud800"`` escaped, so a message can):
    ``surrogatepass`` hashes it instead of raising, and leaves the bytes of every other string,
    and so every hash stored by earlier versions, unchanged.
    """
    return hashlib.sha256(_CANONICAL.encode([list(args), kwargs]).encode("utf-8", "surrogatepass")).digest()


# -- the middleware -----------------------------------------------------------------------------


class Idempotency(Middleware):
    """One effect per message: the processed key is stored, and a duplicate is acked unrun.

    Actor options (declared on ``@dramatiq.actor``):
      idempotency: ``"transactional"``, ``"record"`` or ``"off"``; default ``default_mode``.
      idempotency_key: a callable taking the actor's arguments and returning the key string,
        e.g. ``lambda order_id: f"invoice-{order_id}"``; default: the message_id.
      idempotency_retention_ms: how long this actor's keys dedupe; default ``retention_ms``.

    Message options (``send_with_options``) ``idempotency`` and ``idempotency_key`` (a string)
    override the actor's.

    Parameters:
      database: where ``processed_jobs`` lives (a URL, a pool or a ``Database``).  Omit it with
        an ``OutboxBroker`` and the broker's pool is used, so the job's ``send()`` calls join its
        transaction.
      schema: the schema of the tables; default the broker's (or ``dramatiq_reliable``).
      default_mode: the mode of actors that do not choose one.
      retention_ms: how long a key dedupes; :func:`purge_expired` reclaims expired rows.
      connection_timeout_ms: how long the middleware keeps trying to check or record a key (a
        pooled connection, then the statement, again on a fresh connection after a
        connection-class error such as a socket the pool kept after a Postgres restart) before
        it gives up; default the pool's timeout.  Giving up before the actor ran fails closed
        (the message is retried); giving up on a record-mode record leaves the job acked
        without its key (see ``IdempotencyRecordFailed``).
      unknown_outcome_retries: how many times a job whose ``COMMIT`` failed for a
        connection-class reason is retried (the commit may have landed: the retry finds the
        key and skips if it did).  These retries do not count against ``max_retries``; past
        them the message is dead-lettered with reason ``commit_outcome_unknown``.
      unknown_outcome_backoff_ms: the delay before the first such retry; it doubles, with
        jitter, up to a minute.

    Ordering: put it after ``AgeLimit``/``TimeLimit`` and before ``Callbacks``, ``Pipelines`` and
    the retry middleware (``broker.add_middleware(Idempotency(), before=Callbacks)``).  After-hooks
    run in reverse, so a pipeline's next message and ``on_success`` callbacks then join the job's
    transaction; placed after them, they would be sent after the commit, and a crash in between
    would lose them for good (the redelivery is skipped as a duplicate), so the worker warns at
    boot.  Whatever the order, once the actor raised, the transaction is rolled back and unbound
    before anything is enqueued: the retry goes through its own connection, never into the
    transaction that is about to roll back.

    Transactional mode holds one pooled connection per running job: size the pool at least the
    worker's thread count plus two.  A duplicate delivered while the first run is in progress
    waits for it (the key's row lock) and holds a worker thread meanwhile.

    >>> broker.add_middleware(Idempotency(retention_ms=30 * 86_400_000), before=Callbacks)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        database: DatabaseLike | None = None,
        schema: str | None = None,
        default_mode: Mode = "transactional",
        retention_ms: int = DEFAULT_RETENTION_MS,
        connection_timeout_ms: int | None = None,
        unknown_outcome_retries: int = DEFAULT_UNKNOWN_OUTCOME_RETRIES,
        unknown_outcome_backoff_ms: int = DEFAULT_UNKNOWN_OUTCOME_BACKOFF_MS,
    ) -> None:
        if default_mode not in MODES:
            raise ConfigurationError(f"default_mode must be one of {MODES!r}, got {default_mode!r}")
        _check_retention("retention_ms", retention_ms, ConfigurationError)
        if connection_timeout_ms is not None and (
            isinstance(connection_timeout_ms, bool)
            or not isinstance(connection_timeout_ms, int)
            or connection_timeout_ms <= 0
        ):
            raise ConfigurationError(
                f"connection_timeout_ms must be a positive int of milliseconds or None, got {connection_timeout_ms!r}"
            )
        if (
            isinstance(unknown_outcome_retries, bool)
            or not isinstance(unknown_outcome_retries, int)
            or not (0 <= unknown_outcome_retries <= 1000)
        ):
            raise ConfigurationError(
                f"unknown_outcome_retries must be an int from 0 to 1000, got {unknown_outcome_retries!r}; "
                "0 dead-letters a commit whose outcome is unknown at once"
            )
        if (
            isinstance(unknown_outcome_backoff_ms, bool)
            or not isinstance(unknown_outcome_backoff_ms, int)
            or not 1 <= unknown_outcome_backoff_ms <= _MAX_UNKNOWN_OUTCOME_BACKOFF_MS
        ):
            raise ConfigurationError(
                f"unknown_outcome_backoff_ms must be an int of milliseconds from 1 to "
                f"{_MAX_UNKNOWN_OUTCOME_BACKOFF_MS}, got {unknown_outcome_backoff_ms!r}; e.g. 1000"
            )
        self.connection_timeout_ms = connection_timeout_ms
        self.unknown_outcome_retries = unknown_outcome_retries
        self.unknown_outcome_backoff_ms = unknown_outcome_backoff_ms
        self.schema: str | None = None if schema is None else _sql.validate_schema(schema)
        self.default_mode: Mode = default_mode
        self.retention_ms = retention_ms
        self._own_database = Database.of(database) if database is not None else None
        self._target: tuple[Database, str] | None = None
        self._schema_ready = False
        self._pool_open = False
        self._lock = threading.Lock()

    @property
    def actor_options(self) -> set[str]:
        return set(_OPTIONS)

    # -- configuration ------------------------------------------------------------------------

    def database_for(self, broker: Broker) -> tuple[Database, str]:
        """The database and schema the keys of ``broker``'s jobs live in."""
        if self._target is None:
            if self._own_database is not None:
                database = self._own_database
                default_schema = (
                    broker.schema if isinstance(broker, (OutboxBroker, PostgresBroker)) else _sql.DEFAULT_SCHEMA
                )
            elif isinstance(broker, (OutboxBroker, PostgresBroker)):
                database, default_schema = broker.database, broker.schema
            else:
                raise ActorOptionError(
                    f"Idempotency has no database on a {type(broker).__name__}; pass database=, "
                    "or use dramatiq_reliable.OutboxBroker whose pool it shares"
                )
            self._target = (database, self.schema or default_schema)
        return self._target

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        self.database_for(broker)
        options = actor.options
        mode = options.get("idempotency", self.default_mode)
        if mode not in MODES:
            raise ActorOptionError(f"actor {actor.actor_name!r}: idempotency must be one of {MODES!r}, got {mode!r}")
        key = options.get("idempotency_key")
        if key is not None and not callable(key):
            raise ActorOptionError(
                f"actor {actor.actor_name!r}: idempotency_key must be a callable taking the actor's arguments, "
                f"got {key!r}; write e.g. idempotency_key=lambda order_id: f'invoice-{{order_id}}' "
                "(a fixed string belongs in send_with_options(idempotency_key=...))"
            )
        if mode == "off" and key is not None:
            raise ActorOptionError(
                f"actor {actor.actor_name!r} has idempotency='off' and an idempotency_key; remove one of them"
            )
        if "idempotency_retention_ms" in options:
            _check_retention(
                f"actor {actor.actor_name!r}: idempotency_retention_ms",
                options["idempotency_retention_ms"],
                ActorOptionError,
            )

    def job_for(self, broker: Broker, message: Message[Any] | MessageProxy) -> Job | None:
        """The job ``message`` runs as, or ``None`` when its mode is ``"off"``.

        Raises :class:`IdempotencyKeyError` when the key cannot be computed.
        """
        actor_name = message.actor_name
        actor = broker.get_actor(actor_name)
        mode = self._mode(actor, message)
        if mode == "off":
            if message.options.get("idempotency_key") is not None:
                raise IdempotencyKeyError(
                    f"{_where(message)} has an idempotency_key but idempotency is 'off' for it; drop the key or "
                    "send with idempotency='transactional'"
                )
            return None
        return Job(actor_name, self._key(actor, message), mode, message.message_id)

    def _mode(self, actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy) -> Mode:
        mode = message.options.get("idempotency")
        if mode is None:
            mode = actor.options.get("idempotency", self.default_mode)
        if mode not in MODES:
            raise IdempotencyKeyError(f"{_where(message)} has idempotency={mode!r}; use one of {MODES!r}")
        return cast(Mode, mode)

    @staticmethod
    def _key(actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy) -> str:
        key: object = message.options.get("idempotency_key")
        if key is not None:
            source, fix = "the idempotency_key message option", "send_with_options(idempotency_key='order-42')"
        elif (derive := actor.options.get("idempotency_key")) is not None:
            source = f"the idempotency_key function {getattr(derive, '__qualname__', derive)!r}"
            fix = "return e.g. f'invoice-{order_id}'"
            try:
                key = derive(*message.args, **message.kwargs)
            except Exception as error:
                raise IdempotencyKeyError(
                    f"{_where(message)}: {source} raised {type(error).__name__}: {error}; fix the key function or "
                    "the arguments (the actor did not run)"
                ) from error
        else:
            message_id = str(message.message_id)
            _check_storable(
                message, "message id", message_id, "send it again with a fresh message (Dramatiq's own ids are UUIDs)"
            )
            return message_id
        if not isinstance(key, str) or not key:
            raise IdempotencyKeyError(f"{_where(message)}: {source} gave {key!r}, not a non-empty string; {fix}")
        _check_storable(message, f"the key from {source}", key, "build keys from IDs and plain text")
        if len(key) * 4 > MAX_KEY_BYTES and len(key.encode()) > MAX_KEY_BYTES:  # at most 4 bytes a character
            raise IdempotencyKeyError(
                f"{_where(message)}: the key from {source} is {len(key.encode())} bytes, over {MAX_KEY_BYTES}; "
                "build keys from IDs, or hash long values"
            )
        return key

    def _retention_s(self, actor: dramatiq.Actor[Any, Any]) -> float:
        return int(actor.options.get("idempotency_retention_ms", self.retention_ms)) / 1000

    # -- hooks --------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        try:
            self._before_enqueue(broker, message)
        except MiddlewareError:
            raise
        except Exception as error:
            # Swallowed, it would let a bad option through or a retry into a doomed transaction.
            raise MiddlewareFailed(
                f"Idempotency could not check {_where(message)} before it was enqueued: {type(error).__name__}: "
                f"{_first_line(error)}; the message was not enqueued, report this as a bug"
            ) from error

    def _before_enqueue(self, broker: Broker, message: Message[Any]) -> None:
        running = _current.get()
        if running is not None and running.conn is not None and running.message._exception is not None:
            # The actor (or a later before-hook) raised and the transaction is going to roll back:
            # whatever is sent now (the retry, an on_failure callback) must not be written into it.
            self._end_transaction(running, commit=False)
        if isinstance(threading.current_thread(), ConsumerThread):
            return  # a delay-queue move: checked when it was sent
        if "idempotency_key" in message.options or "idempotency" in message.options:
            try:
                actor = broker.get_actor(message.actor_name)
            except ActorNotFound:
                return
            # Refuse a bad per-message option at send time, where the caller can fix it.
            if self._mode(actor, message) == "off":
                self.job_for(broker, message)
            elif "idempotency_key" in message.options:
                self._key(actor, message)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Check the key before the actor runs; fail closed whatever goes wrong.

        Dramatiq lets only a ``MiddlewareError`` out of a before-hook and runs the actor after
        anything else, unprotected: an unexpected error here becomes :class:`MiddlewareFailed`,
        which the retry middleware retries like a failed job.
        """
        try:
            self._before_process_message(broker, message)
        except MiddlewareError:
            raise
        except Exception as error:
            running = _current.get()
            if running is not None and running.message is message:
                self._finish(running, commit=False)
            raise MiddlewareFailed(
                f"Idempotency could not check {_where(message)}: {type(error).__name__}: {_first_line(error)}; "
                "the actor did not run and the message will be retried"
            ) from error

    def _before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        stale = _current.get()
        if stale is not None:
            logger.error("idempotency state of message %s was never cleaned up; rolling it back", stale.job.message_id)
            self._finish(stale, commit=False)
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return  # the worker reports it
        try:
            job = self.job_for(broker, message)
        except IdempotencyKeyError as error:
            events.emit(IdempotencyKeyInvalid(message.actor_name, message.message_id, str(error)))
            message.fail()
            raise
        if job is None:
            return
        database, schema_name = self.database_for(broker)
        running = _Running(job, message, payload_hash(message.args, message.kwargs), self._retention_s(actor))
        if job.mode == "transactional":
            self._claim(running, database, schema_name)
        else:
            self._check_recorded(running, database, schema_name)
        running.token = _current.set(running)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        running = _current.get()
        if running is None or running.message is not message:
            return
        if exception is not None:
            self._finish(running, commit=False)
            return
        if running.job.mode == "transactional":
            error = self._finish(running, commit=True)
            if error is not None:
                self._commit_failed(broker, message, running, error)
            return
        self._finish(running, commit=False)
        self._record(running)

    # -- a commit that failed -----------------------------------------------------------------

    def _commit_failed(self, broker: Broker, message: MessageProxy, running: _Running, error: BaseException) -> None:
        """Decide the fate of a job that returned but whose transaction did not commit.

        The message is never acked as if the job had succeeded: it is retried, or failed (and
        so dead-lettered); what decides is why the commit failed.
        """
        job = running.job
        unknown = is_connection_failure(error)
        events.emit(IdempotencyCommitFailed(*_ids(running), _first_line(error), "unknown" if unknown else "failed"))
        failure: JobCommitFailed
        if unknown:
            failure = CommitOutcomeUnknown(
                f"actor {job.actor_name!r} returned but the connection broke during its COMMIT: "
                f"{type(error).__name__}: {_first_line(error)}; the outcome is unknown (the writes and key may "
                "have been saved), so the message is retried and its key makes the retry skip if they were"
            )
        elif isinstance(error, _Swallowed):
            failure = JobCommitFailed(
                f"actor {job.actor_name!r} returned but its transaction did not commit: the actor caught a database "
                "error and went on, and Postgres rolled the transaction back; the job's writes and key were not "
                "saved. Let the error propagate (or use a savepoint: with job_connection().transaction(): ...); "
                "replaying the message is safe"
            )
        else:
            failure = JobCommitFailed(
                f"actor {job.actor_name!r} returned but Postgres refused its COMMIT: {type(error).__name__}: "
                f"{_first_line(error)}; the job's writes and key were not saved. If the actor does not write to "
                "Postgres use idempotency='record' (a long job holding an idle transaction meets "
                "idle_in_transaction_session_timeout); replaying the message is safe"
            )
        failure.__cause__ = error
        message.stuff_exception(failure)
        if unknown:
            self._retry_unknown_outcome(broker, message, failure)
            return
        retries = next((m for m in broker.middleware if isinstance(m, ClassifiedRetries)), None)
        if retries is None or isinstance(error, _Swallowed):
            message.fail()
            return
        # The commit failed for a reason of its own (a serialization failure, a deferred
        # constraint): the classifier decides as if the actor had raised it, so a serialization
        # failure is retried within the budget and a constraint violation is dead-lettered.
        retries.after_process_message(broker, message, exception=failure)

    def _retry_unknown_outcome(self, broker: Broker, message: MessageProxy, failure: JobCommitFailed) -> None:
        """Send the message again: the key makes the retry safe whether or not the commit landed.

        Through ``broker.enqueue``, as every retry: on an ``OutboxBroker`` the retry is an
        outbox row (written on a fresh connection, trying for ``worker_write_timeout_ms``), so the
        message is acked only once the retry is durable in Postgres, and failed (kept in
        ``.XQ`` and dead-lettered) if it could not be written; on a ``RabbitmqBroker`` it is
        published to the delay queue before the ack.  Counted apart from ``retries``.
        """
        options = message.options
        done = options.get(UNKNOWN_OUTCOME_RETRIES_KEY, 0)
        done = done if isinstance(done, int) and not isinstance(done, bool) and done >= 0 else 0
        retries = options.get("retries", 0)
        attempt = retries + 1 if isinstance(retries, int) and not isinstance(retries, bool) else 1
        decision = Decision(
            retry=True,
            category="transient",
            reason="commit_outcome_unknown",
            error_type=type_name(type(failure)),
            matched_type=type_name(type(failure.__cause__ or failure)),
        )
        if done >= self.unknown_outcome_retries:
            self._give_up_unknown(message, decision, attempt)
            return
        delay = 0
        if not delays_disabled():
            delay = backoff_ms(
                done + 1,
                min_backoff=self.unknown_outcome_backoff_ms,
                max_backoff=_MAX_UNKNOWN_OUTCOME_BACKOFF_MS,
                jitter="proportional",
            )
        decision = dataclasses.replace(decision, delay_ms=delay)
        options[UNKNOWN_OUTCOME_RETRIES_KEY] = done + 1
        options[RETRY_DECISION_KEY] = decision_record(decision, "retry", attempt, None)
        try:
            broker.enqueue(cast("Message[Any]", message), delay=delay)
        except Exception:
            logger.exception(
                "could not schedule the retry of message %s after a commit with an unknown outcome; failing it so "
                "it is kept in the dead letters",
                message.message_id,
            )
            self._give_up_unknown(message, dataclasses.replace(decision, delay_ms=None), attempt)
            return
        events.emit(retry_event(RetryScheduled, message, decision, "retry", attempt))

    def _give_up_unknown(self, message: MessageProxy, decision: Decision, attempt: int) -> None:
        decision = dataclasses.replace(decision, retry=False)
        message.options[RETRY_DECISION_KEY] = decision_record(decision, "outcome_unknown", attempt, None)
        message.fail()
        events.emit(retry_event(RetryGaveUp, message, decision, "outcome_unknown", attempt))

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        running = _current.get()
        if running is not None and running.message is message:
            self._finish(running, commit=False)

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        mine = broker.middleware.index(self) if self in broker.middleware else -1
        earlier = [type(m).__name__ for m in broker.middleware[:mine] if isinstance(m, Callbacks | Pipelines)]
        if earlier:
            # Their after-hooks would then run after the commit: a crash in between loses the
            # pipeline's next step or the callback, because the redelivery is skipped as a duplicate.
            logger.warning(
                "Idempotency comes after %s in the middleware list, so their messages are sent after the job "
                "commits and a crash in between loses them; add it with before=Callbacks",
                " and ".join(earlier),
            )

    def after_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the pool this middleware created from ``database=`` (not a shared one)."""
        if self._own_database is not None:
            self._own_database.close()

    # -- transactional mode -------------------------------------------------------------------

    def _claim(self, running: _Running, database: Database, schema_name: str) -> None:
        job = running.job
        deadline = time.monotonic() + self._timeout_s(database)
        pause = _FIRST_PAUSE_S
        while True:
            try:
                stored = self._claim_once(running, database, schema_name, deadline)
                break
            except (psycopg.Error, PoolTimeout, SchemaNotReady) as error:
                self._end_transaction(running, commit=False)
                # The claim is the transaction's first statement: on a fresh connection it can
                # simply run again.  A pool keeps the sockets a Postgres restart or a network
                # cut reset; each such one fails fast and is discarded on return.
                if is_connection_failure(error) and time.monotonic() + pause < deadline:
                    logger.info(
                        "idempotency check of message %s failed on a broken connection (%s); trying a fresh one",
                        job.message_id,
                        _first_line(error),
                    )
                    time.sleep(pause)
                    pause = min(pause * 2, _MAX_PAUSE_S)
                    continue
                # Fail closed: only a MiddlewareError keeps the actor from running.
                self._unavailable(job, error, schema_name)
            except BaseException:  # a bug (made a MiddlewareError by the hook) or an interrupt
                self._end_transaction(running, commit=False)
                raise
        if stored is not None:
            self._end_transaction(running, commit=False)
            self._seen(running, stored)

    def _claim_once(self, running: _Running, database: Database, schema_name: str, deadline: float) -> Any:
        """Borrow a connection, begin, claim the key; the stored row of a duplicate, else ``None``."""
        job = running.job
        params = _key_params(running)
        claim, lookup = _sql.query("idempotency_claim", schema_name), _sql.query("idempotency_lookup", schema_name)
        conn = self._borrow(database, deadline)
        running.conn, running.pool = conn, database.pool
        if conn.autocommit:
            # A shared app pool may hand out autocommit connections: the key and the job's
            # writes would then commit one by one, and a failed job would leave its key
            # behind (its retry skipped as a duplicate).  Run this job in a transaction.
            conn.autocommit = False
            running.restore_autocommit = True
        if not self._schema_ready:
            self._check_schema(conn, schema_name)
        # The key is the transaction's first statement: one round trip on the common path.
        # Only a conflict reads the stored row, in a second statement that sees the commit
        # it may have waited for; a key purged in between is simply claimed again.
        for _attempt in range(3):
            if _sql.tuples(conn).execute(claim, params).fetchone() is not None:
                break
            stored = _sql.tuples(conn).execute(lookup, params).fetchone()
            if stored is not None:
                return stored
        else:
            raise RuntimeError(f"key {job.key!r} was neither claimable nor readable three times in a row")
        # Bound for send(): the actor's messages go to the outbox inside this transaction.
        binding = bind(conn)
        binding.__enter__()
        running.binding = binding
        return None

    def _timeout_s(self, database: Database) -> float:
        if self.connection_timeout_ms is not None:
            return self.connection_timeout_ms / 1000
        return float(database.pool.timeout)

    def _borrow(self, database: Database, deadline: float) -> psycopg.Connection[Any]:
        """A pooled connection; getconn/putconn span two hooks, where a ``with`` block cannot."""
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        if not self._pool_open:
            with database.connection(timeout_ms=remaining_ms):
                pass  # opens a pool the Database created lazily
            self._pool_open = True
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        conn: psycopg.Connection[Any] = database.pool.getconn(timeout=remaining_ms / 1000)
        return conn

    def _on_fresh_connections(self, database: Database, work: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """``work(conn)`` on a pooled connection, again on a fresh one after a connection-class
        error, until ``connection_timeout_ms`` has passed; then the last error is raised."""
        deadline = time.monotonic() + self._timeout_s(database)
        pause = _FIRST_PAUSE_S
        while True:
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                with database.connection(timeout_ms=remaining_ms) as conn, _autocommit(conn):
                    return work(conn)
            except psycopg.Error as error:
                if not is_connection_failure(error) or time.monotonic() + pause >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)

    def _end_transaction(self, running: _Running, *, commit: bool) -> BaseException | None:
        """Commit or roll back, unbind and return the connection; the error of a failed commit."""
        conn, pool, binding = running.conn, running.pool, running.binding
        restore_autocommit, running.restore_autocommit = running.restore_autocommit, False
        running.conn = running.pool = running.binding = None
        if conn is None or pool is None:
            return None
        failure: BaseException | None = None
        try:
            if commit and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                # The actor swallowed a database error: COMMIT would quietly roll back.
                failure = _Swallowed("the job's transaction was aborted by an earlier statement the actor caught")
                conn.rollback()
            elif commit:
                conn.commit()
            else:
                conn.rollback()
        except Exception as error:
            failure = error
            with contextlib.suppress(Exception):
                conn.rollback()
        try:
            if binding is not None:
                binding.__exit__(None, None, None)
        except Exception:  # a context mix-up must not keep the connection from the pool
            logger.exception("could not unbind the job connection of message %s", running.job.message_id)
        if restore_autocommit and not conn.closed and not conn.broken:
            with contextlib.suppress(Exception):
                conn.autocommit = True
        try:
            pool.putconn(conn)
        except Exception:  # a pool closed under us; never let this escape a before-hook
            logger.exception("could not return the job connection of message %s", running.job.message_id)
        return failure if commit else None

    def _check_schema(self, conn: psycopg.Connection[Any], schema_name: str) -> None:
        with self._lock:
            if not self._schema_ready:
                ensure_ready(conn, schema=schema_name, required=IDEMPOTENCY_VERSION, feature="idempotency")
                self._schema_ready = True

    # -- record mode --------------------------------------------------------------------------

    def _check_recorded(self, running: _Running, database: Database, schema_name: str) -> None:
        job = running.job
        lookup = _sql.query("idempotency_lookup", schema_name)

        def check(conn: psycopg.Connection[Any]) -> Any:
            if not self._schema_ready:
                self._check_schema(conn, schema_name)
            return _sql.tuples(conn).execute(lookup, _key_params(running)).fetchone()

        try:
            # Autocommit: one round trip, no BEGIN/COMMIT.
            stored = self._on_fresh_connections(database, check)
        except (psycopg.Error, PoolTimeout, SchemaNotReady) as error:
            self._unavailable(job, error, schema_name)
        if stored is not None:
            self._seen(running, stored)

    def _record(self, running: _Running) -> None:
        job = running.job
        assert self._target is not None
        database, schema_name = self._target
        claim = _sql.query("idempotency_claim", schema_name)
        try:
            # Autocommit, one key per statement.  Group commit (the threads' keys in one
            # multi-row INSERT, each thread waiting for the commit) halved the WAL flushes but
            # was measured no faster: a worker thread waiting on a condition costs about what the
            # round trip it saved did.  An autocommit INSERT whose reply was lost and is sent
            # again finds its own row: the second run returns no row, which is harmless here.
            recorded = self._on_fresh_connections(
                database, lambda conn: _sql.tuples(conn).execute(claim, _key_params(running)).fetchone()
            )
        except Exception as error:
            # The effect happened: failing the message now would dead-letter (and a replay
            # repeat) work that succeeded.  Acked without its key, a duplicate would run again.
            events.emit(IdempotencyRecordFailed(*_ids(running), _first_line(error)))
            return
        if recorded is None:
            logger.warning(
                "record mode: key %r of actor %r was recorded by another run while message %s ran; the effect "
                "may have happened twice (record mode does not serialise concurrent duplicates)",
                job.key,
                job.actor_name,
                job.message_id,
            )

    # -- outcomes -----------------------------------------------------------------------------

    def _seen(self, running: _Running, stored: Any) -> NoReturn:
        """The key ran already: skip a duplicate, fail a conflicting reuse.  Always raises."""
        job = running.job
        stored_hash, first_message_id = bytes(stored[0]), str(stored[1])
        if stored_hash != running.payload_hash:
            events.emit(IdempotencyKeyReused(job.actor_name, job.message_id, job.key, first_message_id))
            running.message.fail()
            raise IdempotencyConflict(
                f"key {job.key!r} of actor {job.actor_name!r} already ran (message {first_message_id!r}) with "
                f"different arguments than message {job.message_id!r}; the message failed without running. "
                "Make the key cover every argument that changes the effect"
            )
        events.emit(
            IdempotencyDuplicateSkipped(
                actor_name=job.actor_name,
                message_id=job.message_id,
                key=job.key,
                mode=job.mode,
                first_message_id=first_message_id,
                queue_name=running.message.queue_name,
            )
        )
        raise SkipMessage(f"duplicate of message {first_message_id!r} (key {job.key!r})")

    def _unavailable(self, job: Job, error: BaseException, schema_name: str) -> NoReturn:
        """Fail closed: the actor must not run unchecked.  Always raises ``DatabaseUnavailable``."""
        if isinstance(error, psycopg.errors.UndefinedTable | SchemaNotReady):
            self._schema_ready = False
        detail = _first_line(error)
        if isinstance(error, psycopg.errors.UndefinedTable):
            detail = f"{detail} (run 'dramatiq-reliable migrate')"
        events.emit(
            IdempotencyUnavailable(job.actor_name, job.message_id, job.mode, f"{type(error).__name__}: {detail}")
        )
        raise DatabaseUnavailable(
            f"cannot check idempotency key {job.key!r} of actor {job.actor_name!r} in schema {schema_name!r}: "
            f"{type(error).__name__}: {detail}; the actor did not run and the message will be retried"
        ) from error

    def _finish(self, running: _Running, *, commit: bool) -> BaseException | None:
        """End the job: transaction, binding, connection and context variable."""
        try:
            return self._end_transaction(running, commit=commit)
        finally:
            if running.token is not None:
                try:
                    _current.reset(running.token)
                except ValueError:  # set in another context: never leave it behind
                    _current.set(None)
                running.token = None
            elif _current.get() is running:
                _current.set(None)


# -- retention ----------------------------------------------------------------------------------


def purge_expired(database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA, batch_size: int = 5000) -> int:
    """Delete expired keys in batches of ``batch_size``; return how many were deleted.

    Each batch is its own short transaction, so a large backlog never holds long locks.  The
    ``dramatiq-reliable idempotency purge`` command and :func:`make_purge_actor` call this.
    """
    schema_name = _sql.validate_schema(schema)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
    database = Database.of(database)
    started = time.perf_counter()
    total = 0
    with database.connection() as conn:
        ensure_ready(conn, schema=schema_name, required=IDEMPOTENCY_VERSION, feature="idempotency")
        conn.rollback()
        with _autocommit(conn):
            while True:
                deleted = conn.execute(
                    _sql.query("idempotency_purge", schema_name), {"batch_size": batch_size}
                ).rowcount
                total += deleted
                if deleted < batch_size:
                    break
    events.emit(IdempotencyKeysPurged(total, schema_name, (time.perf_counter() - started) * 1000))
    return total


def make_purge_actor(
    broker: Broker,
    *,
    database: DatabaseLike | None = None,
    schema: str | None = None,
    batch_size: int = 5000,
    actor_name: str = "dramatiq_reliable_purge_idempotency_keys",
    queue_name: str = "dramatiq_reliable",
    **actor_options: Any,
) -> dramatiq.Actor[[], int]:
    """Declare on ``broker`` an actor that purges expired keys, for your scheduler to send.

    The database and schema default to those of the broker's ``Idempotency`` middleware (or of
    the ``OutboxBroker``).  The actor itself runs with ``idempotency="off"``.

    >>> purge = make_purge_actor(broker)                              # doctest: +SKIP
    >>> scheduler.add_job(purge.send, "cron", hour=3)                 # doctest: +SKIP
    """
    if database is None:
        middleware = next((m for m in broker.middleware if isinstance(m, Idempotency)), None)
        if middleware is not None:
            database, default_schema = middleware.database_for(broker)
        elif isinstance(broker, (OutboxBroker, PostgresBroker)):
            database, default_schema = broker.database, broker.schema
        else:
            raise ConfigurationError(
                f"make_purge_actor() found no database on a {type(broker).__name__}; pass database='postgresql://...'"
            )
    else:
        database = Database.of(database)
        default_schema = broker.schema if isinstance(broker, (OutboxBroker, PostgresBroker)) else _sql.DEFAULT_SCHEMA
    schema_name = _sql.validate_schema(schema or default_schema)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}")
    if "idempotency" in broker.actor_options:
        actor_options.setdefault("idempotency", "off")
    target = database

    def purge_idempotency_keys() -> int:
        return purge_expired(target, schema=schema_name, batch_size=batch_size)

    decorate = dramatiq.actor(actor_name=actor_name, queue_name=queue_name, broker=broker, **actor_options)
    return decorate(purge_idempotency_keys)


# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _autocommit(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """One-statement transactions on a pooled connection: no BEGIN/COMMIT round trips."""
    previous = conn.autocommit
    conn.autocommit = True
    try:
        yield conn
    finally:
        if not conn.closed and not conn.broken:
            conn.autocommit = previous


def _check_retention(what: str, value: object, error: type[ConfigurationError]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{what} must be a positive int of milliseconds, got {value!r}; e.g. 7 days is 604_800_000")


def _check_storable(message: Message[Any] | MessageProxy, what: str, value: str, fix: str) -> None:
    """Refuse text Postgres cannot store (a NUL, a lone surrogate) before any statement is sent.

    Sent anyway, it would fail the claim with an error that looks like an outage, and the
    message would be retried until its budget ran out.
    """
    problem = None
    if "\x00" in value:
        problem = "contains a NUL character"
    else:
        try:
            value.encode()
        except UnicodeEncodeError:
            problem = "contains a lone surrogate"
    if problem is not None:
        raise IdempotencyKeyError(
            f"{_where(message)}: {what} {value!r} {problem}, which Postgres text cannot store; {fix} "
            "(the actor did not run)"
        )


def _where(message: Message[Any] | MessageProxy) -> str:
    """The message an error is about; built only once there is an error."""
    return f"message {message.message_id!r} for actor {message.actor_name!r}"


def _key_params(running: _Running) -> dict[str, Any]:
    job = running.job
    return {
        "actor_name": job.actor_name,
        "job_key": job.key,
        "payload_hash": running.payload_hash,
        "message_id": job.message_id,
        "retention_s": running.retention_s,
    }


def _ids(running: _Running) -> tuple[str, str, str]:
    return running.job.actor_name, running.job.message_id, running.job.key
