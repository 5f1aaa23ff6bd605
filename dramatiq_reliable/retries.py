"""Classified retries: the one retry middleware, which retries what can recover and fails the rest at once.

:class:`ClassifiedRetries` replaces Dramatiq's ``Retries``.  It keeps Dramatiq's options and
their meanings (``max_retries``, ``min_backoff``, ``max_backoff``, ``retry_when``, ``throws``,
``on_retry_exhausted``; as middleware arguments, actor options and message options) so it is a
drop-in upgrade, and adds what ``Retries`` lacks:

* a classifier (:func:`~dramatiq_reliable.classify.classify`) that fails fast on errors a
  retry cannot fix (HTTP 404, a constraint violation, ``Unrecoverable``) instead of burning
  twenty attempts over a week, and retries deadlocks within milliseconds;
* ``Retry-After`` honoured on 429/503, with a cap past which the job fails instead of waiting;
* jittered backoff capped below RabbitMQ's ``consumer_timeout`` by default;
* a deadline by message age (``retry_deadline_ms``);
* the decision stored on the message (``message.options["retry_decision"]``) and emitted as an
  event, so dead letters and traces say why.

Dramatiq has no ``remove_middleware``, so build the broker's list with :func:`build_middleware`:

>>> from dramatiq.brokers.rabbitmq import RabbitmqBroker
>>> broker = RabbitmqBroker(
...     url="amqp://guest:guest@localhost:5672",
...     middleware=build_middleware(retries=ClassifiedRetries(max_retries=10)),
... )  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal, cast

from dramatiq.actor import Actor
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import current_millis
from dramatiq.message import Message
from dramatiq.middleware import Middleware, Retries, default_middleware
from dramatiq.worker import Worker

from . import events
from ._checks import check_bool, check_ms, is_int
from ._util import type_name as _type_name
from .backing import postgres_backed
from .classify import (
    DEFAULT_MAX_RETRY_AFTER_MS,
    Decision,
    Jitter,
    Rule,
    Rules,
    backoff_ms,
    classify,
    http_status_of,
    rules_from,
)
from .errors import ConfigurationError, JobCancelled
from .jobs.attempts import DEFAULT_FAILURE_RETENTION_MS, record_failure

__all__ = [
    "DEFAULT_MAX_BACKOFF",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_MIN_BACKOFF",
    "RABBITMQ_CONSUMER_TIMEOUT_MS",
    "RETRY_DECISION_KEY",
    "ClassifiedRetries",
    "RetryEvent",
    "RetryGaveUp",
    "RetryOutcome",
    "RetryScheduled",
    "build_middleware",
    "decision_record",
    "delays_disabled",
    "no_delays",
    "retry_event",
    "validate_middleware",
]

logger = logging.getLogger("dramatiq_reliable.retries")

#: The message option holding the latest retry decision (a JSON-able dict, see :func:`decision_record`).
RETRY_DECISION_KEY = "retry_decision"

#: Dramatiq's default: 15 seconds before the first retry.
DEFAULT_MIN_BACKOFF = 15_000
#: 10 minutes, where Dramatiq's is 7 days: a delayed message sits unacked in worker memory
#: until its eta, and RabbitMQ closes the channel of a consumer that holds one past
#: ``consumer_timeout`` (30 minutes by default), redelivering everything it held.
DEFAULT_MAX_BACKOFF = 10 * 60 * 1000
#: Dramatiq's default.
DEFAULT_MAX_RETRIES = 20
#: RabbitMQ's default ``consumer_timeout`` (since 3.8.15).
RABBITMQ_CONSUMER_TIMEOUT_MS = 30 * 60 * 1000
# The longest delay Dramatiq's brokers accept (Dramatiq caps max_backoff at this too).
_MAX_DELAY_MS = 7 * 24 * 60 * 60 * 1000

_JITTERS = ("full", "proportional", "none")

#: What became of a failed message: ``"retry"`` (scheduled), ``"fail"`` (the classifier, a rule,
#: ``throws`` or ``Unrecoverable`` said no), ``"exhausted"`` (``max_retries`` or ``retry_when``),
#: ``"deadline"`` (the next attempt would start after ``retry_deadline_ms``), ``"outcome_unknown"``
#: (a job's ``COMMIT`` kept failing with an unknown outcome: ``Idempotency``'s own bounded
#: retries, which do not count against ``max_retries``, ran out).
RetryOutcome = Literal["retry", "fail", "exhausted", "deadline", "outcome_unknown"]


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RetryEvent(events.Event):
    """Fields shared by the retry events; ``reason`` and ``category`` come from the classifier."""

    message_id: str
    actor_name: str
    queue_name: str
    attempt: int
    outcome: str
    reason: str
    category: str
    delay_ms: int | None
    http_status: int | None
    error_type: str | None


@dataclasses.dataclass(frozen=True)
class RetryScheduled(RetryEvent):
    """A failed message was re-enqueued to run again after ``delay_ms``."""

    name: ClassVar[str] = "retry.scheduled"


@dataclasses.dataclass(frozen=True)
class RetryGaveUp(RetryEvent):
    """A failed message will not run again; ``outcome`` says why.  The message is failed
    (``message.fail()``), so the broker dead-letters it."""

    name: ClassVar[str] = "retry.gave_up"
    level: ClassVar[int] = logging.WARNING


# --------------------------------------------------------------------------------------------
# Testing switch
# --------------------------------------------------------------------------------------------

_no_delays_lock = threading.Lock()
# A counter, not a contextvar: worker threads must see the switch the test thread turned on.
_no_delays_depth = 0


@contextlib.contextmanager
def no_delays() -> Iterator[None]:
    """Within this block every ``ClassifiedRetries`` schedules retries with a delay of 0.

    Classification, ``max_retries`` and deadlines still apply; only the wait goes, so tests of
    retrying actors run in milliseconds.  Affects every thread (workers included); blocks nest.

    >>> with no_delays():                       # doctest: +SKIP
    ...     flaky.send(); broker.join(flaky.queue_name); worker.join()
    """
    global _no_delays_depth
    with _no_delays_lock:
        _no_delays_depth += 1
    try:
        yield
    finally:
        with _no_delays_lock:
            _no_delays_depth -= 1


def delays_disabled() -> bool:
    """Whether a :func:`no_delays` block is active (in any thread)."""
    return _no_delays_depth > 0


# --------------------------------------------------------------------------------------------
# The middleware
# --------------------------------------------------------------------------------------------


class ClassifiedRetries(Middleware):
    """Retries failed messages whose error can recover, with jittered exponential backoff.

    Must be the only retry middleware and the last in the broker's middleware list: after-hooks
    run in reverse order, so being last makes its ``after_process_message`` the first to see a
    failure, before any other middleware acts on the message's fate.  :func:`build_middleware`
    builds such a list.

    On each failure, in order:

    1. an exception matching the actor's ``throws`` fails the message (Dramatiq's behaviour:
       ``retries`` is not incremented);
    2. ``retries`` is incremented and ``traceback`` and ``requeue_timestamp`` are set, as Dramatiq does;
    3. :func:`~dramatiq_reliable.classify.classify` decides, with the actor's ``retry_rules``
       then the middleware's ``rules`` in front of the built-in ones; a permanent error fails;
    4. ``retry_when(retries, exception)`` if set, else ``max_retries``, may exhaust the budget
       (``on_retry_exhausted`` is then sent, as in Dramatiq);
    5. the delay is computed (see below); if the next attempt would start later than
       ``retry_deadline_ms`` after the message was first enqueued, the message fails;
    6. otherwise ``broker.enqueue(message, delay=delay)`` schedules the retry.

    Every outcome is stored as ``message.options["retry_decision"]`` and emitted as a
    :class:`RetryScheduled` or :class:`RetryGaveUp` event.  Giving up calls ``message.fail()``.
    If deciding or enqueueing itself raises, the message is failed too (reason
    ``"retry_error"``): dead-lettered and visible rather than acked away.

    The delay: ``Retry(delay=...)`` and rules with ``delay_ms`` are used as given; otherwise
    :func:`~dramatiq_reliable.classify.backoff_ms` from ``min_backoff`` (or the decision's shorter
    ``min_backoff_ms``, e.g. 250 ms for deadlocks) capped at ``max_backoff``, raised to the
    server's ``Retry-After`` when there is one.

    Actor options: ``max_retries``, ``min_backoff``, ``max_backoff``, ``retry_when``, ``throws``,
    ``on_retry_exhausted``, ``retry_rules``, ``retry_deadline_ms``, ``max_retry_after_ms``.  Message
    options: the same but ``retry_when`` and ``retry_rules`` (callables do not serialise).  A
    message option beats an actor option, which beats the middleware argument.

    Parameters (keyword-only):
      max_retries: retries after the first attempt; ``None`` for no limit (then set a deadline).
      min_backoff: ms before the first retry (default 15 s, as Dramatiq).
      max_backoff: cap on the backoff in ms (default 10 min; Dramatiq's is 7 days, see
        ``consumer_timeout_ms``).
      retry_when: ``(retries, exception) -> bool``, replaces the ``max_retries`` check for errors
        the classifier would retry.  Permanent errors still fail: override those with rules.
      on_retry_exhausted: name of an actor sent ``(message.asdict(), {"retries", "max_retries"})``
        when the retry budget (count or deadline) runs out.
      rules: extra rules, in front of the built-in ones; a list of ``exception -> Decision | None``
        callables or a ``{ExceptionType: Decision}`` dict.  Actors add theirs with ``retry_rules``.
      jitter, jitter_ratio: see :func:`~dramatiq_reliable.classify.backoff_ms`.
      retry_deadline_ms: no retry starts later than this many ms after the message was first
        enqueued (``message_timestamp``).  Unlike Dramatiq's ``AgeLimit`` ``max_age``, which
        drops a message before it runs, this only stops retrying.  ``None``: no deadline.
      max_retry_after_ms: longest ``Retry-After`` honoured; longer fails the message with reason
        ``"retry_after_too_long"`` (default 15 min).  ``None``: no cap.
      consumer_timeout_ms: the broker's ``consumer_timeout``; a warning is logged when
        ``max_backoff`` or ``max_retry_after_ms`` exceeds it.  ``None`` silences the check
        (Redis, or a RabbitMQ with the timeout raised).
      testing: retry without waiting (see also :func:`no_delays`).
      record_failures: on a Postgres-backed broker, upsert each failed attempt's record (attempts,
        last error, next due) in ``job_attempts`` for ``jobs show`` (default True; a job that
        never fails writes nothing).  See :mod:`dramatiq_reliable.jobs.attempts`.
      failure_retention_ms: how long a failure record is kept after its latest failure (7 days).

    >>> broker = RabbitmqBroker(middleware=build_middleware(
    ...     retries=ClassifiedRetries(max_retries=5, rules={PaymentDeclined: Decision.permanent("declined")}),
    ... ))  # doctest: +SKIP
    >>> @dramatiq.actor(retry_rules=[lambda e: Decision.transient("busy") if is_busy(e) else None])
    ... def charge(order_id): ...  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        max_retries: int | None = DEFAULT_MAX_RETRIES,
        min_backoff: int | None = None,
        max_backoff: int | None = None,
        retry_when: Callable[[int, BaseException], bool] | None = None,
        on_retry_exhausted: str | None = None,
        rules: Rules | None = None,
        jitter: Jitter = "full",
        jitter_ratio: float = 0.25,
        retry_deadline_ms: int | None = None,
        max_retry_after_ms: int | None = DEFAULT_MAX_RETRY_AFTER_MS,
        consumer_timeout_ms: int | None = RABBITMQ_CONSUMER_TIMEOUT_MS,
        testing: bool = False,
        record_failures: bool = True,
        failure_retention_ms: int = DEFAULT_FAILURE_RETENTION_MS,
    ) -> None:
        # None means the default, as in Dramatiq's Retries.
        min_backoff = DEFAULT_MIN_BACKOFF if min_backoff is None else min_backoff
        max_backoff = DEFAULT_MAX_BACKOFF if max_backoff is None else max_backoff
        check_ms(
            "max_retries",
            max_retries,
            minimum=0,
            allow_none=True,
            fix="use 0 to never retry, None for no limit",
        )
        check_ms("min_backoff", min_backoff, minimum=1, fix="pass the first retry's delay in milliseconds")
        check_ms(
            "max_backoff",
            max_backoff,
            minimum=1,
            fix="pass the longest delay between retries in milliseconds",
        )
        if max_backoff < min_backoff:
            raise ConfigurationError(
                f"max_backoff={max_backoff!r} is below min_backoff={min_backoff!r}; "
                "raise max_backoff or lower min_backoff"
            )
        if max_backoff > _MAX_DELAY_MS:
            raise ConfigurationError(
                f"max_backoff={max_backoff!r} exceeds Dramatiq's longest delay of 7 days "
                f"({_MAX_DELAY_MS!r} ms); lower max_backoff"
            )
        if retry_when is not None and not callable(retry_when):
            raise ConfigurationError(
                f"retry_when must be a callable (retries, exception) -> bool or None, got {retry_when!r}"
            )
        if on_retry_exhausted is not None and (not isinstance(on_retry_exhausted, str) or not on_retry_exhausted):
            raise ConfigurationError(
                f"on_retry_exhausted must be an actor name or None, got {on_retry_exhausted!r}; "
                "pass the callback actor's actor_name"
            )
        if jitter not in _JITTERS:
            raise ConfigurationError(f"jitter must be one of {_JITTERS!r}, got {jitter!r}; 'full' is the default")
        if (
            isinstance(jitter_ratio, bool)
            or not isinstance(jitter_ratio, (int, float))
            or not 0.0 <= jitter_ratio <= 1.0
        ):
            raise ConfigurationError(
                f"jitter_ratio must be a number from 0 to 1, got {jitter_ratio!r}; 0.25 jitters up to 25% below"
            )
        check_ms(
            "retry_deadline_ms",
            retry_deadline_ms,
            minimum=1,
            allow_none=True,
            fix="pass the longest time in milliseconds a message may keep retrying, or None",
        )
        check_ms(
            "max_retry_after_ms",
            max_retry_after_ms,
            minimum=0,
            allow_none=True,
            fix="pass the longest Retry-After to honour in milliseconds, or None for no cap",
        )
        check_ms(
            "consumer_timeout_ms",
            consumer_timeout_ms,
            minimum=1,
            allow_none=True,
            fix="pass RabbitMQ's consumer_timeout in milliseconds, or None to skip the check",
        )
        if not isinstance(testing, bool):
            raise ConfigurationError(f"testing must be True or False, got {testing!r}")
        self.record_failures = check_bool("record_failures", record_failures)
        check_ms(
            "failure_retention_ms",
            failure_retention_ms,
            minimum=1,
            fix="pass how long a failure record is kept in milliseconds, e.g. 7 days",
        )
        self.failure_retention_ms: int = failure_retention_ms

        self.max_retries = max_retries
        self.min_backoff: int = min_backoff
        self.max_backoff: int = max_backoff
        self.retry_when = retry_when
        self.on_retry_exhausted = on_retry_exhausted
        self.rules: tuple[Rule, ...] = rules_from(rules)
        self.jitter: Jitter = jitter
        self.jitter_ratio = float(jitter_ratio)
        self.retry_deadline_ms = retry_deadline_ms
        self.max_retry_after_ms = max_retry_after_ms
        self.consumer_timeout_ms = consumer_timeout_ms
        self.testing = testing
        self._warn_if_beyond_consumer_timeout("middleware", max_backoff, max_retry_after_ms)

    def __repr__(self) -> str:
        return (
            f"ClassifiedRetries(max_retries={self.max_retries!r}, min_backoff={self.min_backoff!r}, "
            f"max_backoff={self.max_backoff!r}, retry_deadline_ms={self.retry_deadline_ms!r}, "
            f"testing={self.testing!r})"
        )

    @property
    def actor_options(self) -> set[str]:
        return {
            "max_retries",
            "min_backoff",
            "max_backoff",
            "retry_when",
            "throws",
            "on_retry_exhausted",
            "retry_rules",
            "retry_deadline_ms",
            "max_retry_after_ms",
        }

    # -- hooks --------------------------------------------------------------------------------

    def after_declare_actor(self, broker: Broker, actor: Actor[..., Any]) -> None:
        """Check the actor's retry options now rather than on its first failure.

        Dramatiq swallows exceptions from this hook, so problems are logged, not raised.
        """
        options = actor.options
        try:
            rules_from(options.get("retry_rules"))
        except ConfigurationError as error:
            logger.error("actor %r: %s", actor.actor_name, error)
        if postgres_backed(broker) is None:  # a Postgres-backed broker keeps delays in Postgres
            self._warn_if_beyond_consumer_timeout(
                f"actor {actor.actor_name!r}",
                options.get("max_backoff"),
                options.get("max_retry_after_ms"),
            )

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Complain loudly about a middleware list on which retries cannot work as documented."""
        try:
            validate_middleware(broker.middleware)
        except ConfigurationError as error:
            logger.critical("%s", error)

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
        if isinstance(exception, JobCancelled):
            # A cancelled job stopped on purpose: final, but not a failure.  The message is not
            # failed, so it is acked (never retried, never dead-lettered).
            return
        retries = message.options.get("retries", 0)
        attempt = retries + 1 if is_int(retries) else 1
        try:
            self._handle_failure(broker, message, exception, attempt)
        except Exception:
            # A broken rule, a bad option value or an unreachable broker: failing the message
            # dead-letters it, where Dramatiq would ack it away unretried.
            logger.exception(
                "could not decide or schedule a retry of message %s; failing it so it is dead-lettered",
                message.message_id,
            )
            decision = Decision(
                retry=False,
                category="unknown",
                reason="retry_error",
                error_type=_type_name(type(exception)),
                matched_type=_type_name(type(exception)),
            )
            message.options[RETRY_DECISION_KEY] = decision_record(decision, "fail", attempt, None)
            self._record(broker, message, exception)
            message.fail()
            events.emit(retry_event(RetryGaveUp, message, decision, "fail", attempt))

    # -- the decision -------------------------------------------------------------------------

    def _handle_failure(self, broker: Broker, message: MessageProxy, exception: BaseException, attempt: int) -> None:
        actor = broker.get_actor(message.actor_name)
        options = message.options

        def option(name: str, default: Any) -> Any:
            # Dramatiq's precedence: message option, then actor option, then middleware default.
            return options.get(name, actor.options.get(name, default))

        now_ms = current_millis()
        retries: int = options.setdefault("retries", 0)
        max_retries = option("max_retries", self.max_retries)

        throws = options.get("throws") or actor.options.get("throws")
        if throws and isinstance(exception, throws):
            # As Dramatiq: an expected exception is not a retry, so "retries" stays as it was.
            decision = Decision(
                retry=False,
                category="permanent",
                reason="throws",
                http_status=http_status_of(exception),
                error_type=_type_name(type(exception)),
                matched_type=_type_name(type(exception)),
            )
            self._give_up(broker, message, actor, decision, "fail", attempt, max_retries, exception)
            return

        options["retries"] = retries + 1
        options["traceback"] = "".join(
            traceback.format_exception(type(exception), exception, exception.__traceback__, limit=30)
        )
        options["requeue_timestamp"] = now_ms

        rules = rules_from(actor.options.get("retry_rules")) + self.rules
        decision = classify(
            exception,
            rules=rules,
            max_retry_after_ms=option("max_retry_after_ms", self.max_retry_after_ms),
            now=now_ms / 1000,
        )
        if not decision.retry:
            self._give_up(broker, message, actor, decision, "fail", attempt, max_retries, exception)
            return

        retry_when = actor.options.get("retry_when", self.retry_when)
        if retry_when is not None:
            exhausted = not retry_when(retries, exception)
        else:
            exhausted = max_retries is not None and retries >= max_retries
        if exhausted:
            self._give_up(broker, message, actor, decision, "exhausted", attempt, max_retries, exception)
            return

        delay = self._delay(decision, attempt, option)
        deadline_ms = option("retry_deadline_ms", self.retry_deadline_ms)
        if deadline_ms is not None and now_ms + delay - message.message_timestamp > deadline_ms:
            decision = dataclasses.replace(decision, delay_ms=delay)
            self._give_up(broker, message, actor, decision, "deadline", attempt, max_retries, exception)
            return

        if (
            self.consumer_timeout_ms is not None
            and delay > self.consumer_timeout_ms
            # OutboxBroker and PostgresBroker keep the delay in Postgres: no worker holds it.
            and postgres_backed(broker) is None
        ):
            logger.warning(
                "retry of message %s is delayed %d ms, beyond consumer_timeout_ms=%d; RabbitMQ may close "
                "the channel holding it (lower the delay or raise consumer_timeout)",
                message.message_id,
                delay,
                self.consumer_timeout_ms,
            )
        decision = dataclasses.replace(decision, delay_ms=delay)
        options[RETRY_DECISION_KEY] = decision_record(decision, "retry", attempt, max_retries)
        # Before the retry is written: the held message may be acked as it is, and `jobs show`
        # must never find neither the message nor its record.
        self._record(broker, message, exception)
        # The proxy, as Dramatiq's Retries passes it: brokers only read its fields.
        broker.enqueue(cast("Message[Any]", message), delay=delay)
        events.emit(retry_event(RetryScheduled, message, decision, "retry", attempt))

    def _delay(self, decision: Decision, attempt: int, option: Callable[[str, Any], Any]) -> int:
        if self.testing or delays_disabled():
            return 0
        if decision.delay_ms is not None:
            return min(decision.delay_ms, _MAX_DELAY_MS)
        min_backoff: int = option("min_backoff", self.min_backoff)
        max_backoff: int = min(option("max_backoff", self.max_backoff), _MAX_DELAY_MS)
        if decision.min_backoff_ms is not None:
            min_backoff = max(1, min(min_backoff, decision.min_backoff_ms))
        delay = backoff_ms(
            attempt,
            min_backoff=min_backoff,
            max_backoff=max_backoff,
            jitter=self.jitter,
            jitter_ratio=self.jitter_ratio,
        )
        if decision.retry_after_ms is not None:
            # Retry-After is a floor: the server said "not before", not "exactly then".
            delay = max(delay, decision.retry_after_ms)
        return min(delay, _MAX_DELAY_MS)

    def _give_up(
        self,
        broker: Broker,
        message: MessageProxy,
        actor: Actor[..., Any],
        decision: Decision,
        outcome: RetryOutcome,
        attempt: int,
        max_retries: int | None,
        exception: BaseException,
    ) -> None:
        # A deadline record keeps the delay that would have overshot it; other give-ups have none.
        record_decision = decision if outcome == "deadline" else dataclasses.replace(decision, delay_ms=None)
        message.options[RETRY_DECISION_KEY] = decision_record(record_decision, outcome, attempt, max_retries)
        self._record(broker, message, exception)
        message.fail()
        events.emit(retry_event(RetryGaveUp, message, record_decision, outcome, attempt))

        if outcome in ("exhausted", "deadline"):
            target = message.options.get("on_retry_exhausted") or actor.options.get(
                "on_retry_exhausted", self.on_retry_exhausted
            )
            if target:
                try:
                    broker.get_actor(target).send(
                        message.asdict(),
                        {"retries": attempt - 1, "max_retries": max_retries},
                    )
                except Exception:
                    # The message is failed and dead-lettered either way; only the callback is lost.
                    logger.exception(
                        "could not send on_retry_exhausted actor %r for message %s", target, message.message_id
                    )

    def _record(self, broker: Broker, message: MessageProxy, exception: BaseException) -> None:
        """The failure record of this attempt (``jobs show``); never raises, nothing on success."""
        if self.record_failures:
            record_failure(
                broker, message, exception, message.options[RETRY_DECISION_KEY], retention_ms=self.failure_retention_ms
            )

    def _warn_if_beyond_consumer_timeout(self, owner: str, max_backoff: Any, max_retry_after_ms: Any) -> None:
        limit = self.consumer_timeout_ms
        if limit is None:
            return
        for name, value in (("max_backoff", max_backoff), ("max_retry_after_ms", max_retry_after_ms)):
            if is_int(value) and value > limit:
                logger.warning(
                    "%s: %s=%d ms is longer than consumer_timeout_ms=%d; delayed messages wait unacked in "
                    "worker memory and RabbitMQ closes a channel that holds one past its consumer_timeout "
                    "(30 min by default): lower %s, or raise RabbitMQ's consumer_timeout and pass it as "
                    "consumer_timeout_ms",
                    owner,
                    name,
                    value,
                    limit,
                    name,
                )


def decision_record(decision: Decision, outcome: RetryOutcome, attempt: int, max_retries: int | None) -> dict[str, Any]:
    """The JSON-able form stored under ``message.options["retry_decision"]``.

    Dead letters and traces read it to say why a message was retried or failed; every part
    that decides a message's fate (``ClassifiedRetries``, ``Idempotency`` for a commit whose
    outcome is unknown) stores this same shape.
    """
    return {
        "retry": outcome == "retry",
        "outcome": outcome,
        "category": decision.category,
        "reason": decision.reason,
        "attempt": attempt,
        "max_retries": max_retries,
        "delay_ms": decision.delay_ms,
        "retry_after_ms": decision.retry_after_ms,
        "http_status": decision.http_status,
        "error_type": decision.error_type,
        "matched_type": decision.matched_type,
    }


def retry_event(
    cls: type[RetryEvent], message: MessageProxy, decision: Decision, outcome: RetryOutcome, attempt: int
) -> RetryEvent:
    """The :class:`RetryScheduled` or :class:`RetryGaveUp` event for a decision about ``message``."""
    return cls(
        message_id=message.message_id,
        actor_name=message.actor_name,
        queue_name=message.queue_name,
        attempt=attempt,
        outcome=outcome,
        reason=decision.reason,
        category=decision.category,
        delay_ms=decision.delay_ms,
        http_status=decision.http_status,
        error_type=decision.error_type,
    )


# --------------------------------------------------------------------------------------------
# The middleware list
# --------------------------------------------------------------------------------------------


def build_middleware(
    *,
    retries: ClassifiedRetries | None = None,
    middleware: Sequence[Middleware] = (),
) -> list[Middleware]:
    """Dramatiq's default middleware list with ``Retries`` replaced by ``ClassifiedRetries``, last.

    The rule: **the list you give comes first, in your order; Dramatiq's defaults you did not
    list follow in Dramatiq's order; ClassifiedRetries ends it.**  Listing an instance of a
    default class (``AgeLimit``, ``TimeLimit``, ``ShutdownNotifications``, ``Callbacks``,
    ``Pipelines``) both configures it and places it.

    So ``middleware=[Tracing(), DeadLetters(), Idempotency()]`` gives ``Tracing, DeadLetters,
    Idempotency, AgeLimit, TimeLimit, ShutdownNotifications, Callbacks, Pipelines,
    ClassifiedRetries``: ``Tracing`` first, so its span covers every other hook, and
    ``Idempotency`` before ``Callbacks`` and ``Pipelines``, whose after-hooks then run inside
    the job's transaction (after-hooks run in reverse).  To have ``AgeLimit`` and ``TimeLimit``
    act before ``Idempotency``, list them: ``[Tracing(), AgeLimit(), TimeLimit(), Idempotency()]``.

    Pass the result as ``middleware=`` when building the broker, before importing actor
    modules: Dramatiq validates actor options against the middleware present at decoration time.

    >>> broker = RabbitmqBroker(middleware=build_middleware(
    ...     retries=ClassifiedRetries(max_retries=5), middleware=[Tracing(), Idempotency()]))  # doctest: +SKIP
    """
    retries = ClassifiedRetries() if retries is None else retries
    if not isinstance(retries, ClassifiedRetries):
        raise ConfigurationError(f"retries must be a ClassifiedRetries instance, got {retries!r}")
    front: list[Middleware] = []
    for item in middleware:
        if not isinstance(item, Middleware):
            raise ConfigurationError(
                f"middleware item {item!r} is not a dramatiq Middleware instance; pass instances, not classes"
            )
        if isinstance(item, (Retries, ClassifiedRetries)):
            raise ConfigurationError(
                f"middleware contains a retry middleware {item!r}; pass ClassifiedRetries as retries= "
                "and no other: two retry middlewares both retry and dead-letter the same message"
            )
        if any(item is seen for seen in front):
            raise ConfigurationError(f"middleware lists {item!r} twice; list each instance once")
        front.append(item)
    listed = {type(item) for item in front}
    rest = [cls() for cls in default_middleware if cls is not Retries and cls not in listed]
    result = [*front, *rest, retries]
    validate_middleware(result)
    return result


_AFTER_PROCESS_HOOKS = ("after_process_message", "after_skip_message", "before_nack", "before_ack")


def validate_middleware(middleware: Sequence[Middleware]) -> None:
    """Raise :class:`~dramatiq_reliable.errors.ConfigurationError` unless ``middleware`` has
    exactly one retry middleware, a ``ClassifiedRetries``, in last place.

    Dramatiq's ``Retries`` next to ours would retry a message ours dead-letters; ours anywhere but
    last would let another middleware's after-hook act before the retry decision is made.
    """
    names = [type(item).__name__ for item in middleware]
    dramatiq_retries = [item for item in middleware if isinstance(item, Retries)]
    if dramatiq_retries:
        raise ConfigurationError(
            f"the middleware list {names!r} contains dramatiq's Retries; build it with "
            "dramatiq_reliable.retries.build_middleware(), which replaces Retries with ClassifiedRetries"
        )
    ours = [index for index, item in enumerate(middleware) if isinstance(item, ClassifiedRetries)]
    if len(ours) != 1:
        raise ConfigurationError(
            f"the middleware list {names!r} has {len(ours)!r} ClassifiedRetries; it needs exactly one, "
            "last: build it with dramatiq_reliable.retries.build_middleware()"
        )
    # Middleware after ours matter only if they act on a processed message before we decide
    # (after-hooks run in reverse); WorkerRelay and the like, with no such hook, may follow.
    acting_later = [
        type(item).__name__
        for item in middleware[ours[0] + 1 :]
        if any(getattr(type(item), hook) is not getattr(Middleware, hook) for hook in _AFTER_PROCESS_HOOKS)
    ]
    if acting_later:
        raise ConfigurationError(
            f"ClassifiedRetries is not last in the middleware list {names!r}: {acting_later!r} come after it and "
            "act on processed messages; move ClassifiedRetries to the end (build_middleware() does) "
            "so its after-hook sees failures first"
        )
