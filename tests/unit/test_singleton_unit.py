"""Singleton without services: its configuration, actor options and keys are checked up front."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import SkipMessage

from dramatiq_reliable import ActorOptionError, ConfigurationError, Database, Idempotency, MiddlewareFailed
from dramatiq_reliable.idempotency.context import pending_in_transaction
from dramatiq_reliable.singleton import Singleton, current_lease
from dramatiq_reliable.testing import InMemoryIdempotencyStore

# Never opened: a test that reached Postgres would fail on this closed port.
URL = "postgresql://postgres@127.0.0.1:9/postgres"


@pytest.fixture
def stub() -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.add_middleware(Singleton(database=Database(url=URL, timeout_ms=100)))
    yield broker
    broker.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lease_ms": 0}, r"lease_ms must be an int >= 300"),
        ({"lease_ms": True}, r"lease_ms must be an int"),
        ({"retry_delay_ms": -1}, r"retry_delay_ms must be an int >= 0"),
        ({"when_held": "wait"}, r"when_held must be one of \('skip', 'retry', 'buffer'\), got 'wait'"),
        ({"schema": ""}, r"schema must be a non-empty string"),
        ({"job_transaction": "yes"}, r"job_transaction must be True or False, got 'yes'"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Singleton(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"singleton": "yes"}, r"singleton must be True or False, got 'yes'"),
        ({"concurrency_key": "nightly"}, r"concurrency_key must be a callable .* got 'nightly'"),
        ({"singleton": False, "concurrency_key": lambda: "k"}, r"singleton=False and a concurrency_key"),
        ({"singleton": True, "singleton_when_held": "block"}, r"singleton_when_held must be one of"),
        ({"singleton": True, "singleton_retry_delay_ms": -5}, r"singleton_retry_delay_ms must be an int >= 0"),
        ({"singleton_when_held": "skip"}, r"is no singleton; add singleton=True or a concurrency_key"),
    ],
)
def test_bad_actor_options_are_refused_at_declaration(stub: StubBroker, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ActorOptionError, match=match):
        dramatiq.actor(lambda *a: None, actor_name="bad", broker=stub, **options)


def test_a_singleton_on_a_broker_without_a_database_asks_for_one() -> None:
    broker = StubBroker()
    broker.add_middleware(Singleton())
    with pytest.raises(ActorOptionError, match=r"Singleton has no database on a StubBroker; pass database="):
        dramatiq.actor(lambda: None, actor_name="lonely", broker=broker, singleton=True)


def test_the_key_is_the_actor_name_or_what_the_key_function_returns(stub: StubBroker) -> None:
    middleware = next(m for m in stub.middleware if isinstance(m, Singleton))
    named = dramatiq.actor(lambda: None, actor_name="nightly", broker=stub, singleton=True)
    keyed = dramatiq.actor(lambda account: None, actor_name="sync", broker=stub, concurrency_key=lambda a: f"s-{a}")
    plain = dramatiq.actor(lambda: None, actor_name="plain", broker=stub)
    assert middleware.key_for(named, named.message()) == "nightly"
    assert middleware.key_for(keyed, keyed.message(42)) == "s-42"
    assert middleware.key_for(plain, plain.message()) is None


@pytest.mark.parametrize(
    ("derive", "match"),
    [
        (lambda account: 1 / 0, r"concurrency_key raised ZeroDivisionError: division by zero; fix the key function"),
        (lambda account: account, r"concurrency_key gave 7, not a non-empty string"),
        (lambda account: "", r"concurrency_key gave '', not a non-empty string"),
    ],
)
def test_a_key_function_that_fails_dead_letters_the_message_unrun(stub: StubBroker, derive: Any, match: str) -> None:
    middleware = next(m for m in stub.middleware if isinstance(m, Singleton))
    actor = dramatiq.actor(lambda account: None, actor_name="sync", broker=stub, concurrency_key=derive)
    with pytest.raises(ActorOptionError, match=match):
        middleware.key_for(actor, actor.message(7))
    proxy = MessageProxy(actor.message(7))
    with pytest.raises(SkipMessage, match=match):
        middleware.before_process_message(stub, proxy)
    assert proxy.failed
    assert current_lease() is None


def test_an_actor_that_is_no_singleton_never_touches_postgres(stub: StubBroker) -> None:
    middleware = next(m for m in stub.middleware if isinstance(m, Singleton))
    plain = dramatiq.actor(lambda: None, actor_name="plain", broker=stub)
    proxy = MessageProxy(plain.message())
    middleware.before_process_message(stub, proxy)  # the closed port would raise DatabaseUnavailable
    middleware.after_process_message(stub, proxy)
    assert current_lease() is None
    assert not proxy.failed


def test_a_request_for_the_job_transaction_fails_closed_when_the_job_has_none() -> None:
    # Singleton counts on it to hold the key: an actor it would run unprotected must not run.
    broker = StubBroker()
    idempotency = Idempotency(store=InMemoryIdempotencyStore())
    broker.add_middleware(idempotency)
    actor = dramatiq.actor(lambda: None, actor_name="recorded", broker=broker)
    pending_in_transaction.set(lambda conn: None)
    try:
        with pytest.raises(MiddlewareFailed, match="expected to run in a job transaction, but its idempotency mode"):
            idempotency.before_process_message(broker, MessageProxy(actor.message()))
        assert pending_in_transaction.get() is None  # taken, never left for the next message
    finally:
        pending_in_transaction.set(None)
        broker.close()
