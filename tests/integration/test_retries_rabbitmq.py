"""ClassifiedRetries on a real RabbitMQ: real delays through the .DQ queue, real dead-lettering to .XQ.

Each test gets its own queue (deleted with its .DQ and .XQ afterwards), a plain
``RabbitmqBroker`` built with ``build_middleware`` and an in-process worker.  The actors call a
local HTTP server to get real ``requests`` errors.  Conditions are polled, never slept on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import xq_name
from support import Rabbit

from dramatiq_reliable import events
from dramatiq_reliable.errors import Unrecoverable
from dramatiq_reliable.retries import ClassifiedRetries, RetryGaveUp, RetryScheduled, build_middleware
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@dataclass
class Run:
    """Wall-clock start and end (time.time(), the clock etas use) of one attempt."""

    started: float
    ended: float = 0.0


@dataclass
class Rig:
    broker: RabbitmqBroker
    queue: str
    rabbit: Rabbit
    runs: list[Run] = field(default_factory=list)
    events: list[events.Event] = field(default_factory=list)

    def scheduled(self) -> list[RetryScheduled]:
        return [e for e in self.events if isinstance(e, RetryScheduled) and e.queue_name == self.queue]

    def gave_up(self) -> list[RetryGaveUp]:
        return [e for e in self.events if isinstance(e, RetryGaveUp) and e.queue_name == self.queue]

    def dead_lettered(self) -> int:
        return self.rabbit.count(xq_name(self.queue))


@pytest.fixture
def start(rabbitmq_url: str, queue_name: str, rabbit: Rabbit) -> Iterator[Callable[..., tuple[Rig, Any]]]:
    """``start(retries, body, **actor_options)`` declares an actor running ``body(attempt)`` on the
    test's queue and starts a worker; both are stopped at teardown, before the queues are deleted."""
    started: list[tuple[dramatiq.Worker, RabbitmqBroker, Callable[[events.Event], None]]] = []

    def start_rig(retries: ClassifiedRetries, body: Callable[[int], None], **actor_options: Any) -> tuple[Rig, Any]:
        broker = RabbitmqBroker(url=rabbitmq_url, middleware=build_middleware(retries=retries))
        rig = Rig(broker=broker, queue=queue_name, rabbit=rabbit)

        def job() -> None:
            run = Run(started=time.time())
            rig.runs.append(run)
            try:
                body(len(rig.runs))
            finally:
                run.ended = time.time()

        actor = dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"job_{queue_name}", **actor_options)(
            job
        )
        events.subscribe(rig.events.append)
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        worker.start()
        started.append((worker, broker, rig.events.append))
        return rig, actor

    yield start_rig
    for worker, broker, listener in started:
        worker.stop()
        broker.close()
        events.unsubscribe(listener)


def test_a_503_twice_then_success_runs_three_times_with_growing_delays(
    start: Callable[..., tuple[Rig, Any]], http: Callable[..., None]
) -> None:
    """Two real 503s are retried 300 ms then 600 ms later (no jitter), and the third run succeeds."""

    def body(attempt: int) -> None:
        http(503 if attempt < 3 else 200)

    rig, actor = start(ClassifiedRetries(min_backoff=300, max_backoff=10_000, jitter="none"), body)
    actor.send()
    wait_for(lambda: len(rig.runs) == 3 and rig.runs[2].ended > 0, timeout_ms=15_000, message="three runs")

    assert [(e.attempt, e.reason, e.delay_ms) for e in rig.scheduled()] == [(1, "http_503", 300), (2, "http_503", 600)]
    first_gap = rig.runs[1].started - rig.runs[0].ended
    second_gap = rig.runs[2].started - rig.runs[1].ended
    assert first_gap >= 0.3
    assert second_gap >= 0.6
    assert second_gap > first_gap
    assert rig.gave_up() == []
    assert rig.dead_lettered() == 0


def test_a_404_runs_once_and_is_dead_lettered(start: Callable[..., tuple[Rig, Any]], http: Callable[..., None]) -> None:
    """A real 404 is not retried: one run, then the message is in the .XQ queue."""
    rig, actor = start(ClassifiedRetries(min_backoff=100), lambda attempt: http(404), max_retries=10)
    actor.send()
    wait_for(lambda: rig.dead_lettered() == 1, timeout_ms=15_000, message="the message in .XQ")

    assert len(rig.runs) == 1
    assert rig.scheduled() == []
    [gave_up] = rig.gave_up()
    assert (gave_up.outcome, gave_up.reason, gave_up.http_status) == ("fail", "http_404", 404)


def test_a_429_with_retry_after_is_not_retried_before_it(
    start: Callable[..., tuple[Rig, Any]], http: Callable[..., None]
) -> None:
    """Retry-After: 2 holds the retry for at least two seconds although the backoff says 100 ms."""

    def body(attempt: int) -> None:
        http(429 if attempt == 1 else 200, "2")

    rig, actor = start(ClassifiedRetries(min_backoff=100, jitter="none"), body)
    actor.send()
    wait_for(lambda: len(rig.runs) == 2, timeout_ms=15_000, message="the retry")

    [scheduled] = rig.scheduled()
    assert (scheduled.reason, scheduled.delay_ms) == ("http_429", 2000)
    assert rig.runs[1].started - rig.runs[0].ended >= 1.999  # etas are whole milliseconds


def test_unrecoverable_is_never_retried(start: Callable[..., tuple[Rig, Any]]) -> None:
    """Unrecoverable ends in .XQ after one run, whatever max_retries allows."""

    def body(attempt: int) -> None:
        raise Unrecoverable("the order was deleted")

    rig, actor = start(ClassifiedRetries(min_backoff=100), body, max_retries=10)
    actor.send()
    wait_for(lambda: rig.dead_lettered() == 1, timeout_ms=15_000, message="the message in .XQ")

    assert len(rig.runs) == 1
    assert [(e.outcome, e.reason) for e in rig.gave_up()] == [("fail", "unrecoverable")]


def test_max_retries_stops_retrying(start: Callable[..., tuple[Rig, Any]], http: Callable[..., None]) -> None:
    """With max_retries=2 an endless 503 runs three times, then is dead-lettered as exhausted."""
    rig, actor = start(ClassifiedRetries(min_backoff=100, jitter="none"), lambda attempt: http(503), max_retries=2)
    actor.send()
    wait_for(lambda: rig.dead_lettered() == 1, timeout_ms=15_000, message="the message in .XQ")

    assert len(rig.runs) == 3
    assert [e.delay_ms for e in rig.scheduled()] == [100, 200]
    assert [(e.outcome, e.attempt) for e in rig.gave_up()] == [("exhausted", 3)]


def test_the_age_deadline_stops_retrying_with_retries_left(
    start: Callable[..., tuple[Rig, Any]], http: Callable[..., None]
) -> None:
    """With no max_retries, retry_deadline_ms=2000 ends retrying: no run starts after the deadline."""
    retries = ClassifiedRetries(min_backoff=500, jitter="none", max_retries=None, retry_deadline_ms=2000)
    rig, actor = start(retries, lambda attempt: http(503))
    message = actor.send()
    wait_for(lambda: rig.dead_lettered() == 1, timeout_ms=15_000, message="the message in .XQ")

    deadline = message.message_timestamp / 1000 + 2.0
    assert len(rig.runs) >= 2
    assert all(run.started <= deadline for run in rig.runs)
    [gave_up] = rig.gave_up()
    assert (gave_up.outcome, gave_up.reason, gave_up.attempt) == ("deadline", "http_503", len(rig.runs))
