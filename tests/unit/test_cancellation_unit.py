"""Cancellation without a database: JobCancelled is final but not a failure, and the check fails closed."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import dramatiq.broker
import pytest

from dramatiq_reliable import (
    Cancellation,
    ClassifiedRetries,
    Database,
    DatabaseUnavailable,
    JobCancelled,
    NoCurrentJob,
    build_middleware,
    check_cancelled,
    is_cancelled,
)
from dramatiq_reliable.testing import InMemoryBroker

UNUSED_URL = "postgresql://nobody@127.0.0.1:1/never_opened?connect_timeout=1"


@pytest.fixture
def broker() -> Iterator[InMemoryBroker]:
    """The plugin's in-memory broker with the production middleware; ``drain()`` runs the jobs in the test's thread."""
    stub = InMemoryBroker(
        middleware=build_middleware(retries=ClassifiedRetries(max_retries=3, min_backoff=1, max_backoff=2))
    )
    previous = dramatiq.broker.global_broker
    dramatiq.set_broker(stub)
    yield stub
    dramatiq.broker.global_broker = previous  # a later test's reliable_broker must not find this one
    stub.close()


def test_job_cancelled_is_acked_never_retried_nor_dead_lettered(broker: InMemoryBroker) -> None:
    runs: list[int] = []

    @dramatiq.actor(broker=broker)
    def long_job() -> None:
        runs.append(1)
        raise JobCancelled("job x was cancelled while it ran")

    message = long_job.send()
    with pytest.raises(JobCancelled):
        broker.drain()
    assert broker.drain() == 0, "a cancelled job was retried"
    assert runs == [1]
    assert broker.dead_letters == []
    assert "retries" not in message.options


def test_the_check_fails_closed_when_postgres_is_unreachable(broker: InMemoryBroker) -> None:
    unreachable = Database(url=UNUSED_URL, timeout_ms=300)
    broker.add_middleware(Cancellation(database=unreachable), before=ClassifiedRetries)
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def task() -> None:
        runs.append(1)

    task.send()
    with pytest.raises(DatabaseUnavailable):
        broker.drain()
    assert runs == [], "the actor ran without its cancellation check"
    (dead,) = broker.dead_letters
    assert "DatabaseUnavailable" in dead.options["traceback"]
    unreachable.close()


def test_is_cancelled_outside_a_job_names_the_fix() -> None:
    with pytest.raises(NoCurrentJob, match="Cancellation"):
        is_cancelled()
    with pytest.raises(NoCurrentJob):
        check_cancelled()
    assert issubclass(DatabaseUnavailable, dramatiq.middleware.MiddlewareError)


def test_the_check_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="check_interval_ms"):
        Cancellation(database=UNUSED_URL, check_interval_ms=-1)
    with pytest.raises(ValueError, match="check_interval_ms"):
        Cancellation(database=UNUSED_URL, check_interval_ms=True)  # type: ignore[arg-type]
