"""The RateLimits middleware: an actor's jobs wait for a token of their key, and a 429 pauses the key.

Before a limited job runs it takes a token of its key in Postgres (:mod:`.rate_limit`).  No
token: the job is postponed, not failed and not counted as a retry, to the token it reserved,
and the worker thread moves on at once.  The postponed copy is written before the delivery is
acked: on a ``PostgresBroker`` both are one statement (the held row takes its new eta), on an
``OutboxBroker`` the copy is an outbox row and a crash before the ack runs the job twice, never
zero times.  When a limited job fails with HTTP 429 (or 503 with ``Retry-After``), its key is
paused for every worker until the provider's ``Retry-After``; the failed message itself is left
to ``ClassifiedRetries``, which honours the same header.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, cast

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, SkipMessage

from .. import _sql, events
from .._checks import check_ms, is_int
from .._util import first_line
from ..backing import backing_of
from ..classify import DEFAULT_MAX_RETRY_AFTER_MS, exception_chain, http_status_of, retry_after_ms_of
from ..database import Database, DatabaseLike
from ..errors import ActorOptionError, DatabaseUnavailable, IdempotencyKeyError, MiddlewareFailed, SchemaNotReady
from ..idempotency.middleware import Idempotency
from ..schema import RATE_LIMITS_VERSION, ensure_ready
from .rate_limit import MAX_KEY_CHARS, RateLimit, Registry, Take, pause, slot_ahead, take

__all__ = ["RateLimitPaused", "RateLimitPostponed", "RateLimits"]

logger = logging.getLogger("dramatiq_reliable.rate_limits")

#: The message option holding the token a postponed job reserved: ``{"key": ..., "at_ms": ...}``.
SLOT_KEY = "rate_limit_slot"
#: The message option counting postponements: kept apart from ``retries`` (and ``max_retries``).
POSTPONED_KEY = "rate_limit_postponed"
#: The message option marking a job that came back too late for its token once (see ``_reserved``).
LATE_KEY = "rate_limit_late"
#: How late after its slot a job back with a reserved token may still call (at least one step
#: of its limit): later, it would call together with the jobs of the next slots.
_LATE_MS = 10
#: The default of ``hold_ms``: see :class:`RateLimits`.
DEFAULT_HOLD_MS = 200


@dataclasses.dataclass(frozen=True)
class RateLimitPostponed(events.Event):
    """A job found no token of its key and waits ``delay_ms`` for the one it reserved
    (``paused``: its key is paused by a provider's 429)."""

    name = "rate_limit.postponed"
    level = logging.DEBUG
    actor_name: str
    message_id: str
    key: str
    delay_ms: int
    paused: bool


@dataclasses.dataclass(frozen=True)
class RateLimitPaused(events.Event):
    """A job of ``key`` failed with ``status``: every worker leaves the key alone for ``pause_ms``."""

    name = "rate_limit.paused"
    level = logging.WARNING
    actor_name: str
    message_id: str
    key: str
    status: int
    pause_ms: int


class RateLimits(Middleware):
    """Jobs of a rate-limited key run no faster than its limit across every worker, and pause on a 429.

    Actor option ``rate_limit``: a limiter's name (``rate_limit="stripe"``: one bucket for the
    actor), or a callable over the actor's arguments returning the name or ``"<name>:<suffix>"``
    (``rate_limit=lambda customer_id, **_: f"stripe:{customer_id}"``: a bucket per customer).  A
    name no :class:`~dramatiq_reliable.flow.RateLimit` declares fails when the actor is declared.
    A key function that raises or returns anything but such a string fails closed: the job does
    not run unprotected, it is failed (dead-lettered) with an error naming the actor.

    Parameters:
      limits: the :class:`~dramatiq_reliable.flow.RateLimit` objects actors may name.
      database, schema: where ``rate_limit_buckets`` lives; omit them with an ``OutboxBroker`` or a
        ``PostgresBroker`` to share theirs.
      max_pause_ms: the longest ``Retry-After`` that pauses a key (default 15 minutes, the
        retries' cap); a longer one pauses it this long.
      hold_ms: a token due within this many ms is waited for in the worker thread (default
        200); a later one postpones the job through the queue to ``hold_ms`` before its token,
        and the thread waits out the rest.  Consumers find a due message only when they poll
        (``worker_timeout``; ``PostgresBroker``'s ``poll_interval_ms``), so without the wait in place calls would start up to a poll late
        and bunch.  ``hold_ms=0`` never holds a thread; calls may then bunch by one poll.

    Postgres unreachable while taking a token fails closed: the actor does not run and
    ``DatabaseUnavailable`` lets the retry middleware retry it.  Put it after ``Singleton`` and
    before ``Idempotency``, so a postponed job never claims its idempotency key:

    >>> broker.add_middleware(RateLimits([RateLimit("stripe", per_second=25)]), before=Idempotency)  # doctest: +SKIP
    """

    def __init__(
        self,
        limits: Iterable[RateLimit] = (),
        *,
        database: DatabaseLike | None = None,
        schema: str | None = None,
        max_pause_ms: int = DEFAULT_MAX_RETRY_AFTER_MS,
        hold_ms: int = DEFAULT_HOLD_MS,
    ) -> None:
        if isinstance(limits, RateLimit):
            limits = [limits]
        self.limits = Registry(limits)
        self.max_pause_ms = check_ms("max_pause_ms", max_pause_ms, minimum=1, fix="e.g. max_pause_ms=900_000")
        self.hold_ms = check_ms("hold_ms", hold_ms, maximum=10_000, fix="e.g. hold_ms=200, or 0 never to wait in place")
        self._own_database = Database.of(database) if database is not None else None
        self._schema = schema
        self._target: tuple[Database, str] | None = None
        self._checked = False

    @property
    def actor_options(self) -> set[str]:
        return {"rate_limit"}

    def database_for(self, broker: Broker) -> tuple[Database, str]:
        """The database and schema of ``broker``'s buckets."""
        if self._target is None:
            backing = backing_of(
                broker, needed_by="RateLimits", database=self._own_database, schema=self._schema, error=ActorOptionError
            )
            self._target = (backing.database, backing.schema)
        return self._target

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        option = actor.options.get("rate_limit")
        if option is None:
            return
        if isinstance(option, str):
            self._limit_of(option, f"actor {actor.actor_name!r}: rate_limit")
        elif not callable(option):
            raise ActorOptionError(
                f"actor {actor.actor_name!r}: rate_limit must be a limiter's name or a callable taking the actor's "
                f"arguments, got {option!r}; write rate_limit='stripe' or rate_limit=lambda customer_id: "
                "f'stripe:{customer_id}'"
            )
        self.database_for(broker)

    def _limit_of(self, key: object, where: str) -> RateLimit:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or "\x00" in key:
            raise ActorOptionError(
                f"{where} gave {key!r}, not a non-empty string of at most {MAX_KEY_CHARS} characters; return "
                "a limiter's name or '<name>:<suffix>' built from IDs"
            )
        limit = self.limits.get(key.split(":", 1)[0])
        if limit is None:
            known = sorted(limit.name for limit in self.limits)
            raise ActorOptionError(
                f"{where} names rate limit {key.split(':', 1)[0]!r}, which RateLimits does not know (it knows "
                f"{known!r}); declare it: RateLimits([RateLimit({key.split(':', 1)[0]!r}, per_second=...)])"
            )
        return limit

    def key_for(
        self, actor: dramatiq.Actor[Any, Any], message: Message[Any] | MessageProxy
    ) -> tuple[RateLimit, str] | None:
        """The limit and key of ``message``, or ``None`` when its actor is not limited.

        Raises :class:`ActorOptionError` when the key function raises or gives no usable key.
        """
        option = actor.options.get("rate_limit")
        if option is None:
            return None
        where = f"actor {message.actor_name!r}: rate_limit of message {message.message_id!r}"
        if isinstance(option, str):
            return self._limit_of(option, where), option
        try:
            key: object = option(*message.args, **message.kwargs)
        except Exception as error:
            raise ActorOptionError(
                f"{where} raised {type(error).__name__}: {first_line(error)}; the job did not run (it would run "
                "unlimited): fix the key function or the arguments"
            ) from error
        return self._limit_of(key, where), cast("str", key)

    # -- hooks --------------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return
        if "rate_limit" not in actor.options:
            return
        try:
            found = self.key_for(actor, message)
        except ActorOptionError as error:
            # Fail closed: a key that cannot be computed now will not be on a retry either.
            logger.error("%s", error)
            message.fail()
            raise SkipMessage(str(error)) from error
        if found is None:
            return
        limit, key = found
        database, schema = self.database_for(broker)
        try:
            if self._done_already(broker, message):
                return  # Idempotency skips it unrun: a token is for a call, and it makes none
            with database.autocommit() as conn:
                if not self._checked:
                    ensure_ready(conn, schema=schema, required=RATE_LIMITS_VERSION, feature="rate limits")
                    self._checked = True
                got = self._reserved(conn, schema, key, message, limit) or take(conn, schema, limit, key)
        except (psycopg.Error, OSError, TimeoutError, SchemaNotReady) as error:
            raise DatabaseUnavailable(
                f"RateLimits could not take a token of {key!r} for message {message.message_id!r}: "
                f"{type(error).__name__}: {first_line(error)}; the actor did not run and will be retried "
                "once Postgres answers (run 'dramatiq-reliable migrate' if the schema is behind)"
            ) from error
        except Exception as error:
            raise MiddlewareFailed(
                f"RateLimits could not take a token of {key!r} for message {message.message_id!r}: "
                f"{type(error).__name__}: {first_line(error)}; the actor did not run, report this as a bug"
            ) from error
        if got.granted:
            return
        if got.wait_ms <= self.hold_ms:
            # A token this close is waited for in place: a trip through the queue would come
            # back later than the token (consumers poll for due rows), and late calls bunch.
            time.sleep(max(0.0, got.asked_at + got.wait_ms / 1000 - time.monotonic()))
            return
        # Back hold_ms early, to wait out the rest in place (outside the connection's block: the
        # postponed copy is written on another one).
        self._postpone(
            broker,
            message,
            key,
            {"key": key, "at_ms": got.slot_ms},
            got.wait_ms - self.hold_ms,
            paused=got.paused,
        )

    def _done_already(self, broker: Broker, message: MessageProxy) -> bool:
        """Whether ``Idempotency`` (later in the list) holds the key of this job as done: a redelivery
        it will skip as a duplicate.  A key it cannot compute is left to it (it fails the message)."""
        idempotency = next((m for m in broker.middleware if isinstance(m, Idempotency)), None)
        if idempotency is None:
            return False
        try:
            job = idempotency.job_for(broker, message)
        except IdempotencyKeyError:
            return False
        if job is None:
            return False
        if job.mode == "transactional":
            database, schema = idempotency.database_for(broker)
            with database.autocommit() as conn:
                params = {"actor_name": job.actor_name, "job_key": job.key}
                return conn.execute(_sql.query("idempotency_lookup", schema), params).fetchone() is not None
        return idempotency.record_store(broker).lookup(actor_name=job.actor_name, key=job.key) is not None

    def _reserved(
        self, conn: psycopg.Connection[Any], schema: str, key: str, message: MessageProxy, limit: RateLimit
    ) -> Take | None:
        """The outcome for a job back with a reserved token, or ``None`` when it must take one.

        It runs at its slot (waiting in place for what is left of it), unless a 429 paused the
        key past that slot since, or it came back so late that running now would bunch with the
        calls of later slots: then its token is lost and it takes a new one.  Only once: a broker
        whose delays always come back that late would otherwise never run it.
        """
        slot = message.options.pop(SLOT_KEY, None)
        if not (isinstance(slot, dict) and slot.get("key") == key and is_int(slot.get("at_ms"))):
            return None
        asked_at = time.monotonic()
        ahead_ms, paused_ms = slot_ahead(conn, schema, key, slot["at_ms"])
        if paused_ms and paused_ms > ahead_ms:
            return None
        if ahead_ms < -max(_LATE_MS, limit.interval_ms) and not message.options.get(LATE_KEY):
            message.options[LATE_KEY] = True
            return None
        message.options.pop(LATE_KEY, None)
        return Take(granted=False, wait_ms=max(0, ahead_ms), slot_ms=slot["at_ms"], paused=False, asked_at=asked_at)

    def _postpone(
        self, broker: Broker, message: MessageProxy, key: str, slot: dict[str, Any], delay_ms: int, *, paused: bool
    ) -> None:
        message.options[SLOT_KEY] = slot
        postponed = message.options.get(POSTPONED_KEY, 0)
        message.options[POSTPONED_KEY] = (postponed if is_int(postponed) else 0) + 1
        # Durable first, ack after (SkipMessage): a crash in between duplicates, never loses.
        broker.enqueue(cast("Message[Any]", message), delay=max(1, delay_ms))
        events.emit(RateLimitPostponed(message.actor_name, message.message_id, key, delay_ms, paused))
        raise SkipMessage(f"rate limit {key!r}: no token; the message was postponed by {delay_ms} ms")

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        if exception is None:
            return
        try:
            actor = broker.get_actor(message.actor_name)
            if "rate_limit" not in actor.options:
                return
            told = _provider_pause(exception)
            if told is None:
                return
            found = self.key_for(actor, message)
            if found is None:
                return
            limit, key = found
            status, retry_after = told
            pause_ms = min(self.max_pause_ms, retry_after if retry_after is not None else limit.pause_ms)
            database, schema = self.database_for(broker)
            with database.autocommit() as conn:
                pause(conn, schema, limit, key, pause_ms=max(1, pause_ms), status=status, message_id=message.message_id)
            events.emit(RateLimitPaused(message.actor_name, message.message_id, key, status, pause_ms))
        except Exception:
            # The failed message is the retry middleware's; only the fleet-wide pause is lost.
            logger.exception("could not pause the rate limit of message %s", message.message_id)


def _provider_pause(exception: BaseException) -> tuple[int, int | None] | None:
    """``(status, Retry-After ms)`` when ``exception`` (or an error it wraps) is a 429, or a 503
    that says when to come back; ``None`` otherwise."""
    for error in exception_chain(exception):
        status = http_status_of(error)
        if status in (429, 503):
            retry_after = retry_after_ms_of(error)
            if status == 429 or retry_after is not None:
                return status, retry_after
    return None
