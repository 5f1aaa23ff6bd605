"""Idempotency fails closed: no error in its before-hook lets the actor run unprotected."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.message import Message
from dramatiq.middleware import MiddlewareError

from dramatiq_reliable import MiddlewareFailed, ReliableError, events
from dramatiq_reliable.idempotency import Idempotency, IdempotencyKeyError, payload_hash
from dramatiq_reliable.idempotency import middleware as idempotency_middleware

UNUSED_URL = "postgresql://nobody@127.0.0.1:1/never_opened"


@pytest.fixture
def broker() -> Iterator[StubBroker]:
    stub = StubBroker()
    stub.add_middleware(Idempotency(database=UNUSED_URL))
    stub.emit_after("process_boot")
    dramatiq.set_broker(stub)
    yield stub
    stub.flush_all()
    stub.close()


@pytest.fixture
def seen() -> Iterator[list[events.Event]]:
    received: list[events.Event] = []
    events.subscribe(received.append)
    yield received
    events.unsubscribe(received.append)


def _run(broker: StubBroker, queue_name: str = "default") -> None:
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        broker.join(queue_name, fail_fast=False, timeout=10_000)
        worker.join()
    finally:
        worker.stop()


def _deliver(broker: StubBroker, message: Message[object]) -> None:
    """Put ``message`` on its queue as another producer would, past our before_enqueue."""
    broker.queues[message.queue_name].put(message.encode())


def test_an_unexpected_error_in_the_check_stops_the_actor_and_the_message_is_retried(broker, monkeypatch):
    def broken(*_: object) -> bytes:
        raise RuntimeError("a bug in the check")

    monkeypatch.setattr(idempotency_middleware, "payload_hash", broken)
    runs: list[int] = []

    @dramatiq.actor(max_retries=1, min_backoff=1, max_backoff=2)
    def task(n: int) -> None:
        runs.append(n)

    task.send(1)
    _run(broker)
    assert runs == [], "the actor ran without its idempotency check"
    (dead,) = broker.dead_letters
    assert dead.options["retries"] == 2  # retried like a failed job, then given up
    assert "MiddlewareFailed" in dead.options["traceback"]
    assert "RuntimeError: a bug in the check" in dead.options["traceback"]


def test_middleware_failed_is_the_kind_of_error_dramatiq_lets_out_of_a_before_hook():
    assert issubclass(MiddlewareFailed, MiddlewareError) and issubclass(MiddlewareFailed, ReliableError)
    assert MiddlewareFailed.__module__ == "dramatiq_reliable"


def test_an_argument_with_a_lone_surrogate_hashes_and_keeps_every_other_hash():
    surrogate = payload_hash(["\ud800x"], {})
    assert surrogate != payload_hash(["\udc00x"], {})
    assert payload_hash(["é"], {"k": 1}) == payload_hash(["é"], {"k": 1})


@pytest.mark.parametrize(
    ("bad", "problem"),
    [("order-\x0042", "contains a NUL character"), ("order-\ud800", "contains a lone surrogate")],
    ids=["nul", "surrogate"],
)
def test_a_key_postgres_cannot_store_is_refused_at_send(broker, bad, problem):
    @dramatiq.actor
    def task(n: int) -> None: ...

    with pytest.raises(IdempotencyKeyError, match=problem):
        task.send_with_options(args=(1,), idempotency_key=bad)
    assert broker.queues["default"].qsize() == 0


@pytest.mark.parametrize(
    ("options", "derive", "problem"),
    [
        ({"idempotency_key": "a\x00b"}, None, "contains a NUL character"),
        ({}, lambda n: f"order-{n}\x00", "contains a NUL character"),
        ({}, lambda n: "\udfff", "contains a lone surrogate"),
    ],
    ids=["message-option-nul", "derived-nul", "derived-surrogate"],
)
def test_a_delivered_key_postgres_cannot_store_fails_the_message_clearly_without_running(
    broker, seen, options, derive, problem
):
    runs: list[int] = []

    @dramatiq.actor(idempotency_key=derive, max_retries=5)
    def task(n: int) -> None:
        runs.append(n)

    _deliver(broker, task.message_with_options(args=(1,), **options))
    _run(broker)
    assert runs == []
    (dead,) = broker.dead_letters
    assert dead.options.get("retries") is None, "a key that cannot be stored must not be retried"
    (invalid,) = [e.as_attributes() for e in seen if e.name == "idempotency.key_invalid"]
    assert problem in invalid["error"] and "Postgres text cannot store" in invalid["error"]
    assert not [e for e in seen if e.name == "idempotency.unavailable"], "reported as an outage"


def test_a_message_id_with_a_nul_is_refused_as_a_key(broker):
    @dramatiq.actor
    def task(n: int) -> None: ...

    message = task.message(1)
    message = message.copy(message_id="id\x00tail")
    with pytest.raises(IdempotencyKeyError, match="message id 'id\\\\x00tail' contains a NUL"):
        next(m for m in broker.middleware if isinstance(m, Idempotency)).job_for(broker, message)
