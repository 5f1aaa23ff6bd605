"""ClassifiedRetries on a StubBroker: what is retried, what fails, what is recorded and emitted.

Worker-driven tests run real actors that call a local HTTP server (127.0.0.1, ephemeral port) with
``testing=True``, so retries happen at once.  Delay arithmetic is checked by calling the
middleware's hook directly with a broker whose ``enqueue`` records the delay: no waiting, no clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg.errors
import pytest
import requests
from dramatiq import Message, Worker
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import current_millis
from dramatiq.middleware import AgeLimit, Callbacks, Middleware, Pipelines, Retries, ShutdownNotifications, TimeLimit

from dramatiq_reliable import events
from dramatiq_reliable.classify import Decision
from dramatiq_reliable.errors import ConfigurationError, Unrecoverable
from dramatiq_reliable.retries import (
    RETRY_DECISION_KEY,
    ClassifiedRetries,
    RetryGaveUp,
    RetryScheduled,
    build_middleware,
    no_delays,
    validate_middleware,
)

# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


def make_broker(**retries: Any) -> StubBroker:
    broker = StubBroker(middleware=build_middleware(retries=ClassifiedRetries(**retries)), fail_fast_default=False)
    broker.emit_after("process_boot")
    return broker


@contextlib.contextmanager
def working(broker: StubBroker) -> Iterator[Worker]:
    worker = Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
        broker.close()


def settle(broker: StubBroker, worker: Worker, queue: str = "default") -> None:
    broker.join(queue, timeout=20_000)
    worker.join()


def retry_events(seen: list[events.Event]) -> list[RetryScheduled]:
    return [event for event in seen if isinstance(event, RetryScheduled)]


def gave_up_events(seen: list[events.Event]) -> list[RetryGaveUp]:
    return [event for event in seen if isinstance(event, RetryGaveUp)]


# --------------------------------------------------------------------------------------------
# Through a worker
# --------------------------------------------------------------------------------------------


def test_a_503_is_retried_until_it_succeeds(http: Callable[..., None], seen: list[events.Event]) -> None:
    """Two real 503s are retried and the third attempt succeeds; nothing is dead-lettered."""
    broker = make_broker(testing=True)
    calls: list[int] = []

    @dramatiq.actor(broker=broker)
    def flaky() -> None:
        calls.append(1)
        http(503 if len(calls) < 3 else 200)

    with working(broker) as worker:
        message = flaky.send()
        settle(broker, worker)

    assert len(calls) == 3
    assert broker.dead_letters == []
    scheduled = retry_events(seen)
    assert [(e.attempt, e.reason, e.http_status, e.category, e.delay_ms) for e in scheduled] == [
        (1, "http_503", 503, "transient", 0),
        (2, "http_503", 503, "transient", 0),
    ]
    assert {e.message_id for e in scheduled} == {message.message_id}
    assert scheduled[0].error_type == "requests.exceptions.HTTPError"
    assert scheduled[0].queue_name == "default"
    assert scheduled[0].actor_name == "flaky"


def test_a_404_fails_at_once_and_is_dead_lettered(http: Callable[..., None], seen: list[events.Event]) -> None:
    """A real 404 runs once, is failed with the decision recorded, and emits retry.gave_up."""
    broker = make_broker(testing=True, max_retries=10)
    calls: list[int] = []

    @dramatiq.actor(broker=broker)
    def fetch() -> None:
        calls.append(1)
        http(404)

    with working(broker) as worker:
        fetch.send()
        settle(broker, worker)

    assert len(calls) == 1
    [dead] = broker.dead_letters
    decision = dead.options[RETRY_DECISION_KEY]
    assert decision == {
        "retry": False,
        "outcome": "fail",
        "category": "permanent",
        "reason": "http_404",
        "attempt": 1,
        "max_retries": 10,
        "delay_ms": None,
        "retry_after_ms": None,
        "http_status": 404,
        "error_type": "requests.exceptions.HTTPError",
        "matched_type": "requests.exceptions.HTTPError",
    }
    assert json.loads(json.dumps(decision)) == decision
    assert retry_events(seen) == []
    [gave_up] = gave_up_events(seen)
    assert (gave_up.name, gave_up.outcome, gave_up.reason, gave_up.attempt) == ("retry.gave_up", "fail", "http_404", 1)


def test_unrecoverable_is_never_retried_whatever_max_retries_says(seen: list[events.Event]) -> None:
    """Unrecoverable fails the message on its first run."""
    broker = make_broker(testing=True, max_retries=50)
    calls: list[int] = []

    @dramatiq.actor(broker=broker)
    def charge() -> None:
        calls.append(1)
        raise Unrecoverable("order 7 was deleted")

    with working(broker) as worker:
        charge.send()
        settle(broker, worker)

    assert len(calls) == 1
    [dead] = broker.dead_letters
    assert dead.options[RETRY_DECISION_KEY]["reason"] == "unrecoverable"


def test_throws_fails_without_counting_a_retry(http: Callable[..., None], seen: list[events.Event]) -> None:
    """An exception in the actor's ``throws`` is not retried even if the classifier would, and
    'retries' stays untouched, as in Dramatiq."""
    broker = make_broker(testing=True)
    calls: list[int] = []

    @dramatiq.actor(broker=broker, throws=(requests.HTTPError,))
    def expected() -> None:
        calls.append(1)
        http(503)

    with working(broker) as worker:
        expected.send()
        settle(broker, worker)

    assert len(calls) == 1
    [dead] = broker.dead_letters
    assert dead.options["retries"] == 0
    assert dead.options[RETRY_DECISION_KEY]["reason"] == "throws"
    assert dead.options[RETRY_DECISION_KEY]["http_status"] == 503


def test_max_retries_ends_retrying_and_calls_on_retry_exhausted(
    http: Callable[..., None], seen: list[events.Event]
) -> None:
    """With max_retries=2 a permanent 503 runs three times, then on_retry_exhausted gets Dramatiq's payload."""
    broker = make_broker(testing=True)
    calls: list[int] = []
    exhausted: list[tuple[dict[str, Any], dict[str, Any]]] = []

    @dramatiq.actor(broker=broker)
    def on_exhausted(message: dict[str, Any], info: dict[str, Any]) -> None:
        exhausted.append((message, info))

    @dramatiq.actor(broker=broker, max_retries=2, on_retry_exhausted="on_exhausted")
    def always_503() -> None:
        calls.append(1)
        http(503)

    with working(broker) as worker:
        sent = always_503.send()
        settle(broker, worker)

    assert len(calls) == 3
    [dead] = broker.dead_letters
    assert dead.options["retries"] == 3
    assert dead.options[RETRY_DECISION_KEY]["outcome"] == "exhausted"
    assert dead.options[RETRY_DECISION_KEY]["reason"] == "http_503"
    [(payload, info)] = exhausted
    assert payload["message_id"] == sent.message_id
    assert info == {"retries": 2, "max_retries": 2}
    assert [e.attempt for e in retry_events(seen)] == [1, 2]
    assert [(e.outcome, e.attempt) for e in gave_up_events(seen)] == [("exhausted", 3)]


