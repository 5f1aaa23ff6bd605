"""Idempotency with the in-memory store under StubBroker: what users get in their own unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Middleware

from dramatiq_reliable import (
    ActorOptionError,
    ConfigurationError,
    DatabaseUnavailable,
    Idempotency,
    IdempotencyConflict,
    IdempotencyKeyError,
    IdempotencyStore,
)
from dramatiq_reliable.testing import InMemoryIdempotencyStore


@pytest.fixture
def store() -> InMemoryIdempotencyStore:
    return InMemoryIdempotencyStore()


@pytest.fixture
def broker(store: InMemoryIdempotencyStore) -> Iterator[StubBroker]:
    broker = StubBroker(middleware=[Idempotency(store=store)])
    broker.emit_after("process_boot")
    dramatiq.set_broker(broker)
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    yield broker
    worker.stop()
    broker.close()


def test_the_in_memory_store_is_an_idempotency_store(store):
    assert isinstance(store, IdempotencyStore)


def test_a_duplicate_is_skipped(broker, store):
    runs: list[int] = []

    @dramatiq.actor(queue_name="default", broker=broker, idempotency_key=lambda n: f"invoice-{n}")
    def invoice(n: int) -> None:
        runs.append(n)

    invoice.send(1)
    broker.join("default", fail_fast=True)
    invoice.send(1)
    invoice.send(2)
    broker.join("default", fail_fast=True)
    assert sorted(runs) == [1, 2]
    assert sorted(store.keys()) == [("invoice", "invoice-1"), ("invoice", "invoice-2")]


def test_a_reused_key_with_other_arguments_is_a_conflict(broker):
    runs: list[tuple[int, int]] = []

    @dramatiq.actor(queue_name="default", broker=broker, idempotency_key=lambda n, amount: f"pay-{n}")
    def pay(n: int, amount: int) -> None:
        runs.append((n, amount))

    pay.send(1, 10)
    broker.join("default", fail_fast=True)
    pay.send(1, 20)
    with pytest.raises(IdempotencyConflict, match="different arguments"):
        broker.join("default", fail_fast=True)
    assert runs == [(1, 10)]


def test_purge_removes_expired_keys_only():
    now = [0.0]
    store = InMemoryIdempotencyStore(clock=lambda: now[0])
    assert store.record(actor_name="a", key="k1", payload_hash=b"h", message_id="m1", retention_s=10)
    assert store.record(actor_name="a", key="k2", payload_hash=b"h", message_id="m2", retention_s=100)
    assert not store.record(actor_name="a", key="k1", payload_hash=b"h", message_id="m3", retention_s=10)
    now[0] = 50.0
    assert store.lookup(actor_name="a", key="k1") is None
    assert store.purge_expired() == 1
    assert store.keys() == [("a", "k2")]
    assert store.lookup(actor_name="a", key="k2") == (b"h", "m2")


def test_transactional_mode_is_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match="default_mode='record'"):
        Idempotency(store=InMemoryIdempotencyStore(), default_mode="transactional")
    with pytest.raises(ConfigurationError, match="not both"):
        Idempotency(store=InMemoryIdempotencyStore(), database="postgresql://x@localhost/x")
    broker = StubBroker(middleware=[Idempotency(store=InMemoryIdempotencyStore())])
    try:
        with pytest.raises(ActorOptionError, match="idempotency='record'"):

            @dramatiq.actor(broker=broker, idempotency="transactional")
            def write() -> None: ...
    finally:
        broker.close()


def test_a_message_asking_for_transactional_mode_fails_without_running(broker):
    runs: list[int] = []

    @dramatiq.actor(queue_name="default", broker=broker)
    def work(n: int) -> None:
        runs.append(n)

    with pytest.raises(IdempotencyKeyError, match="idempotency='record'"):
        work.send_with_options(args=(1,), idempotency="transactional")
    assert runs == []


class _Record(Middleware):
    def __init__(self, seen: list[BaseException]) -> None:
        self.seen = seen

    def after_process_message(self, broker, message, *, result=None, exception=None):
        if exception is not None:
            self.seen.append(exception)


class _BrokenStore(InMemoryIdempotencyStore):
    def lookup(self, *, actor_name: str, key: str) -> None:
        raise OSError("store down")


def test_a_store_that_cannot_be_read_fails_closed():
    broker = StubBroker(middleware=[Idempotency(store=_BrokenStore())])
    broker.emit_after("process_boot")
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    runs: list[int] = []
    try:

        @dramatiq.actor(queue_name="default", broker=broker)
        def work(n: int) -> None:
            runs.append(n)

        seen: list[BaseException] = []
        broker.add_middleware(_Record(seen))
        work.send(1)
        broker.join("default")
        worker.join()
        assert runs == []
        assert [type(e) for e in seen] == [DatabaseUnavailable]
        assert "store down" in str(seen[0])
    finally:
        worker.stop()
        broker.close()
