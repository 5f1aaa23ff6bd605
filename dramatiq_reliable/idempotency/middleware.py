"""The Idempotency middleware: check the key before the actor runs, commit it with the job's writes."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, NoReturn, cast

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Callbacks, Middleware, MiddlewareError, Pipelines, SkipMessage
from dramatiq.worker import ConsumerThread
from psycopg_pool import PoolTimeout

from .. import _sql, events
from .._checks import check_choice, check_int, check_ms
from .._util import first_line as _first_line
from .._util import type_name
from ..backing import backing_of
from ..binding import bind
from ..classify import Decision, backoff_ms, is_connection_failure
from ..database import Database, DatabaseLike
from ..errors import (
    ActorOptionError,
    CommitOutcomeUnknown,
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyConflict,
    IdempotencyKeyError,
    JobCommitFailed,
    MiddlewareFailed,
    SchemaNotReady,
)
from ..retries import (
    RETRY_DECISION_KEY,
    ClassifiedRetries,
    RetryGaveUp,
    RetryScheduled,
    decision_record,
    delays_disabled,
    retry_event,
)
from ..schema import IDEMPOTENCY_VERSION, ensure_ready
from .context import (
    MODES,
    InTransaction,
    Job,
    JobConnections,
    Mode,
    PooledJobConnections,
    Running,
    current_running,
    pending_in_transaction,
)
from .events import (
    IdempotencyCommitFailed,
    IdempotencyDuplicateSkipped,
    IdempotencyKeyInvalid,
    IdempotencyKeyReused,
    IdempotencyRecordFailed,
    IdempotencyUnavailable,
)
from .keys import MAX_KEY_BYTES, check_storable, describe_message, payload_hash
from .protocol import IdempotencyStore, StoredKey
from .store import _FIRST_PAUSE_S, _MAX_PAUSE_S, PostgresIdempotencyStore, claim_key, read_key

__all__ = ["Idempotency"]

logger = logging.getLogger("dramatiq_reliable.idempotency")

DEFAULT_RETENTION_MS = 7 * 86_400_000
#: Retries of a job whose COMMIT had an unknown outcome, apart from its ``max_retries``.
DEFAULT_UNKNOWN_OUTCOME_RETRIES = 10
#: The first of those retries waits this long, doubling (with jitter) up to a minute.
DEFAULT_UNKNOWN_OUTCOME_BACKOFF_MS = 1000
_MAX_UNKNOWN_OUTCOME_BACKOFF_MS = 60_000
#: The message option counting those retries.
UNKNOWN_OUTCOME_RETRIES_KEY = "unknown_outcome_retries"
_RETENTION_FIX = "e.g. 7 days is 604_800_000"
_OPTIONS = frozenset({"idempotency", "idempotency_key", "idempotency_retention_ms"})


class _Swallowed(psycopg.errors.InFailedSqlTransaction):
    """The actor caught a database error inside the job's transaction, so it cannot commit."""


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
      default_mode: the mode of actors that do not choose one; default ``"transactional"``, or
        ``"record"`` with ``store=``.
      store: an :class:`~.protocol.IdempotencyStore` to keep record-mode keys in instead of
        Postgres, e.g. ``testing.InMemoryIdempotencyStore()`` to unit test actors under
        ``StubBroker``.  Transactional mode is then refused (``ConfigurationError`` here,
        ``ActorOptionError`` on an actor, ``IdempotencyKeyError`` on a message): it needs the
        job's own Postgres transaction.
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
      job_connections: where a transactional job's connection comes from
        (:class:`~.context.JobConnections`); default a connection of the pool per job.
        ``dramatiq_reliable.django`` passes Django's connection of the worker thread, so the
        ORM's writes are the job's.

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
        default_mode: Mode | None = None,
        retention_ms: int = DEFAULT_RETENTION_MS,
        connection_timeout_ms: int | None = None,
        unknown_outcome_retries: int = DEFAULT_UNKNOWN_OUTCOME_RETRIES,
        unknown_outcome_backoff_ms: int = DEFAULT_UNKNOWN_OUTCOME_BACKOFF_MS,
        store: IdempotencyStore | None = None,
        job_connections: JobConnections | None = None,
    ) -> None:
        if job_connections is not None and not isinstance(job_connections, JobConnections):
            raise ConfigurationError(
                f"job_connections must have acquire() and release() (see JobConnections), got "
                f"{type(job_connections).__name__!r}; omit it to use the pool"
            )
        if store is not None and (database is not None or schema is not None):
            raise ConfigurationError("pass store= or database=/schema= to Idempotency, not both")
        if store is not None and default_mode == "transactional":
            raise ConfigurationError(
                "transactional idempotency needs the job's Postgres transaction, which a store= cannot give; "
                "use default_mode='record' (the default with store=) in unit tests"
            )
        if default_mode is None:
            default_mode = "transactional" if store is None else "record"
        check_choice("default_mode", default_mode, MODES)
        check_ms("retention_ms", retention_ms, minimum=1, fix=_RETENTION_FIX)
        check_ms("connection_timeout_ms", connection_timeout_ms, minimum=1, allow_none=True, fix="e.g. 10000")
        check_int(
            "unknown_outcome_retries",
            unknown_outcome_retries,
            minimum=0,
            maximum=1000,
            fix="0 dead-letters a commit whose outcome is unknown at once",
        )
        check_ms(
            "unknown_outcome_backoff_ms",
            unknown_outcome_backoff_ms,
            minimum=1,
            maximum=_MAX_UNKNOWN_OUTCOME_BACKOFF_MS,
            fix="e.g. 1000",
        )
        self.connection_timeout_ms = connection_timeout_ms
        self.unknown_outcome_retries = unknown_outcome_retries
        self.unknown_outcome_backoff_ms = unknown_outcome_backoff_ms
        self.schema: str | None = None if schema is None else _sql.validate_schema(schema)
        self.default_mode: Mode = default_mode
        self.retention_ms = retention_ms
        self.store: IdempotencyStore | None = store
        self._own_database = Database.of(database) if database is not None else None
        self._record_store: IdempotencyStore | None = None
        self._target: tuple[Database, str] | None = None
        self._schema_ready = False
        self.job_connections: JobConnections = job_connections or PooledJobConnections()
        self._lock = threading.Lock()

    @property
    def actor_options(self) -> set[str]:
        return set(_OPTIONS)

    # -- configuration ------------------------------------------------------------------------

    def database_for(self, broker: Broker) -> tuple[Database, str]:
        """The database and schema the keys of ``broker``'s jobs live in."""
        if self._target is None:
            backing = backing_of(
                broker, needed_by="Idempotency", database=self._own_database, schema=self.schema, error=ActorOptionError
            )
            self._target = (backing.database, backing.schema)
        return self._target

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        if self.store is None:
            self.database_for(broker)
        options = actor.options
        mode = options.get("idempotency", self.default_mode)
        if mode not in MODES:
            raise ActorOptionError(f"actor {actor.actor_name!r}: idempotency must be one of {MODES!r}, got {mode!r}")
        if mode == "transactional" and self.store is not None:
            raise ActorOptionError(
                f"actor {actor.actor_name!r} has idempotency='transactional', which needs a Postgres transaction "
                "that Idempotency(store=...) cannot give; use idempotency='record' in unit tests"
            )
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
            check_ms(
                f"actor {actor.actor_name!r}: idempotency_retention_ms",
                options["idempotency_retention_ms"],
                minimum=1,
                fix=_RETENTION_FIX,
                error=ActorOptionError,
            )

    def job_for(self, broker: Broker, message: Message[Any] | MessageProxy) -> Job | None:
        """The job ``message`` runs as, or ``None`` when its mode is ``"off"``.

        Raises :class:`IdempotencyKeyError` when the key cannot be computed.
        """
        return self._job(broker.get_actor(message.actor_name), message)

    def _job(self, actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy) -> Job | None:
        mode = self._mode(actor, message)
        if mode == "off":
            if message.options.get("idempotency_key") is not None:
                raise IdempotencyKeyError(
                    f"{describe_message(message)} has an idempotency_key but idempotency is 'off' for it; drop the key or "
                    "send with idempotency='transactional'"
                )
            return None
        return Job(actor.actor_name, self._key(actor, message), mode, message.message_id)

    def _mode(self, actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy) -> Mode:
        mode = message.options.get("idempotency")
        if mode is None:
            mode = actor.options.get("idempotency", self.default_mode)
        if mode not in MODES:
            raise IdempotencyKeyError(f"{describe_message(message)} has idempotency={mode!r}; use one of {MODES!r}")
        if mode == "transactional" and self.store is not None:
            raise IdempotencyKeyError(
                f"{describe_message(message)} asks for idempotency='transactional', which Idempotency(store=...) "
                "cannot give; send with idempotency='record'"
            )
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
                    f"{describe_message(message)}: {source} raised {type(error).__name__}: {error}; fix the key function or "
                    "the arguments (the actor did not run)"
                ) from error
        else:
            message_id = str(message.message_id)
            check_storable(
                message, "message id", message_id, "send it again with a fresh message (Dramatiq's own ids are UUIDs)"
            )
            return message_id
        if not isinstance(key, str) or not key:
            raise IdempotencyKeyError(
                f"{describe_message(message)}: {source} gave {key!r}, not a non-empty string; {fix}"
            )
        check_storable(message, f"the key from {source}", key, "build keys from IDs and plain text")
        if len(key) * 4 > MAX_KEY_BYTES and len(key.encode()) > MAX_KEY_BYTES:  # at most 4 bytes a character
            raise IdempotencyKeyError(
                f"{describe_message(message)}: the key from {source} is {len(key.encode())} bytes, over {MAX_KEY_BYTES}; "
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
                f"Idempotency could not check {describe_message(message)} before it was enqueued: {type(error).__name__}: "
                f"{_first_line(error)}; the message was not enqueued, report this as a bug"
            ) from error

    def _before_enqueue(self, broker: Broker, message: Message[Any]) -> None:
        running = current_running.get()
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
            running = current_running.get()
            if running is not None and running.message is message:
                self._finish(running, commit=False)
            raise MiddlewareFailed(
                f"Idempotency could not check {describe_message(message)}: {type(error).__name__}: {_first_line(error)}; "
                "the actor did not run and the message will be retried"
            ) from error

    def _before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        # Taken first, whatever happens next: a request never outlives the message it was made for.
        in_transaction = pending_in_transaction.get()
        if in_transaction is not None:
            pending_in_transaction.set(None)
        stale = current_running.get()
        if stale is not None:
            logger.error("idempotency state of message %s was never cleaned up; rolling it back", stale.job.message_id)
            self._finish(stale, commit=False)
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return  # the worker reports it
        try:
            job = self._job(actor, message)
        except IdempotencyKeyError as error:
            events.emit(IdempotencyKeyInvalid(message.actor_name, message.message_id, str(error)))
            message.fail()
            raise
        if job is None or job.mode != "transactional":
            if in_transaction is not None:
                # Fail closed: the middleware that asked relies on it to run at all.
                raise MiddlewareFailed(
                    f"{describe_message(message)} was expected to run in a job transaction, but its idempotency "
                    f"mode is {'off' if job is None else job.mode!r}; the actor did not run, report this as a bug"
                )
            if job is None:
                return
        running = Running(job, message, payload_hash(message.args, message.kwargs), self._retention_s(actor))
        if job.mode == "transactional":
            database, schema_name = self.database_for(broker)
            running.schema = schema_name
            self._claim(running, database, schema_name)
        else:
            running.store = self.record_store(broker)
            running.schema = getattr(running.store, "schema", None)
            self._check_recorded(running, running.store)
        running.token = current_running.set(running)
        if in_transaction is not None:
            self._run_in_transaction(running, in_transaction)

    def _run_in_transaction(self, running: Running, in_transaction: InTransaction) -> None:
        """Run another middleware's first statements in the job's transaction (a singleton's key).

        When it returns a settling step, the transaction is rolled back and its connection given
        back first: the step's own sends then commit on their own, never with the rolled-back work.
        """
        try:
            if running.conn is None:  # never so after a claim; fail closed all the same
                raise MiddlewareFailed(f"{describe_message(running.message)} has no job transaction to run in")
            then = in_transaction(running.conn)
        except BaseException:
            self._finish(running, commit=False)
            raise
        if then is not None:
            self._finish(running, commit=False)
            then()

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        running = current_running.get()
        if running is None or running.message is not message:
            return
        if exception is not None or message.failed:
            # Failed without raising (by a later after-hook, such as Batches when it could not
            # write what the job owes it): the message goes to the dead letters, and its replay
            # must run, not be skipped by a key.
            self._finish(running, commit=False)
            return
        if running.job.mode == "transactional":
            error = self._finish(running, commit=True)
            if error is not None:
                self._commit_failed(broker, message, running, error)
            return
        self._finish(running, commit=False)
        if running.store is not None:
            self._record(running, running.store)

    # -- a commit that failed -----------------------------------------------------------------

    def _commit_failed(self, broker: Broker, message: MessageProxy, running: Running, error: BaseException) -> None:
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
        running = current_running.get()
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

    def _claim(self, running: Running, database: Database, schema_name: str) -> None:
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
                self._unavailable(job, error, f"schema {schema_name!r}")
            except BaseException:  # a bug (made a MiddlewareError by the hook) or an interrupt
                self._end_transaction(running, commit=False)
                raise
        if stored is not None:
            self._end_transaction(running, commit=False)
            self._seen(running, stored)

    def _claim_once(self, running: Running, database: Database, schema_name: str, deadline: float) -> Any:
        """Borrow a connection, begin, claim the key; the stored row of a duplicate, else ``None``."""
        job = running.job
        params = _key_params(running)
        remaining_s = max(0.001, deadline - time.monotonic())
        conn = self.job_connections.acquire(database, remaining_s)
        release = self.job_connections.release
        running.conn = conn
        running.release = lambda conn, committed: release(conn, database=database, committed=committed)
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
            if claim_key(conn, schema_name, params):
                break
            stored = read_key(conn, schema_name, params)
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

    def _end_transaction(self, running: Running, *, commit: bool) -> BaseException | None:
        """Commit or roll back, unbind and return the connection; the error of a failed commit."""
        conn, release, binding = running.conn, running.release, running.binding
        with_commit, running.with_commit = running.with_commit, []
        restore_autocommit, running.restore_autocommit = running.restore_autocommit, False
        running.conn = running.release = running.binding = None
        if conn is None or release is None:
            return None
        failure: BaseException | None = None
        try:
            if commit and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                # The actor swallowed a database error: COMMIT would quietly roll back.
                failure = _Swallowed("the job's transaction was aborted by an earlier statement the actor caught")
                conn.rollback()
            elif commit and with_commit:
                # The statements and the COMMIT as one simple query: one round trip, not one each.
                psycopg.ClientCursor(conn).execute(b";\n".join([*with_commit, b"COMMIT"]))
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
            release(conn, commit and failure is None)
        except Exception:  # a pool closed under us; never let this escape a before-hook
            logger.exception("could not return the job connection of message %s", running.job.message_id)
        return failure if commit else None

    def _check_schema(self, conn: psycopg.Connection[Any], schema_name: str) -> None:
        with self._lock:
            if not self._schema_ready:
                ensure_ready(conn, schema=schema_name, required=IDEMPOTENCY_VERSION, feature="idempotency")
                self._schema_ready = True

    # -- record mode --------------------------------------------------------------------------

    def record_store(self, broker: Broker) -> IdempotencyStore:
        """Where record-mode keys go: ``store=``, else a store on the broker's (or ``database=``'s) Postgres."""
        if self.store is not None:
            return self.store
        if self._record_store is None:
            database, schema_name = self.database_for(broker)
            with self._lock:
                if self._record_store is None:
                    self._record_store = PostgresIdempotencyStore(
                        database=database, schema=schema_name, connection_timeout_ms=self.connection_timeout_ms
                    )
        return self._record_store

    def _check_recorded(self, running: Running, store: IdempotencyStore) -> None:
        job = running.job
        try:
            stored = store.lookup(actor_name=job.actor_name, key=job.key)
        except Exception as error:
            self._unavailable(job, error, _describe_store(store))
        if stored is not None:
            self._seen(running, stored)

    def _record(self, running: Running, store: IdempotencyStore) -> None:
        job = running.job
        try:
            inserted = store.record(
                actor_name=job.actor_name,
                key=job.key,
                payload_hash=running.payload_hash,
                message_id=job.message_id,
                retention_s=running.retention_s,
            )
        except Exception as error:
            # The effect happened: failing the message now would dead-letter (and a replay
            # repeat) work that succeeded.  Acked without its key, a duplicate would run again.
            events.emit(IdempotencyRecordFailed(*_ids(running), _first_line(error)))
            return
        if not inserted:
            logger.warning(
                "record mode: key %r of actor %r was recorded by another run while message %s ran; the effect "
                "may have happened twice (record mode does not serialise concurrent duplicates)",
                job.key,
                job.actor_name,
                job.message_id,
            )

    # -- outcomes -----------------------------------------------------------------------------

    def _seen(self, running: Running, stored: StoredKey) -> NoReturn:
        """The key ran already: skip a duplicate, fail a conflicting reuse.  Always raises."""
        job = running.job
        stored_hash, first_message_id = stored.payload_hash, stored.first_message_id
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

    def _unavailable(self, job: Job, error: BaseException, where: str) -> NoReturn:
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
            f"cannot check idempotency key {job.key!r} of actor {job.actor_name!r} in {where}: "
            f"{type(error).__name__}: {detail}; the actor did not run and the message will be retried"
        ) from error

    def _finish(self, running: Running, *, commit: bool) -> BaseException | None:
        """End the job: transaction, binding, connection and context variable."""
        try:
            return self._end_transaction(running, commit=commit)
        finally:
            if running.token is not None:
                try:
                    current_running.reset(running.token)
                except ValueError:  # set in another context: never leave it behind
                    current_running.set(None)
                running.token = None
            elif current_running.get() is running:
                current_running.set(None)


def _key_params(running: Running) -> dict[str, Any]:
    job = running.job
    return {
        "actor_name": job.actor_name,
        "job_key": job.key,
        "payload_hash": running.payload_hash,
        "message_id": job.message_id,
        "retention_s": running.retention_s,
    }


def _describe_store(store: IdempotencyStore) -> str:
    describe = getattr(store, "describe", None)
    return str(describe()) if callable(describe) else type(store).__name__


def _ids(running: Running) -> tuple[str, str, str]:
    return running.job.actor_name, running.job.message_id, running.job.key