def test_a_message_option_overrides_the_actor_max_retries(http: Callable[..., None]) -> None:
    """send_with_options(max_retries=1) beats the actor's max_retries=5."""
    broker = make_broker(testing=True)
    calls: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=5)
    def always_503() -> None:
        calls.append(1)
        http(503)

    with working(broker) as worker:
        always_503.send_with_options(max_retries=1)
        settle(broker, worker)

    assert len(calls) == 2


def test_retry_when_replaces_max_retries_for_retryable_errors_only(http: Callable[..., None]) -> None:
    """retry_when decides the budget of a 503, but cannot make a 404 retry."""
    broker = make_broker(testing=True, retry_when=lambda retries, exception: retries < 1)
    calls: dict[int, int] = {503: 0, 404: 0}

    @dramatiq.actor(broker=broker, max_retries=0)
    def call(status: int) -> None:
        calls[status] += 1
        http(status)

    with working(broker) as worker:
        call.send(503)
        call.send(404)
        settle(broker, worker)

    assert calls == {503: 2, 404: 1}


def test_actor_rules_override_global_rules_which_override_built_ins(seen: list[events.Event]) -> None:
    """retry_rules on the actor win over the middleware's rules, which win over the default 'unknown'."""
    broker = make_broker(testing=True, max_retries=3, rules={KeyError: Decision.permanent("global_rule")})
    calls: dict[str, int] = {"global": 0, "actor": 0}

    @dramatiq.actor(broker=broker)
    def uses_global() -> None:
        calls["global"] += 1
        raise KeyError("user")

    @dramatiq.actor(broker=broker, retry_rules=[lambda e: Decision.permanent("actor_rule")])
    def uses_actor() -> None:
        calls["actor"] += 1
        raise KeyError("user")

    with working(broker) as worker:
        uses_global.send()
        uses_actor.send()
        settle(broker, worker)

    assert calls == {"global": 1, "actor": 1}
    reasons = {dead.actor_name: dead.options[RETRY_DECISION_KEY]["reason"] for dead in broker.dead_letters}
    assert reasons == {"uses_global": "global_rule", "uses_actor": "actor_rule"}


