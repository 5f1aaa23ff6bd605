"""Order and concurrency per key without services: options, keys and middleware order are checked up front."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.message import Message

from dramatiq_reliable import ActorOptionError, ConfigurationError, Database
from dramatiq_reliable.dedupe import DedupeOptions
from dramatiq_reliable.flow import ConcurrencyLimit, OrderedKeys
from dramatiq_reliable.flow._keyed import derive_key

# Never opened: a test that reached Postgres would fail on this closed port.
URL = "postgresql://postgres@127.0.0.1:9/postgres"


@pytest.fixture
def stub() -> Iterator[StubBroker]:
    broker = StubBroker()
    database = Database(url=URL, timeout_ms=100)
    broker.add_middleware(DedupeOptions())
    broker.add_middleware(ConcurrencyLimit(database=database))
    broker.add_middleware(OrderedKeys(database=database))
    yield broker
    broker.close()


@pytest.mark.parametrize("middleware", [ConcurrencyLimit, OrderedKeys])
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lease_ms": 0}, r"lease_ms must be an int >= 300"),
        ({"lease_ms": "30s"}, r"lease_ms must be an int"),
        ({"schema": ""}, r"schema must be a non-empty string"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(middleware: Any, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        middleware(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"order_key": "account"}, r"actor 'job': order_key must be a callable .* got 'account'; write e\.g\."),
        (
            {"order_key": lambda n: str(n), "dedupe_key": lambda n: str(n)},
            r"actor 'job' has both order_key and dedupe_key; .* remove one of them",
        ),
        ({"concurrency_limit": 0}, r"actor 'job': concurrency_limit must be an int >= 1, got 0"),
        ({"concurrency_limit": True}, r"concurrency_limit must be an int >= 1, got True"),
        ({"concurrency_limit": "5"}, r"concurrency_limit must be an int >= 1, got '5'"),
        ({"concurrency_limit": 2, "concurrency_limit_key": "tenant"}, r"concurrency_limit_key must be a callable"),
        ({"concurrency_limit_key": lambda n: str(n)}, r"sets concurrency_limit_key but no concurrency_limit"),
    ],
)
def test_bad_actor_options_fail_at_declaration(stub: StubBroker, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ActorOptionError, match=match):
        dramatiq.actor(lambda n: None, actor_name="job", broker=stub, **options)


@pytest.mark.parametrize("option", [{"order_key": lambda n: str(n)}, {"concurrency_limit": 3}])
def test_a_broker_without_postgres_is_refused_at_declaration(option: dict[str, Any]) -> None:
    broker = StubBroker()
    broker.add_middleware(ConcurrencyLimit())
    broker.add_middleware(OrderedKeys())
    with pytest.raises(ActorOptionError, match=r"has no database on a StubBroker; pass database="):
        dramatiq.actor(lambda n: None, actor_name="job", broker=broker, **option)


def _message(*args: Any) -> Message[Any]:
    return Message(queue_name="default", actor_name="sync", args=args, kwargs={}, options={})


def test_a_key_function_that_raises_or_gives_no_string_fails_closed_naming_the_actor() -> None:
    with pytest.raises(ActorOptionError, match=r"of actor 'sync': order_key raised KeyError: 'x'; the job was not run"):
        derive_key(lambda n: {}["x"], "order_key", _message(1))
    for bad in (42, "", None, "x" * 1001, "a\x00b"):
        with pytest.raises(ActorOptionError, match=r"of actor 'sync': order_key gave .*, not a non-empty string"):
            derive_key(lambda n, bad=bad: bad, "order_key", _message(1))
    assert derive_key(lambda n: f"acct-{n}", "order_key", _message(7)) == "acct-7"


def test_order_after_a_middleware_that_postpones_is_required_at_worker_boot() -> None:
    broker = StubBroker()
    database = Database(url=URL, timeout_ms=100)
    broker.add_middleware(OrderedKeys(database=database))
    broker.add_middleware(ConcurrencyLimit(database=database))
    with pytest.raises(ActorOptionError, match=r"ConcurrencyLimit comes after OrderedKeys .* add OrderedKeys after"):
        dramatiq.actor(lambda n: None, actor_name="job", broker=broker, order_key=lambda n: str(n))
    with pytest.raises(ActorOptionError, match=r"ConcurrencyLimit comes after OrderedKeys"):
        broker.emit_before("worker_boot", None)
