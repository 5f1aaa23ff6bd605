"""Idempotency with the in-memory store under the plugin's InMemoryBroker: what users get in their own unit tests."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_reliable import (
    ActorOptionError,
    ConfigurationError,
    DatabaseUnavailable,
    Idempotency,
    IdempotencyConflict,
    IdempotencyKeyError,
    IdempotencyStore,
)
from dramatiq_reliable.testing import InMemoryBroker, InMemoryIdempotencyStore


@pytest.fixture
def store(reliable_idempotency_store: InMemoryIdempotencyStore) -> InMemoryIdempotencyStore:
    return reliable_idempotency_store


@pytest.fixture
def broker(reliable_broker: InMemoryBroker) -> InMemoryBroker:
    """The plugin's in-memory broker: Idempotency on ``store``; jobs run by ``drain()`` in the test's thread."""
    return reliable_broker


def test_the_in_memory_store_is_an_idempotency_store(store):
    assert isinstance(store, IdempotencyStore)


def test_a_duplicate_is_skipped(broker, store):
    runs: list[int] = []

    @dramatiq.actor(queue_name="default", broker=broker, idempotency_key=lambda n: f"invoice-{n}")
    def invoice(n: int) -> None:
        runs.append(n)

    invoice.send(1)
    broker.drain()
    invoice.send(1)
    invoice.send(2)
    assert broker.drain() == 2
    assert runs == [1, 2]
    assert sorted(store.keys()) == [("invoice", "invoice-1"), ("invoice", "invoice-2")]


def test_a_reused_key_with_other_arguments_is_a_conflict(broker):
    runs: list[tuple[int, int]] = []

    @dramatiq.actor(queue_name="default", broker=broker, idempotency_key=lambda n, amount: f"pay-{n}")
    def pay(n: int, amount: int) -> None:
        runs.append((n, amount))

    pay.send(1, 10)
    broker.drain()
    pay.send(1, 20)
    with pytest.raises(IdempotencyConflict, match="different arguments"):
        broker.drain()
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


class _BrokenStore(InMemoryIdempotencyStore):
    def lookup(self, *, actor_name: str, key: str) -> None:
        raise OSError("store down")


def test_a_store_that_cannot_be_read_fails_closed():
    broker = InMemoryBroker(middleware=[Idempotency(store=_BrokenStore())])
    runs: list[int] = []
    try:

        @dramatiq.actor(queue_name="default", broker=broker)
        def work(n: int) -> None:
            runs.append(n)

        work.send(1)
        with pytest.raises(DatabaseUnavailable, match="store down"):
            broker.drain()
        assert runs == []
    finally:
        broker.close()