def test_unknown_errors_are_retried_as_dramatiq_does() -> None:
    """A plain bug (KeyError) is retried until max_retries, so a fix deployed meanwhile recovers the job."""
    broker = make_broker(testing=True, max_retries=2)
    calls: list[int] = []

    @dramatiq.actor(broker=broker)
    def buggy() -> None:
        calls.append(1)
        raise KeyError("typo")

    with working(broker) as worker:
        buggy.send()
        settle(broker, worker)

    assert len(calls) == 3
    [dead] = broker.dead_letters
    assert dead.options[RETRY_DECISION_KEY]["category"] == "unknown"
    assert dead.options[RETRY_DECISION_KEY]["outcome"] == "exhausted"


def test_dramatiq_options_keep_their_meaning(http: Callable[..., None]) -> None:
    """retries, traceback and requeue_timestamp are kept on the message as Dramatiq keeps them."""
    broker = make_broker(testing=True, max_retries=1)
    before = current_millis()

    @dramatiq.actor(broker=broker)
    def always_503() -> None:
        http(503)

    with working(broker) as worker:
        always_503.send()
        settle(broker, worker)

    [dead] = broker.dead_letters
    assert dead.options["retries"] == 2
    assert "requests.exceptions.HTTPError: 503" in dead.options["traceback"]
    assert dead.options["requeue_timestamp"] >= before


# --------------------------------------------------------------------------------------------
# Calling the hook directly: delays, deadlines, failure handling
# --------------------------------------------------------------------------------------------


class Recorder:
    """A broker stand-in for one failure: records what the middleware enqueues."""

    def __init__(self, middleware: ClassifiedRetries, actor_options: dict[str, Any] | None = None) -> None:
        self.middleware = middleware
        self.broker = StubBroker(middleware=build_middleware(retries=middleware), fail_fast_default=False)
        self.enqueued: list[tuple[Message[Any], int | None]] = []
        self.sent: list[Any] = []

        @dramatiq.actor(broker=self.broker, actor_name="job", **(actor_options or {}))
        def job() -> None:
            pass

        @dramatiq.actor(broker=self.broker, actor_name="on_exhausted")
        def on_exhausted(message: dict[str, Any], info: dict[str, Any]) -> None:
            pass

        original_enqueue = self.broker.enqueue

        def enqueue(message: Message[Any], *, delay: int | None = None) -> Message[Any]:
            if message.actor_name == "job":
                self.enqueued.append((message, delay))
                return message
            self.sent.append(message)
            return original_enqueue(message, delay=delay)

        self.broker.enqueue = enqueue  # type: ignore[method-assign]

    def fail(
        self,
        exception: BaseException,
        *,
        options: dict[str, Any] | None = None,
        age_ms: int = 0,
    ) -> MessageProxy:
        message: Message[Any] = Message(
            queue_name="default",
            actor_name="job",
            args=(),
            kwargs={},
            options=dict(options or {}),
            message_timestamp=current_millis() - age_ms,
        )
        proxy = MessageProxy(message)
        try:
            raise exception
        except BaseException as error:
            self.middleware.after_process_message(self.broker, proxy, exception=error)
        return proxy

    @property
    def delay(self) -> int | None:
        [(_, delay)] = self.enqueued
        return delay


def real_http_error(http: Callable[..., None], status: int, retry_after: str | None = None) -> BaseException:
    try:
        http(status, retry_after)
    except requests.HTTPError as error:
        return error
    raise AssertionError("no error")


def test_backoff_grows_from_min_backoff_with_the_attempt() -> None:
    """The third attempt's failure waits min_backoff * 4 (jitter off)."""
    recorder = Recorder(ClassifiedRetries(min_backoff=1000, max_backoff=60_000, jitter="none"))
    proxy = recorder.fail(TimeoutError(), options={"retries": 2})
    assert recorder.delay == 4000
    assert proxy.options[RETRY_DECISION_KEY]["delay_ms"] == 4000
    assert proxy.options[RETRY_DECISION_KEY]["attempt"] == 3
    assert proxy.options["retries"] == 3


