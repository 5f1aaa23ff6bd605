"""Tracing on a StubBroker and an in-process Worker, exported to the SDK's in-memory exporter: no network."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar
from unittest import mock

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Middleware, Retries, SkipMessage
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from support import Otel

from dramatiq_reliable import ConfigurationError, events
from dramatiq_reliable.retries import ClassifiedRetries
from dramatiq_reliable.tracing import PREVIOUS_ATTEMPT_KEY, TRACE_CONTEXT_KEY, TRACE_ORIGIN_KEY, Tracing


@pytest.fixture
def tracing(otel: Otel) -> Iterator[Tracing]:
    middleware = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    yield middleware
    middleware.close()


def make_broker(tracing: Tracing, *middleware: Middleware, retries: Middleware | None = None) -> StubBroker:
    retry = retries if retries is not None else Retries(min_backoff=1, max_backoff=2)
    broker = StubBroker(middleware=[tracing, *middleware, retry])
    broker.emit_after("process_boot")
    return broker


def run(broker: StubBroker, queue: str = "default") -> None:
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        broker.join(queue, fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def link_roles(span: ReadableSpan) -> dict[str, Any]:
    return {link.attributes["dramatiq_reliable.link.role"]: link.context for link in span.links}


# -- sending and processing -------------------------------------------------------------------------


def test_a_send_and_its_processing_share_one_trace_with_the_producer_span_as_parent(otel, tracing):
    broker = make_broker(tracing)
    seen: list[trace.SpanContext] = []

    @dramatiq.actor(broker=broker)
    def job(x: int) -> None:
        seen.append(trace.get_current_span().get_span_context())

    tracer = otel.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("POST /orders") as request:
        message = job.send(1)
    assert set(message.options[TRACE_CONTEXT_KEY]) >= {"traceparent"}
    run(broker)

    (send,) = otel.spans("send default")
    (process,) = otel.spans("process default")
    assert send.kind is SpanKind.PRODUCER and process.kind is SpanKind.CONSUMER
    assert send.parent.span_id == request.get_span_context().span_id
    assert process.parent.span_id == send.context.span_id
    assert process.context.trace_id == request.get_span_context().trace_id
    assert link_roles(process)["creation"].span_id == send.context.span_id
    # The actor ran inside the process span.
    assert seen == [process.context]
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.destination.name"] == "default"
    assert process.attributes["messaging.message.id"] == message.message_id
    assert process.attributes["dramatiq.message.attempt"] == 1
    assert process.status.status_code is StatusCode.UNSET
    assert send.attributes["messaging.operation.type"] == "send"


@pytest.mark.parametrize("retry_kind", ["dramatiq", "classified"])
def test_a_job_that_fails_twice_has_three_linked_attempts_with_their_retry_decisions(otel, tracing, retry_kind):
    if retry_kind == "classified":
        retries: Middleware = ClassifiedRetries(max_retries=5, testing=True)
    else:
        retries = Retries(min_backoff=1, max_backoff=2)
    broker = make_broker(tracing, retries=retries)
    calls: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=5)
    def flaky() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("upstream timed out")

    message = flaky.send()
    run(broker)

    attempts = sorted(otel.spans("process default"), key=lambda s: s.start_time)
    assert len(attempts) == 3
    assert {span.context.trace_id for span in attempts} == {attempts[0].context.trace_id}
    assert [span.attributes["dramatiq.message.attempt"] for span in attempts] == [1, 2, 3]
    assert [span.status.status_code for span in attempts] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    for earlier, later in itertools.pairwise(attempts):
        assert link_roles(later)["previous_attempt"].span_id == earlier.context.span_id
    for failed in attempts[:2]:
        assert failed.attributes["error.type"] == "TimeoutError"
        assert failed.attributes["dramatiq_reliable.retry.outcome"] == "retry"
        assert isinstance(failed.attributes["dramatiq_reliable.retry.delay_ms"], int)
        assert "retry.scheduled" in [event.name for event in failed.events]
        assert "exception" in [event.name for event in failed.events]
    assert "dramatiq_reliable.retry.outcome" not in attempts[2].attributes
    # The creation context never moved: every attempt is a child of the one producer span.
    (create,) = [s for s in otel.spans("send default") if s.kind is SpanKind.PRODUCER]
    assert create.attributes["messaging.message.id"] == message.message_id
    # Each retry's enqueue is a producer span under the attempt that failed.
    requeues = otel.spans("send default.DQ")
    assert sorted(r.parent.span_id for r in requeues) == sorted(a.context.span_id for a in attempts[:2])
    assert {span.parent.span_id for span in attempts} == {create.context.span_id}
    # The delay-queue hops are CLIENT send spans under the attempt that scheduled them.
    hops = [s for s in otel.spans("send default") if s.kind is SpanKind.CLIENT]
    assert sorted(h.parent.span_id for h in hops) == sorted(a.context.span_id for a in attempts[:2])
    assert otel.total("dramatiq_reliable.retries") == 2
    assert otel.total("messaging.client.consumed.messages") == 3
    assert otel.total("messaging.process.duration", **{"error.type": "TimeoutError"}) == 2
    if retry_kind == "classified":
        assert attempts[0].attributes["dramatiq_reliable.retry.category"] == "transient"
        assert otel.total("dramatiq_reliable.retries", **{"dramatiq_reliable.retry.category": "transient"}) == 2
    assert tracing._open_spans() == 0


def test_a_message_that_fails_for_good_is_marked_dead_lettered_and_later_events_become_child_spans(otel, tracing):
    class StoresDeadLetters(Middleware):
        def before_nack(self, broker: Any, message: Any) -> None:
            events.emit(DeadLetterCaptured(message_id=message.message_id, reason="boom"))

    broker = make_broker(tracing, StoresDeadLetters())

    @dramatiq.actor(broker=broker, max_retries=0)
    def doomed() -> None:
        raise ValueError("bad input")

    doomed.send()
    run(broker)

    (attempt,) = otel.spans("process default")
    assert attempt.attributes["dramatiq_reliable.dead_lettered"] is True
    assert attempt.attributes["error.type"] == "ValueError"
    assert "dead_lettered" in [event.name for event in attempt.events]
    (stored,) = otel.spans("dead_letter.stored")
    assert stored.parent.span_id == attempt.context.span_id
    assert stored.events[0].attributes["reason"] == "boom"
    assert otel.total("dramatiq_reliable.dead_lettered", **{"error.type": "ValueError"}) == 1


@dataclasses.dataclass(frozen=True)
class DeadLetterCaptured(events.Event):
    name: ClassVar[str] = "dead_letter.stored"
    message_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class DuplicateSkipped(events.Event):
    name: ClassVar[str] = "idempotency.duplicate"
    message_id: str
    key: str


def test_a_duplicate_skipped_by_a_middleware_shows_its_event_and_is_counted(otel, tracing):
    class SkipsDuplicates(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            events.emit(DuplicateSkipped(message_id=message.message_id, key="order-1"))
            raise SkipMessage("duplicate")

    broker = make_broker(tracing, SkipsDuplicates())
    ran: list[int] = []

    @dramatiq.actor(broker=broker)
    def once() -> None:
        ran.append(1)

    once.send()
    run(broker)

    (attempt,) = otel.spans("process default")
    assert ran == []
    assert attempt.attributes["dramatiq.message.skipped"] is True
    assert attempt.attributes["dramatiq_reliable.idempotency.duplicate"] is True
    (event,) = [e for e in attempt.events if e.name == "idempotency.duplicate"]
    assert event.attributes["key"] == "order-1"
    assert attempt.status.status_code is StatusCode.UNSET
    assert otel.total("dramatiq_reliable.duplicates_skipped", **{"messaging.destination.name": "default"}) == 1
    assert tracing._open_spans() == 0


def test_a_message_a_middleware_fails_and_skips_is_an_error_named_after_the_skip(otel, tracing):
    class KeyConflict(SkipMessage):
        pass

    class FailsAndSkips(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            message.fail()
            raise KeyConflict("key reused with other arguments")

    broker = make_broker(tracing, FailsAndSkips())

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    job.send()
    run(broker)

    (attempt,) = otel.spans("process default")
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.attributes["error.type"].endswith(".KeyConflict")
    assert attempt.attributes["dramatiq_reliable.dead_lettered"] is True
    assert "exception" in [event.name for event in attempt.events]
    assert otel.total("dramatiq_reliable.dead_lettered") == 1


@dataclasses.dataclass(frozen=True)
class Noted(events.Event):
    """An event with a field that counts how often it is turned into text."""

    name: ClassVar[str] = "custom.noted"
    message_id: str
    detail: object


class Counted:
    conversions: ClassVar[list[int]] = []

    def __str__(self) -> str:
        Counted.conversions.append(1)
        return "counted"


@pytest.mark.parametrize("sampled", [True, False])
def test_event_fields_are_converted_only_when_a_recording_span_takes_them(otel, sampled):
    tracer_provider = otel.tracer_provider if sampled else TracerProvider(sampler=ALWAYS_OFF)
    middleware = Tracing(tracer_provider=tracer_provider, meter_provider=otel.meter_provider, health_metrics=False)

    class Notes(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            events.emit(Noted(message_id=message.message_id, detail=Counted()))
            events.emit(DuplicateSkipped(message_id=message.message_id, key="k"))

    try:
        broker = make_broker(middleware, Notes())

        @dramatiq.actor(broker=broker)
        def job() -> None:
            pass

        Counted.conversions.clear()
        job.send()
        run(broker)
        events.emit(Noted(message_id="not-running-here", detail=Counted()))  # no span on this thread
    finally:
        middleware.close()

    assert len(Counted.conversions) == (1 if sampled else 0)
    # Metrics do not depend on the span recording.
    assert otel.total("dramatiq_reliable.duplicates_skipped", **{"messaging.destination.name": "default"}) == 1
    if sampled:
        (attempt,) = otel.spans("process default")
        (noted,) = [event for event in attempt.events if event.name == "custom.noted"]
        assert noted.attributes["detail"] == "counted"


def test_an_event_with_its_own_as_attributes_lands_on_the_span_of_the_message_it_names(otel, tracing):
    @dataclasses.dataclass(frozen=True)
    class Renamed(events.Event):
        name: ClassVar[str] = "custom.renamed"
        job_id: str

        def as_attributes(self) -> dict[str, Any]:
            return {"message_id": self.job_id, "note": "from as_attributes"}

    class EmitsForAnother(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            events.emit(Renamed(job_id=message.message_id))
            events.emit(Renamed(job_id="another message"))

    broker = make_broker(tracing, EmitsForAnother())

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    job.send()
    run(broker)
    (attempt,) = otel.spans("process default")
    (renamed,) = [event for event in attempt.events if event.name == "custom.renamed"]
    assert renamed.attributes["note"] == "from as_attributes"


# -- context handling ---------------------------------------------------------------------------------


def test_no_context_leaks_between_messages_on_one_worker_thread_even_when_other_hooks_raise(otel, tracing):
    outside: list[bool] = []

    class SeesTheThreadBeforeTracing(Middleware):
        """Placed before Tracing: its before-hook sees the thread as the last message left it."""

        def before_process_message(self, broker: Any, message: Any) -> None:
            outside.append(trace.get_current_span().get_span_context().is_valid)

    class BreaksHooks(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            raise RuntimeError("before-hook bug")  # logged and swallowed by Dramatiq

        def after_process_message(
            self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
        ) -> None:
            raise RuntimeError("after-hook bug")

        def after_skip_message(self, broker: Any, message: Any) -> None:
            raise RuntimeError("after-hook bug")

    class SkipsEveryThird(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            if message.args and message.args[0] % 3 == 0:
                raise SkipMessage("skip")

    broker = StubBroker(
        middleware=[
            SeesTheThreadBeforeTracing(),
            tracing,
            BreaksHooks(),
            SkipsEveryThird(),
            Retries(max_retries=0),
        ]
    )
    inside: dict[int, tuple[int, str]] = {}

    @dramatiq.actor(broker=broker, max_retries=0)
    def probe(n: int) -> None:
        span = trace.get_current_span()
        inside[n] = (span.get_span_context().span_id, threading.current_thread().name)
        # An actor that leaks its own attach must not poison the next message either.
        from opentelemetry import context

        context.attach(trace.set_span_in_context(trace.NonRecordingSpan(span.get_span_context())))
        if n % 2:
            raise KeyError(n)

    for n in range(1, 8):
        probe.send(n)
    with mock.patch.object(logging.getLogger("dramatiq.broker.StubBroker"), "critical"):
        run(broker)

    processes = {span.attributes["messaging.message.id"]: span for span in otel.spans("process default")}
    assert len(processes) == 7
    assert outside == [False] * 7
    assert len({thread for _, thread in inside.values()}) == 1
    assert sorted(inside) == [1, 2, 4, 5, 7]
    own_ids = {span.context.span_id for span in processes.values()}
    assert {span_id for span_id, _ in inside.values()} <= own_ids
    assert tracing._open_spans() == 0
    assert not trace.get_current_span().get_span_context().is_valid


def test_the_creation_context_survives_the_delay_queue_hop(otel, tracing):
    broker = make_broker(tracing)
    contexts: list[Any] = []

    @dramatiq.actor(broker=broker)
    def later() -> None:
        contexts.append(trace.get_current_span().get_span_context())

    message = later.send_with_options(delay=1)
    original = dict(message.options[TRACE_CONTEXT_KEY])
    run(broker)

    (create,) = otel.spans("send default.DQ")
    (hop,) = otel.spans("send default")
    (process,) = otel.spans("process default")
    assert create.kind is SpanKind.PRODUCER and hop.kind is SpanKind.CLIENT
    assert create.attributes["dramatiq.message.delay_ms"] == 1
    assert hop.parent.span_id == create.context.span_id
    assert process.parent.span_id == create.context.span_id
    assert original["traceparent"].split("-")[2] == format(create.context.span_id, "016x")


def test_a_replayed_dead_letter_starts_a_trace_linked_to_the_original(otel, tracing):
    broker = make_broker(tracing)

    @dramatiq.actor(broker=broker)
    def replayed() -> None:
        pass

    tracer = otel.tracer_provider.get_tracer("original")
    with tracer.start_as_current_span("original create") as original:
        carrier: dict[str, str] = {}
        from opentelemetry.propagate import inject

        inject(carrier)
    with tracer.start_as_current_span("last failed attempt") as failed:
        previous: dict[str, str] = {}
        inject(previous)
    message = replayed.message_with_options(
        **{TRACE_CONTEXT_KEY: carrier, PREVIOUS_ATTEMPT_KEY: previous, "replay_of": {"count": 1}}
    )
    broker.enqueue(message)
    run(broker)

    (process,) = otel.spans("process default")
    assert process.context.trace_id != original.get_span_context().trace_id
    roles = link_roles(process)
    assert roles["origin"].span_id == original.get_span_context().span_id
    assert roles["previous_attempt"].span_id == failed.get_span_context().span_id
    assert process.attributes["dramatiq_reliable.replay.count"] == 1


def test_a_replay_that_retries_stays_in_its_new_trace(otel, tracing):
    broker = make_broker(tracing)
    calls: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3)
    def replayed() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError

    tracer = otel.tracer_provider.get_tracer("original")
    with tracer.start_as_current_span("original create") as original:
        carrier: dict[str, str] = {}
        from opentelemetry.propagate import inject

        inject(carrier)
    broker.enqueue(replayed.message_with_options(**{TRACE_CONTEXT_KEY: carrier, "replay_of": {"count": 2}}))
    run(broker)

    first, second = sorted(otel.spans("process default"), key=lambda s: s.start_time)
    assert first.context.trace_id == second.context.trace_id != original.get_span_context().trace_id
    assert second.parent.span_id == first.context.span_id
    assert link_roles(second)["origin"].span_id == original.get_span_context().span_id
    assert "dramatiq_reliable.replay.count" not in second.attributes


def test_a_message_from_an_uninstrumented_producer_gets_a_trace_its_retries_join(otel, tracing):
    broker = make_broker(tracing)
    calls: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3)
    def job() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError

    # Straight onto the queue, as a producer without Tracing would put it.
    broker.queues["default"].put(job.message().encode())
    run(broker)
    first, second = sorted(otel.spans("process default"), key=lambda s: s.start_time)
    assert first.parent is None
    assert first.context.trace_id == second.context.trace_id
    assert second.parent.span_id == first.context.span_id


def test_relay_batches_become_send_spans_in_each_messages_trace(otel, tracing):
    broker = make_broker(tracing)

    @dramatiq.actor(broker=broker, queue_name="orders")
    def job() -> None:
        pass

    message = job.send()
    (create,) = otel.spans("send orders")
    unknown = job.message()
    events.emit(
        BatchPublished(
            schema="s",
            start_time_ns=1_000_000_000,
            end_time_ns=1_250_000_000,
            messages=(
                Relayed(message.message_id, "orders", message.encode(), None),
                Relayed(unknown.message_id, "orders", b"not json", "unroutable: RabbitMQ returned the message"),
            ),
        )
    )
    sends = [s for s in otel.spans("send orders") if s.kind is SpanKind.CLIENT]
    assert len(sends) == 2
    ours = next(s for s in sends if s.attributes["messaging.message.id"] == message.message_id)
    assert ours.parent.span_id == create.context.span_id
    assert link_roles(ours)["creation"].span_id == create.context.span_id
    assert (ours.start_time, ours.end_time) == (1_000_000_000, 1_250_000_000)
    assert ours.attributes["messaging.batch.message_count"] == 2
    assert ours.status.status_code is StatusCode.UNSET
    broken = next(s for s in sends if s.attributes["messaging.message.id"] == unknown.message_id)
    assert broken.parent is None and broken.status.status_code is StatusCode.ERROR
    assert broken.attributes["error.type"] == "unroutable"
    assert otel.total("messaging.client.sent.messages", **{"messaging.destination.name": "orders"}) == 3
    assert otel.total("messaging.client.sent.messages", **{"error.type": "unroutable"}) == 1
    assert otel.total("messaging.client.operation.duration", **{"messaging.operation.type": "send"}) >= 2


@dataclasses.dataclass(frozen=True)
class Relayed:
    message_id: str
    queue_name: str
    body: bytes
    error: str | None


@dataclasses.dataclass(frozen=True)
class BatchPublished(events.Event):
    name: ClassVar[str] = "outbox.batch_published"
    schema: str
    start_time_ns: int
    end_time_ns: int
    messages: tuple[Relayed, ...]


# -- lifecycle and configuration -------------------------------------------------------------------


def test_without_an_sdk_everything_is_a_no_op_and_no_context_is_written():
    middleware = Tracing()  # the global providers: no SDK configured in this test process
    try:
        broker = make_broker(middleware)
        done: list[int] = []

        @dramatiq.actor(broker=broker)
        def job() -> None:
            done.append(1)

        message = job.send()
        run(broker)
        assert done == [1]
        assert TRACE_CONTEXT_KEY not in message.options
        assert TRACE_ORIGIN_KEY not in message.options
        assert middleware._open_spans() == 0
    finally:
        middleware.close()


def test_without_an_sdk_a_carried_context_still_reaches_the_actor():
    """The no-op shortcut is taken only for messages that carry no context: one that does is
    still attached, so an uninstrumented hop passes the remote parent on."""
    middleware = Tracing()  # no SDK configured in this test process
    try:
        broker = make_broker(middleware)
        seen: list[trace.SpanContext] = []

        @dramatiq.actor(broker=broker)
        def job() -> None:
            seen.append(trace.get_current_span().get_span_context())

        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        job.send_with_options(trace_context={"traceparent": parent})
        job.send()
        run(broker)
        assert len(seen) == 2
        assert format(seen[0].trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
        assert not seen[1].is_valid
        assert middleware._open_spans() == 0
    finally:
        middleware.close()


def test_providers_are_flushed_at_worker_shutdown(otel):
    tracer_provider = mock.Mock(wraps=otel.tracer_provider)
    meter_provider = mock.Mock(wraps=otel.meter_provider)
    middleware = Tracing(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        broker = make_broker(middleware)
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
        worker.start()
        worker.stop()
        assert tracer_provider.force_flush.call_count >= 1
        assert meter_provider.force_flush.call_count >= 1
    finally:
        middleware.close()


def test_tracing_placed_after_retries_is_reported_at_worker_boot(otel, caplog):
    middleware = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    try:
        broker = StubBroker(middleware=[Retries(), middleware])
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
        with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.tracing"):
            worker.start()
            worker.stop()
        assert "put it first" in caplog.text
    finally:
        middleware.close()


def test_closing_stops_listening_to_events(otel):
    middleware = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    middleware.close()
    events.emit(BatchPublished(schema="s", start_time_ns=1, end_time_ns=2, messages=(Relayed("m", "q", b"{}", None),)))
    assert otel.spans() == []


def test_a_stub_broker_has_no_health_gauges_and_reading_them_does_nothing(otel, tracing):
    make_broker(tracing)
    assert otel.points("dramatiq_reliable.outbox.backlog") == []


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"tracer_provider": object()}, "tracer_provider must be an OpenTelemetry TracerProvider"),
        ({"meter_provider": "global"}, "meter_provider must be an OpenTelemetry MeterProvider"),
        ({"propagator": 1}, "propagator must be a TextMapPropagator"),
        ({"health_cache_ms": -1}, "health_cache_ms must be an int >= 0"),
        ({"health_metrics": "yes"}, "health_metrics must be True or False"),
    ],
)
def test_tracing_validates_its_arguments(kwargs, fix):
    with pytest.raises(ConfigurationError, match=fix):
        Tracing(**kwargs)


def test_the_conventions_names_match_the_opentelemetry_semantic_conventions_package():
    messaging = pytest.importorskip("opentelemetry.semconv._incubating.attributes.messaging_attributes")
    messaging_metrics = pytest.importorskip("opentelemetry.semconv._incubating.metrics.messaging_metrics")
    from opentelemetry.semconv.attributes import error_attributes, http_attributes

    from dramatiq_reliable.tracing import semconv

    assert semconv.MESSAGING_SYSTEM == messaging.MESSAGING_SYSTEM
    assert semconv.MESSAGING_OPERATION_TYPE == messaging.MESSAGING_OPERATION_TYPE
    assert semconv.MESSAGING_OPERATION_NAME == messaging.MESSAGING_OPERATION_NAME
    assert semconv.MESSAGING_DESTINATION_NAME == messaging.MESSAGING_DESTINATION_NAME
    assert semconv.MESSAGING_MESSAGE_ID == messaging.MESSAGING_MESSAGE_ID
    assert semconv.MESSAGING_MESSAGE_BODY_SIZE == messaging.MESSAGING_MESSAGE_BODY_SIZE
    assert semconv.MESSAGING_BATCH_MESSAGE_COUNT == messaging.MESSAGING_BATCH_MESSAGE_COUNT
    assert semconv.MESSAGING_RABBITMQ_ROUTING_KEY == messaging.MESSAGING_RABBITMQ_DESTINATION_ROUTING_KEY
    assert messaging.MessagingSystemValues.RABBITMQ.value == semconv.SYSTEM_RABBITMQ
    operations = messaging.MessagingOperationTypeValues
    assert (
        operations.CREATE.value,
        operations.SEND.value,
        operations.PROCESS.value,
    ) == (semconv.OPERATION_CREATE, semconv.OPERATION_SEND, semconv.OPERATION_PROCESS)
    assert semconv.ERROR_TYPE == error_attributes.ERROR_TYPE
    assert error_attributes.ErrorTypeValues.OTHER.value == semconv.ERROR_TYPE_OTHER
    assert semconv.HTTP_RESPONSE_STATUS_CODE == http_attributes.HTTP_RESPONSE_STATUS_CODE
    assert semconv.METRIC_CLIENT_SENT_MESSAGES == messaging_metrics.MESSAGING_CLIENT_SENT_MESSAGES
    assert semconv.METRIC_CLIENT_CONSUMED_MESSAGES == messaging_metrics.MESSAGING_CLIENT_CONSUMED_MESSAGES
    assert semconv.METRIC_PROCESS_DURATION == messaging_metrics.MESSAGING_PROCESS_DURATION
    assert semconv.METRIC_CLIENT_OPERATION_DURATION == messaging_metrics.MESSAGING_CLIENT_OPERATION_DURATION


def test_the_tracing_package_keeps_its_import_paths():
    import dramatiq_reliable
    import dramatiq_reliable.tracing as package
    from dramatiq_reliable.tracing.middleware import Tracing as Defined

    assert dramatiq_reliable.Tracing is package.Tracing is Defined
    assert (package.TRACE_CONTEXT_KEY, package.PREVIOUS_ATTEMPT_KEY) == ("trace_context", "trace_previous_attempt")
    assert (package.TRACE_ORIGIN_KEY, package.TRACE_REPLAY_KEY) == ("trace_origin", "trace_replay")


def test_the_console_example_names_the_missing_sdk_and_exits_2():
    example = pathlib.Path(__file__).parents[2] / "examples" / "tracing_console.py"
    # A None entry in sys.modules makes the import fail, as on a plain install without the SDK.
    code = (
        "import runpy, sys; sys.modules['opentelemetry.sdk'] = None; "
        f"runpy.run_path({str(example)!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "this example needs the OpenTelemetry SDK: pip install opentelemetry-sdk"
    ]
