"""Tracing against a real Postgres and RabbitMQ: one trace from the request to the last retry, and true metrics."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Middleware
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from support import Otel

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    SchemaNotReady,
    Unrecoverable,
    WorkerRelay,
    build_middleware,
)
from dramatiq_reliable.testing import drain_outbox, wait_for
from dramatiq_reliable.tracing import TRACE_CONTEXT_KEY, Tracing

pytestmark = pytest.mark.integration


@pytest.fixture
def tracing(otel: Otel) -> Iterator[Tracing]:
    # health_cache_ms=0: every metrics read is a fresh reading, so the test sees what it just did.
    middleware = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider, health_cache_ms=0)
    yield middleware
    middleware.close()


@pytest.fixture
def traced(rabbitmq_url: str, database_url: str, db_schema: str, tracing: Tracing) -> Iterator[OutboxBroker]:
    """An OutboxBroker with Tracing first and, where they exist, DeadLetters, Idempotency and ClassifiedRetries."""
    extras: list[Middleware] = [tracing, DeadLetters(), Idempotency(default_mode="off")]
    middleware = build_middleware(retries=ClassifiedRetries(max_retries=5, testing=True), middleware=extras)
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, middleware=middleware)
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.fixture
def run_worker(traced: OutboxBroker) -> Iterator[Any]:
    """Starts a one-thread worker with an in-process relay; stopped after the test."""
    started: list[dramatiq.Worker] = []

    def start() -> dramatiq.Worker:
        traced.add_middleware(WorkerRelay(poll_interval_ms=50), after=Tracing)  # ClassifiedRetries stays last
        worker = dramatiq.Worker(traced, worker_threads=1, worker_timeout=50)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def roles(span: ReadableSpan) -> dict[str, Any]:
    return {link.attributes["dramatiq_reliable.link.role"]: link.context for link in span.links}


def test_one_trace_from_the_request_through_the_outbox_to_processing(traced, queue_name, otel, run_worker, tracing):
    ran: list[trace.SpanContext] = []

    @dramatiq.actor(broker=traced, queue_name=queue_name)
    def receipt(order_id: int) -> None:
        ran.append(trace.get_current_span().get_span_context())

    request_tracer = otel.tracer_provider.get_tracer("app")
    with request_tracer.start_as_current_span("POST /orders") as request, traced.transaction():
        message = receipt.send(42)
    run_worker()
    wait_for(lambda: otel.spans(f"process {queue_name}"), timeout_ms=20000, message="the message was never processed")

    trace_id = request.get_span_context().trace_id
    (create,) = otel.spans(f"create {queue_name}")
    (process,) = otel.spans(f"process {queue_name}")
    assert create.kind is SpanKind.PRODUCER and create.parent.span_id == request.get_span_context().span_id
    assert create.attributes["messaging.operation.type"] == "create"
    assert create.attributes["messaging.system"] == "rabbitmq"
    assert process.kind is SpanKind.CONSUMER
    assert process.context.trace_id == trace_id == create.context.trace_id
    assert process.parent.span_id == create.context.span_id
    assert roles(process)["creation"].span_id == create.context.span_id
    assert ran == [process.context]
    assert message.options[TRACE_CONTEXT_KEY]["traceparent"].split("-")[1] == format(trace_id, "032x")
    assert otel.total("messaging.client.consumed.messages", **{"messaging.destination.name": queue_name}) == 1
    assert otel.total("messaging.client.operation.duration", **{"messaging.operation.type": "create"}) == 1


def test_the_relay_publish_span_is_in_the_trace_and_linked_to_the_producer_span(traced, queue_name, otel):
    @dramatiq.actor(broker=traced, queue_name=queue_name)
    def receipt() -> None:
        pass

    with traced.transaction():
        message = receipt.send()
    assert drain_outbox(traced) == 1

    (create,) = otel.spans(f"create {queue_name}")
    (send,) = otel.spans(f"send {queue_name}")
    assert send.kind is SpanKind.CLIENT
    assert send.context.trace_id == create.context.trace_id
    assert send.parent.span_id == create.context.span_id
    assert roles(send)["creation"].span_id == create.context.span_id
    assert send.attributes["messaging.message.id"] == message.message_id
    assert send.end_time >= send.start_time >= create.end_time
    assert otel.total("messaging.client.sent.messages", **{"messaging.destination.name": queue_name}) == 1


def test_a_job_failing_twice_then_succeeding_is_one_trace_of_three_linked_attempts(
    traced, queue_name, otel, run_worker
):
    calls: list[int] = []

    @dramatiq.actor(broker=traced, queue_name=queue_name, max_retries=5)
    def charge() -> None:
        calls.append(1)
        if len(calls) <= 2:
            raise ConnectionResetError("payment provider hung up")

    with traced.transaction():
        charge.send()
    run_worker()
    wait_for(lambda: len(otel.spans(f"process {queue_name}")) == 3, timeout_ms=30000, message="three attempts expected")

    attempts = sorted(otel.spans(f"process {queue_name}"), key=lambda span: span.start_time)
    (create,) = otel.spans(f"create {queue_name}")
    assert {span.context.trace_id for span in attempts} == {create.context.trace_id}
    assert [span.status.status_code for span in attempts] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    assert [span.attributes["dramatiq.message.attempt"] for span in attempts] == [1, 2, 3]
    for earlier, later in itertools.pairwise(attempts):
        assert roles(later)["previous_attempt"].span_id == earlier.context.span_id
    for number, failed in enumerate(attempts[:2], start=1):
        assert failed.attributes["error.type"] == "ConnectionResetError"
        assert failed.attributes["dramatiq_reliable.retry.outcome"] == "retry"
        assert failed.attributes["dramatiq_reliable.retry.category"] == "transient"
        assert failed.attributes["dramatiq_reliable.retry.attempt"] == number
        assert failed.attributes["dramatiq_reliable.retry.delay_ms"] == 0
        (event,) = [e for e in failed.events if e.name == "retry.scheduled"]
        assert event.attributes["reason"] == failed.attributes["dramatiq_reliable.retry.reason"]
    # Each retry went through the outbox under the attempt that scheduled it.
    requeues = otel.spans(f"create {queue_name}.DQ")
    assert sorted(span.parent.span_id for span in requeues) == sorted(a.context.span_id for a in attempts[:2])
    assert all(span.context.trace_id == create.context.trace_id for span in otel.spans())
    # The retries waited in the outbox for their backoff: no consumer thread moved them out of a
    # delay queue (no "send <queue>.DQ" hop).
    assert otel.spans(f"send {queue_name}.DQ") == []
    assert " ".join(span.name for span in otel.spans()).count("attempt") == 0

    # The metrics say what happened: three deliveries, two retries, two failed durations.
    dest = {"messaging.destination.name": queue_name}
    assert otel.total("messaging.client.consumed.messages", **dest) == 3
    assert otel.total("dramatiq_reliable.retries", **dest) == 2
    assert otel.total("messaging.process.duration", **dest) == 3
    assert otel.total("messaging.process.duration", **dest, **{"error.type": "ConnectionResetError"}) == 2
    assert otel.total("dramatiq_reliable.dead_lettered") == 0


def test_a_duplicate_and_a_dead_letter_show_their_events_and_gauges_count_them(
    traced, queue_name, otel, run_worker, db, db_schema, tracing
):
    done: list[int] = []

    @dramatiq.actor(
        broker=traced, queue_name=queue_name, idempotency="transactional", idempotency_key=lambda n: f"order-{n}"
    )
    def once(n: int) -> None:
        done.append(n)

    @dramatiq.actor(broker=traced, queue_name=queue_name, actor_name=f"{queue_name}_doomed")
    def doomed() -> None:
        raise Unrecoverable("order 7 does not exist")

    with traced.transaction():
        once.send(1)
    run_worker()
    wait_for(lambda: done == [1], timeout_ms=20000, message="the first run never happened")
    with traced.transaction():
        once.send(1)
        dead = doomed.send()
    wait_for(lambda: len(otel.spans("dead_letter.stored")) == 1, timeout_ms=20000, message="no dead letter stored")
    wait_for(lambda: len(otel.spans(f"process {queue_name}")) == 3, timeout_ms=20000, message="duplicate not processed")

    spans = otel.spans(f"process {queue_name}")
    (duplicate,) = [s for s in spans if s.attributes.get("dramatiq.message.skipped")]
    assert duplicate.attributes["dramatiq_reliable.idempotency.duplicate"] is True
    assert "idempotency.duplicate" in [event.name for event in duplicate.events]
    assert done == [1]
    (died,) = [s for s in spans if s.attributes["messaging.message.id"] == dead.message_id]
    assert died.status.status_code is StatusCode.ERROR
    assert died.attributes["dramatiq_reliable.dead_lettered"] is True
    assert died.attributes["dramatiq_reliable.retry.outcome"] == "fail"
    assert died.attributes["error.type"] == "dramatiq_reliable.Unrecoverable"
    assert "retry.gave_up" in [event.name for event in died.events]
    (stored,) = otel.spans("dead_letter.stored")
    assert stored.parent.span_id == died.context.span_id
    assert stored.events[0].attributes["message_id"] == dead.message_id

    dest = {"messaging.destination.name": queue_name}
    assert otel.total("dramatiq_reliable.duplicates_skipped", **dest) == 1
    assert otel.total("dramatiq_reliable.dead_lettered", **dest) == 1
    assert otel.total("dramatiq_reliable.dead_letters.pending", **dest) == 1
    assert otel.total("dramatiq_reliable.queue.depth", **dest, **{"dramatiq_reliable.queue.kind": "xq"}) == 1


def test_gauges_read_the_outbox_backlog_and_queue_depth(traced, queue_name, otel, db, db_schema, rabbit):
    @dramatiq.actor(broker=traced, queue_name=queue_name)
    def task() -> None:
        pass

    with traced.transaction():
        for _ in range(3):
            task.send()
        task.send_with_options(delay=3_600_000)  # waits in the outbox for its time: no backlog
    dest = {"messaging.destination.name": queue_name}
    assert otel.total("dramatiq_reliable.outbox.backlog", **dest) == 3
    assert otel.total("dramatiq_reliable.outbox.scheduled", **dest) == 1

    def oldest_age_s() -> float:
        """The oldest unpublished row's age now, by the database's clock (the gauge's clock)."""
        query = (
            "SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8 FROM {}.outbox "
            "WHERE published_at IS NULL AND eta IS NULL"
        )
        (age,) = db.execute(psycopg.sql.SQL(query).format(psycopg.sql.Identifier(db_schema))).fetchone()
        return float(age)

    def read_oldest_age_gauge() -> tuple[float, float, float]:
        """The gauge, between the true ages just before and just after it was read (it rounds to 1 ms)."""
        before = oldest_age_s()
        gauge = otel.total("dramatiq_reliable.outbox.oldest_age", **dest)
        return before - 0.001, gauge, oldest_age_s() + 0.001

    low, gauge, high = read_oldest_age_gauge()
    assert low <= gauge <= high
    # Age the rows: the oldest-age gauge follows the oldest row.
    db.execute(
        psycopg.sql.SQL("UPDATE {}.outbox SET created_at = created_at - interval '90 seconds'").format(
            psycopg.sql.Identifier(db_schema)
        )
    )
    low, gauge, high = read_oldest_age_gauge()
    assert 90 <= low <= gauge <= high
    assert drain_outbox(traced) == 3
    assert otel.total("dramatiq_reliable.outbox.backlog", **dest) == 0
    wait_for(lambda: rabbit.count(queue_name) == 3, message="published messages not in RabbitMQ")
    assert otel.total("dramatiq_reliable.queue.depth", **dest, **{"dramatiq_reliable.queue.kind": "ready"}) == 3


def test_no_context_leaks_between_messages_on_the_same_worker_thread(traced, queue_name, otel, run_worker, tracing):
    before_tracing: list[bool] = []

    class Probe(Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            before_tracing.append(trace.get_current_span().get_span_context().is_valid)

    traced.middleware.insert(0, Probe())
    seen: dict[int, int] = {}

    @dramatiq.actor(broker=traced, queue_name=queue_name, max_retries=0)
    def job(n: int) -> None:
        seen[n] = trace.get_current_span().get_span_context().span_id
        if n % 2:
            raise ValueError(n)

    with traced.transaction():
        for n in range(6):
            job.send(n)
    run_worker()
    wait_for(lambda: len(otel.spans(f"process {queue_name}")) == 6, timeout_ms=20000, message="six attempts expected")

    processes = {s.attributes["messaging.message.id"]: s for s in otel.spans(f"process {queue_name}")}
    assert before_tracing == [False] * 6
    assert sorted(seen.values()) == sorted(s.context.span_id for s in processes.values())
    assert len({s.context.trace_id for s in processes.values()}) == 6
    wait_for(lambda: tracing._open_spans() == 0, message="a span was left open")


def test_a_producer_that_never_boots_a_worker_traces_its_sends(traced, queue_name, otel):
    @dramatiq.actor(broker=traced, queue_name=queue_name)
    def task() -> None:
        pass

    with traced.transaction():
        task.send()
    task.send()  # unbound: autocommit
    creates = otel.spans(f"create {queue_name}")
    assert len(creates) == 2
    assert len({span.context.trace_id for span in creates}) == 2
    assert otel.total("messaging.client.sent.messages") == 0  # created, not yet sent


def test_a_failed_outbox_insert_ends_its_create_span_as_an_error(
    rabbitmq_url, database_url, unmigrated_schema, queue_name, tracing, otel
):
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=unmigrated_schema, middleware=[tracing])
    try:
        task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
        with pytest.raises(SchemaNotReady):
            task.send()
    finally:
        broker.close()
    (span,) = otel.spans(f"create {queue_name}")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"].endswith("SchemaNotReady")


def test_postgres_broker_gauges_read_its_queue_table_depth(database_url, db_schema, tracing, otel, queue_name):
    """The gauges of a PostgresBroker read Postgres: its queue depth was once never reported
    (the metrics asked only an OutboxBroker for its database)."""
    from dramatiq_reliable import PostgresBroker

    broker = PostgresBroker(database=database_url, schema=db_schema, middleware=[tracing])
    dramatiq.set_broker(broker)
    try:

        @dramatiq.actor(broker=broker, queue_name=queue_name)
        def task() -> None:
            pass

        for _ in range(2):
            task.send()
        task.send_with_options(delay=3_600_000)
        place = {"messaging.destination.name": queue_name, "messaging.system": "postgresql"}
        assert otel.total("dramatiq_reliable.queue.depth", **place, **{"dramatiq_reliable.queue.kind": "ready"}) == 2
        assert otel.total("dramatiq_reliable.queue.depth", **place, **{"dramatiq_reliable.queue.kind": "delayed"}) == 1
        assert otel.points("dramatiq_reliable.queue.depth") and all(
            point.attributes["messaging.system"] == "postgresql"
            for point in otel.points("dramatiq_reliable.queue.depth")
        ), "no RabbitMQ point for a broker that has no RabbitMQ"
    finally:
        broker.close()