def test_backoff_options_follow_message_then_actor_then_middleware() -> None:
    """min_backoff/max_backoff come from the message, else the actor, else the middleware."""
    middleware = ClassifiedRetries(min_backoff=1000, max_backoff=60_000, jitter="none")
    recorder = Recorder(middleware, actor_options={"min_backoff": 2000})
    recorder.fail(TimeoutError())
    recorder.fail(TimeoutError(), options={"min_backoff": 3000})
    recorder.fail(TimeoutError(), options={"retries": 10, "max_backoff": 5000})
    assert [delay for _, delay in recorder.enqueued] == [2000, 3000, 5000]


def test_full_jitter_never_goes_below_half_min_backoff() -> None:
    """The default jitter keeps each delay within [min_backoff / 2, ceiling]."""
    recorder = Recorder(ClassifiedRetries(min_backoff=1000, max_backoff=60_000))
    for retries in range(8):
        recorder.fail(TimeoutError(), options={"retries": retries})
    for retries, (_, delay) in enumerate(recorder.enqueued):
        assert delay is not None
        assert 500 <= delay <= min(60_000, 1000 * 2**retries)


def test_deadlocks_retry_within_milliseconds_not_min_backoff() -> None:
    """A deadlock waits at most 250 ms on its first retry even with a 15 s min_backoff."""
    recorder = Recorder(ClassifiedRetries(min_backoff=15_000))
    proxy = recorder.fail(psycopg.errors.DeadlockDetected("deadlock detected"))
    assert recorder.delay is not None
    assert 1 <= recorder.delay <= 250
    assert proxy.options[RETRY_DECISION_KEY]["reason"] == "deadlock"


def test_retry_after_raises_the_delay_to_the_server_floor(http: Callable[..., None]) -> None:
    """A real 429 with Retry-After: 120 waits at least 120 s though the backoff says 1 s."""
    recorder = Recorder(ClassifiedRetries(min_backoff=1000))
    proxy = recorder.fail(real_http_error(http, 429, "120"))
    assert recorder.delay == 120_000
    assert proxy.options[RETRY_DECISION_KEY]["retry_after_ms"] == 120_000


def test_retry_after_beyond_max_retry_after_ms_fails_the_message(
    http: Callable[..., None], seen: list[events.Event]
) -> None:
    """A Retry-After above the cap fails the message with reason retry_after_too_long."""
    recorder = Recorder(ClassifiedRetries(max_retry_after_ms=60_000))
    proxy = recorder.fail(real_http_error(http, 503, "61"))
    assert recorder.enqueued == []
    assert proxy.failed
    assert proxy.options[RETRY_DECISION_KEY]["reason"] == "retry_after_too_long"
    assert proxy.options[RETRY_DECISION_KEY]["http_status"] == 503
    assert [e.reason for e in gave_up_events(seen)] == ["retry_after_too_long"]


def test_dramatiq_retry_delay_is_used_exactly() -> None:
    """raise dramatiq.Retry(delay=1234) waits exactly 1234 ms, as with Dramatiq's Retries."""
    recorder = Recorder(ClassifiedRetries(min_backoff=15_000))
    recorder.fail(dramatiq.Retry(delay=1234))
    assert recorder.delay == 1234


def test_the_deadline_stops_retries_however_many_are_left(seen: list[events.Event]) -> None:
    """A message whose next attempt would start past retry_deadline_ms fails, and counts as exhausted."""
    recorder = Recorder(ClassifiedRetries(min_backoff=1000, jitter="none", retry_deadline_ms=10_000, max_retries=None))
    young = recorder.fail(TimeoutError(), age_ms=1_000)
    old = recorder.fail(TimeoutError(), age_ms=9_500, options={"on_retry_exhausted": "on_exhausted"})
    assert not young.failed
    assert len(recorder.enqueued) == 1
    assert old.failed
    assert old.options[RETRY_DECISION_KEY]["outcome"] == "deadline"
    assert old.options[RETRY_DECISION_KEY]["delay_ms"] == 1000
    assert [message.actor_name for message in recorder.sent] == ["on_exhausted"]
    assert [e.outcome for e in gave_up_events(seen)] == ["deadline"]


def test_the_deadline_can_be_set_per_message() -> None:
    """retry_deadline_ms as a message option applies to that message only."""
    recorder = Recorder(ClassifiedRetries(min_backoff=1000, jitter="none"))
    proxy = recorder.fail(TimeoutError(), age_ms=5_000, options={"retry_deadline_ms": 5_500})
    assert proxy.failed
    assert recorder.enqueued == []


