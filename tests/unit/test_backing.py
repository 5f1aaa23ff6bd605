"""One seam for Postgres-backed brokers: every part finds the database, schema and send target
through ``backing_of``, so a third broker plugs in by meeting the contract.  Needs no service:
a ``Database`` opens its pool only on first use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from dramatiq.brokers.stub import StubBroker
from opentelemetry.sdk.metrics import MeterProvider

from dramatiq_reliable import (
    ConfigurationError,
    Database,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    PostgresBroker,
    PostgresDeadLetterStore,
    Scheduler,
    Singleton,
)
from dramatiq_reliable.backing import Backing, PostgresBacked, backing_of, postgres_backed
from dramatiq_reliable.idempotency.purge import make_purge_actor
from dramatiq_reliable.scheduler import ScheduleRuns
from dramatiq_reliable.tracing.metrics import HealthGauges

URL = "postgresql://nobody@127.0.0.1:1/none"


class ThirdBroker(StubBroker):
    """A broker of someone else's that writes queue rows: it meets the contract and nothing more."""

    sends_to = "queue"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.database = Database(url=URL)
        self.schema = "third"

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:  # pragma: no cover - never opened here
        with self.database.connection() as conn, conn.transaction():
            yield conn


@pytest.fixture
def third() -> Iterator[ThirdBroker]:
    broker = ThirdBroker()
    yield broker
    broker.close()


def test_both_brokers_and_a_third_meet_the_contract(third: ThirdBroker) -> None:
    outbox = OutboxBroker(url="amqp://guest:guest@127.0.0.1:1", database=URL)
    queue = PostgresBroker(database=URL)
    try:
        assert isinstance(outbox, PostgresBacked) and outbox.sends_to == "outbox"
        assert isinstance(queue, PostgresBacked) and queue.sends_to == "queue"
        assert postgres_backed(third) is third
        assert postgres_backed(StubBroker()) is None
    finally:
        queue.close()


def test_backing_of_shares_the_brokers_pool_and_schema(third: ThirdBroker) -> None:
    assert backing_of(third, needed_by="x") == Backing(third.database, "third", "queue", third)


def test_a_part_given_its_own_database_keeps_the_brokers_schema_and_target(third: ThirdBroker) -> None:
    own = Database(url=URL)
    backing = backing_of(third, needed_by="x", database=own)
    assert (backing.database, backing.schema, backing.sends_to) == (own, "third", "queue")
    assert backing_of(third, needed_by="x", schema="other").schema == "other"


def test_a_broker_without_postgres_needs_database_and_the_error_says_so() -> None:
    with pytest.raises(ConfigurationError, match=r"DeadLetters has no database on a StubBroker; pass database="):
        backing_of(StubBroker(), needed_by="DeadLetters")
    backing = backing_of(StubBroker(), needed_by="x", database=Database(url=URL))
    assert (backing.schema, backing.sends_to, backing.broker) == ("dramatiq_reliable", "outbox", None)


def test_a_declared_target_outside_the_two_tables_is_not_postgres_backed(third: ThirdBroker) -> None:
    third.sends_to = "kafka"  # type: ignore[assignment]
    assert postgres_backed(third) is None


def test_every_part_that_needs_postgres_finds_the_third_brokers(third: ThirdBroker) -> None:
    idempotency, singleton, dead_letters = Idempotency(), Singleton(), DeadLetters()
    assert idempotency.database_for(third) == (third.database, "third")
    assert singleton.database_for(third) == (third.database, "third")
    store = dead_letters.store(third)
    assert isinstance(store, PostgresDeadLetterStore)
    assert (store.database, store.schema, store.replay_to) == (third.database, "third", "queue")
    from_broker = PostgresDeadLetterStore.from_broker(third)
    assert (from_broker.database, from_broker.schema, from_broker.replay_to) == (third.database, "third", "queue")
    scheduler = Scheduler.from_broker(third)
    assert (scheduler.database, scheduler.schema, scheduler.target) == (third.database, "third", "queue")
    assert ScheduleRuns()._target(third) == (third.database, "third")


def test_the_purge_actor_shares_the_third_brokers_database(third: ThirdBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, str]] = []
    monkeypatch.setattr(
        "dramatiq_reliable.idempotency.purge.purge_expired",
        lambda database, *, schema, batch_size: calls.append((database, schema)) or 0,
    )
    actor = make_purge_actor(third)
    actor.fn()
    assert calls == [(third.database, "third")]


def test_the_health_gauges_read_postgres_for_every_postgres_backed_broker(third: ThirdBroker) -> None:
    # tracing/metrics.py once asked only for OutboxBroker: PostgresBroker's gauges read no database.
    queue = PostgresBroker(database=URL, schema="pgb")
    try:
        for broker, schema in ((queue, "pgb"), (third, "third")):
            gauges = HealthGauges(
                MeterProvider().get_meter("test"), broker=lambda b=broker: b, queue_depth=False, cache_ms=0
            )
            monitor = gauges._build_monitor(broker)
            assert monitor is not None and monitor.database is broker.database and monitor.schema == schema
    finally:
        queue.close()


def test_the_web_page_takes_database_schema_and_target_from_the_third_broker(third: ThirdBroker) -> None:
    pytest.importorskip("starlette")
    from dramatiq_reliable.web import create_app

    app = create_app(broker=third)
    settings = app.state.settings
    assert (settings.schema, settings.target) == ("third", "queue")


def test_the_web_page_refuses_a_broker_without_postgres() -> None:
    pytest.importorskip("starlette")
    from dramatiq_reliable.web import create_app

    with pytest.raises(ConfigurationError, match="Postgres-backed broker"):
        create_app(broker=StubBroker())