def test_testing_mode_and_no_delays_remove_the_wait() -> None:
    """testing=True and the no_delays() block schedule retries with a delay of 0."""
    testing = Recorder(ClassifiedRetries(min_backoff=60_000, testing=True))
    testing.fail(TimeoutError())
    assert testing.delay == 0

    normal = Recorder(ClassifiedRetries(min_backoff=60_000))
    with no_delays():
        normal.fail(TimeoutError())
    normal.fail(TimeoutError())
    delays = [delay for _, delay in normal.enqueued]
    assert delays[0] == 0
    assert delays[1] is not None and delays[1] >= 30_000


def test_a_rule_that_raises_fails_the_message_instead_of_acking_it(caplog: pytest.LogCaptureFixture) -> None:
    """A broken rule dead-letters the message (failed) and logs why; it is never silently dropped."""

    def broken(exception: BaseException) -> Decision | None:
        raise RuntimeError("rule bug")

    recorder = Recorder(ClassifiedRetries(rules=[broken]))
    with caplog.at_level(logging.ERROR, logger="dramatiq_reliable.retries"):
        proxy = recorder.fail(TimeoutError())
    assert proxy.failed
    assert recorder.enqueued == []
    assert "failing it so it is dead-lettered" in caplog.text


def test_a_failed_retry_enqueue_fails_the_message(seen: list[events.Event]) -> None:
    """If the retry cannot be enqueued the message is failed (dead-lettered), not acked away,
    and the record and event say so instead of claiming a retry."""
    recorder = Recorder(ClassifiedRetries())

    def unreachable(message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        raise ConnectionError("broker down")

    recorder.broker.enqueue = unreachable  # type: ignore[method-assign]
    proxy = recorder.fail(TimeoutError())
    assert proxy.failed
    assert proxy.options[RETRY_DECISION_KEY]["outcome"] == "fail"
    assert proxy.options[RETRY_DECISION_KEY]["reason"] == "retry_error"
    assert retry_events(seen) == []
    assert [(e.outcome, e.reason, e.error_type) for e in gave_up_events(seen)] == [
        ("fail", "retry_error", "TimeoutError")
    ]


def test_a_failing_on_retry_exhausted_callback_keeps_the_exhausted_record(caplog: pytest.LogCaptureFixture) -> None:
    """An unknown on_retry_exhausted actor is logged; the message is still failed as exhausted."""
    recorder = Recorder(ClassifiedRetries(max_retries=0))
    with caplog.at_level(logging.ERROR, logger="dramatiq_reliable.retries"):
        proxy = recorder.fail(TimeoutError(), options={"on_retry_exhausted": "no_such_actor"})
    assert proxy.failed
    assert proxy.options[RETRY_DECISION_KEY]["outcome"] == "exhausted"
    assert "no_such_actor" in caplog.text


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"max_retries": -1}, "-1"),
        ({"max_retries": True}, "True"),
        ({"min_backoff": 0}, "0"),
        ({"min_backoff": -5}, "-5"),
        ({"max_backoff": 1.5}, "1.5"),
        ({"min_backoff": 2000, "max_backoff": 1000}, "max_backoff=1000"),
        ({"max_backoff": 8 * 24 * 3600 * 1000}, "691200000"),
        ({"retry_when": "yes"}, "'yes'"),
        ({"on_retry_exhausted": 3}, "3"),
        ({"jitter": "equal"}, "'equal'"),
        ({"jitter_ratio": 1.5}, "1.5"),
        ({"retry_deadline_ms": 0}, "0"),
        ({"max_retry_after_ms": -1}, "-1"),
        ({"consumer_timeout_ms": 0}, "0"),
        ({"rules": ["nope"]}, "'nope'"),
        ({"testing": "yes"}, "'yes'"),
        ({"record_failures": 1}, "1"),
        ({"failure_retention_ms": 0}, "0"),
    ],
)
def test_bad_arguments_are_rejected_with_the_value_and_the_fix(kwargs: dict[str, Any], shown: str) -> None:
    """Each invalid argument raises ConfigurationError, lowercase, naming the value."""
    with pytest.raises(ConfigurationError) as raised:
        ClassifiedRetries(**kwargs)
    assert shown in str(raised.value)
    assert str(raised.value)[0].islower()


def test_long_backoffs_warn_about_rabbitmq_consumer_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """max_backoff past 30 min logs a warning at construction and at actor declaration; defaults do not."""
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.retries"):
        ClassifiedRetries()
        assert caplog.records == []
        ClassifiedRetries(max_backoff=3_600_000)
        assert "consumer_timeout" in caplog.text
        caplog.clear()
        ClassifiedRetries(max_backoff=3_600_000, consumer_timeout_ms=None)
        assert caplog.records == []

        broker = make_broker()
        dramatiq.actor(broker=broker, actor_name="slow", max_backoff=7_200_000)(lambda: None)
        assert "actor 'slow'" in caplog.text
        assert "consumer_timeout" in caplog.text


def test_build_middleware_replaces_retries_and_keeps_ours_last() -> None:
    """Your middleware first, then Dramatiq's defaults without Retries, then ClassifiedRetries."""

    class Tracing(Middleware):
        pass

    class Idempotency(Middleware):
        pass

    retries = ClassifiedRetries(max_retries=3)
    tracing, idempotency = Tracing(), Idempotency()
    built = build_middleware(retries=retries, middleware=[tracing, idempotency])
    assert [type(m) for m in built] == [
        Tracing,
        Idempotency,
        AgeLimit,
        TimeLimit,
        ShutdownNotifications,
        Callbacks,
        Pipelines,
        ClassifiedRetries,
    ]
    assert built[0] is tracing
    assert built[-1] is retries
    broker = StubBroker(middleware=built)
    assert {"throws", "retry_rules", "retry_deadline_ms", "max_retries"} <= broker.actor_options
    assert not any(isinstance(m, Retries) for m in broker.middleware)


def test_listing_a_default_configures_and_places_it() -> None:
    """An AgeLimit in middleware= replaces the default one, at the position you gave it."""

    class Idempotency(Middleware):
        pass

    age_limit = AgeLimit(max_age=60_000)
    built = build_middleware(middleware=[age_limit, Idempotency()])
    assert [type(m) for m in built] == [
        AgeLimit,
        Idempotency,
        TimeLimit,
        ShutdownNotifications,
        Callbacks,
        Pipelines,
        ClassifiedRetries,
    ]
    assert built[0] is age_limit
    assert build_middleware()[-1].__class__ is ClassifiedRetries


def test_build_middleware_refuses_a_second_retry_middleware() -> None:
    """Passing Retries or another ClassifiedRetries in middleware= is an error, not a silent double retry."""
    with pytest.raises(ConfigurationError, match="retries="):
        build_middleware(middleware=[Retries()])
    with pytest.raises(ConfigurationError, match="retries="):
        build_middleware(middleware=[ClassifiedRetries()])
    with pytest.raises(ConfigurationError, match="not a dramatiq Middleware instance"):
        build_middleware(middleware=[AgeLimit])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("middleware", "message"),
    [
        ([Retries(), ClassifiedRetries()], "dramatiq's Retries"),
        ([ClassifiedRetries(), Callbacks()], "not last"),
        ([AgeLimit()], "0"),
    ],
)
def test_validate_middleware_explains_what_is_wrong(middleware: list[Middleware], message: str) -> None:
    """A list with Dramatiq's Retries, ours not last, or ours missing is rejected."""
    with pytest.raises(ConfigurationError, match=message):
        validate_middleware(middleware)


def test_middleware_without_after_process_hooks_may_follow_classified_retries() -> None:
    """WorkerRelay only runs at worker boot and shutdown, so its place in the list is free."""
    from dramatiq_reliable.outbox import WorkerRelay

    validate_middleware([AgeLimit(), ClassifiedRetries(), WorkerRelay()])


def test_a_worker_on_a_wrong_middleware_list_complains(caplog: pytest.LogCaptureFixture) -> None:
    """Booting a worker with Dramatiq's Retries still present logs a critical error."""
    retries = ClassifiedRetries()
    broker = StubBroker(middleware=[Retries(), retries])
    with caplog.at_level(logging.CRITICAL, logger="dramatiq_reliable.retries"):
        retries.before_worker_boot(broker, Worker(broker))
    assert "dramatiq's Retries" in caplog.text


def test_the_failure_record_is_skipped_on_a_broker_without_postgres() -> None:
    """A StubBroker or RabbitmqBroker has no job_attempts table: record_failure does nothing, raises nothing."""
    from dramatiq.broker import MessageProxy
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.message import Message

    from dramatiq_reliable.jobs.attempts import record_failure

    message = MessageProxy(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
    assert record_failure(StubBroker(), message, RuntimeError("x"), {"attempt": 1, "outcome": "retry"}) is False
