"""Idempotency without a database: key derivation, option validation and external keys."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Callbacks, MiddlewareError, SkipMessage
from hypothesis import given
from hypothesis import strategies as st
from psycopg_pool import ConnectionPool

from dramatiq_reliable.errors import ConfigurationError, DatabaseUnavailable, ReliableError
from dramatiq_reliable.idempotency import (
    ActorOptionError,
    Idempotency,
    IdempotencyConflict,
    IdempotencyKeyError,
    Job,
    NoCurrentJob,
    current_job,
    external_key,
    job_connection,
    make_purge_actor,
    payload_hash,
)
from dramatiq_reliable.testing import InMemoryIdempotencyStore

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


def _middleware(broker: StubBroker) -> Idempotency:
    return next(m for m in broker.middleware if isinstance(m, Idempotency))


def _run(broker: StubBroker, queue_name: str = "default") -> None:
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        broker.join(queue_name, fail_fast=False, timeout=10_000)
        worker.join()
    finally:
        worker.stop()


# -- keys ---------------------------------------------------------------------------------------


def test_default_key_is_the_message_id_and_survives_a_retry(broker):
    @dramatiq.actor
    def task(n: int) -> None: ...

    message = task.message(1)
    job = _middleware(broker).job_for(broker, message)
    retried = message.copy(options={"retries": 3, "eta": 1})
    assert job == Job("task", message.message_id, "transactional", message.message_id)
    assert _middleware(broker).job_for(broker, retried) == job


def test_business_key_makes_two_sends_of_one_operation_share_a_key(broker):
    @dramatiq.actor(idempotency_key=lambda order_id, currency="EUR": f"invoice-{order_id}-{currency}")
    def issue_invoice(order_id: int, currency: str = "EUR") -> None: ...

    middleware = _middleware(broker)
    first = middleware.job_for(broker, issue_invoice.message(42))
    second = middleware.job_for(broker, issue_invoice.message_with_options(kwargs={"order_id": 42}))
    assert first is not None and second is not None
    assert first.key == second.key == "invoice-42-EUR"
    assert first.message_id != second.message_id


def test_keys_are_namespaced_by_actor(broker):
    @dramatiq.actor(idempotency_key=lambda n: f"k-{n}")
    def one(n: int) -> None: ...

    @dramatiq.actor(idempotency_key=lambda n: f"k-{n}")
    def two(n: int) -> None: ...

    middleware = _middleware(broker)
    a, b = middleware.job_for(broker, one.message(1)), middleware.job_for(broker, two.message(1))
    assert a is not None and b is not None
    assert (a.actor_name, a.key) != (b.actor_name, b.key)
    assert a.external_key("charge") != b.external_key("charge")


def test_a_message_key_overrides_the_actor_key_and_message_mode_overrides_actor_mode(broker):
    @dramatiq.actor(idempotency="record", idempotency_key=lambda n: f"actor-{n}")
    def task(n: int) -> None: ...

    job = _middleware(broker).job_for(
        broker, task.message_with_options(args=(1,), idempotency_key="explicit", idempotency="transactional")
    )
    assert job is not None
    assert (job.key, job.mode) == ("explicit", "transactional")


def test_mode_comes_from_the_actor_else_the_middleware_default():
    stub = StubBroker()
    stub.add_middleware(Idempotency(database=UNUSED_URL, default_mode="off"))
    try:

        @dramatiq.actor(broker=stub)
        def plain() -> None: ...

        @dramatiq.actor(broker=stub, idempotency="record")
        def external() -> None: ...

        middleware = _middleware(stub)
        assert middleware.job_for(stub, plain.message()) is None
        job = middleware.job_for(stub, external.message())
        assert job is not None and job.mode == "record"
    finally:
        stub.close()


@pytest.mark.parametrize(
    ("derive", "match"),
    [
        (lambda n: 1 / 0, "raised ZeroDivisionError"),
        (lambda n: n, r"gave 7, not a non-empty string"),
        (lambda n: "", r"gave '', not a non-empty string"),
        (lambda n: None, r"gave None"),
        (lambda n: "x" * 1001, "over 1000"),
        (lambda n: "€" * 334, "is 1002 bytes, over 1000"),
    ],
)
def test_a_key_that_cannot_be_computed_is_an_error_not_a_fallback(broker, derive, match):
    @dramatiq.actor(idempotency_key=derive)
    def task(n: int) -> None: ...

    with pytest.raises(IdempotencyKeyError, match=match) as raised:
        _middleware(broker).job_for(broker, task.message(7))
    assert "task" in str(raised.value)


def test_a_bad_key_fails_the_message_without_running_the_actor(broker, seen):
    runs: list[int] = []

    @dramatiq.actor(idempotency_key=lambda n: 1 / n, max_retries=5)
    def task(n: int) -> None:
        runs.append(n)

    task.send(0)
    _run(broker)
    assert runs == []
    (dead,) = broker.dead_letters
    assert dead.options.get("retries") is None, "a bad key must not be retried"
    assert [e.name for e in seen if e.name.startswith("idempotency.")] == ["idempotency.key_invalid"]
    assert "ZeroDivisionError" in seen[-1].as_attributes()["error"]


@pytest.mark.parametrize(("before", "warned"), [(Callbacks, False), (None, True)])
def test_the_worker_warns_when_idempotency_comes_after_pipelines_and_callbacks(before, warned, caplog):
    stub = StubBroker()
    stub.add_middleware(Idempotency(database=UNUSED_URL), before=before)
    worker = dramatiq.Worker(stub, worker_timeout=50, worker_threads=1)
    try:
        with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.idempotency"):
            worker.start()
    finally:
        worker.stop()
        stub.close()
    assert ("add it with before=Callbacks" in caplog.text) is warned


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"idempotency": "always"}, r"idempotency must be one of .* got 'always'"),
        ({"idempotency_key": "fixed"}, r"idempotency_key must be a callable .* got 'fixed'"),
        ({"idempotency": "off", "idempotency_key": lambda: "k"}, "remove one of them"),
        ({"idempotency_retention_ms": 0}, r"idempotency_retention_ms must be an int >= 1 \(milliseconds\), got 0"),
        ({"idempotency_retention_ms": True}, "got True"),
    ],
)
def test_bad_actor_options_fail_at_decoration(broker, options, match):
    with pytest.raises(ConfigurationError, match=match):

        @dramatiq.actor(**options)
        def task() -> None: ...


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"database": object()}, "database= must be a Postgres URL, a psycopg_pool.ConnectionPool"),
        ({"default_mode": "maybe"}, r"default_mode must be one of .* got 'maybe'"),
        ({"retention_ms": -1}, r"retention_ms must be an int >= 1 \(milliseconds\), got -1"),
        ({"retention_ms": 1.5}, "got 1.5"),
        ({"schema": ""}, "schema must be a non-empty string"),
        ({"connection_timeout_ms": 0}, r"connection_timeout_ms must be an int >= 1 \(milliseconds\) or None, got 0"),
    ],
)
def test_constructor_arguments_are_validated(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        Idempotency(**kwargs)


def test_a_plain_broker_without_a_database_is_refused_at_decoration():
    stub = StubBroker()
    stub.add_middleware(Idempotency())
    try:
        with pytest.raises(ActorOptionError, match="pass database=.*Postgres-backed broker"):

            @dramatiq.actor(broker=stub)
            def task() -> None: ...
    finally:
        stub.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"idempotency_key": 5}, "gave 5, not a non-empty string"),
        ({"idempotency_key": ""}, "gave ''"),
        ({"idempotency": "sometimes"}, "idempotency='sometimes'"),
    ],
)
def test_bad_message_options_are_refused_at_send(broker, options, match):
    @dramatiq.actor
    def task() -> None: ...

    with pytest.raises(IdempotencyKeyError, match=match):
        task.send_with_options(**options)
    assert broker.queues["default"].qsize() == 0


def test_a_message_key_for_an_actor_without_idempotency_is_refused(broker):
    @dramatiq.actor(idempotency="off")
    def task() -> None: ...

    with pytest.raises(IdempotencyKeyError, match="idempotency is 'off'"):
        task.send_with_options(idempotency_key="k")


def test_error_classes_stop_the_actor_and_fit_the_error_tree():
    # A SkipMessage (a MiddlewareError) is the only thing a before-hook can raise to stop an actor.
    assert issubclass(IdempotencyConflict, SkipMessage) and issubclass(IdempotencyConflict, ReliableError)
    assert issubclass(IdempotencyKeyError, SkipMessage) and issubclass(IdempotencyKeyError, ReliableError)
    assert issubclass(ActorOptionError, MiddlewareError) and issubclass(ActorOptionError, ConfigurationError)
    assert str(IdempotencyConflict("key 'k' reused")) == "key 'k' reused"


# -- external keys and hashes -------------------------------------------------------------------


def test_external_keys_are_deterministic_and_distinct_per_step_key_and_actor():
    job = Job("charge_order", "order-8812", "record", "m1")
    again = Job("charge_order", "order-8812", "record", "m2")  # a redelivery: another message_id
    assert job.external_key("charge") == again.external_key("charge")
    assert job.external_key("charge").startswith("dr-")
    assert len(job.external_key("charge")) == 67
    others = {
        job.external_key("refund"),
        Job("charge_order", "order-8813", "record", "m1").external_key("charge"),
        Job("refund_order", "order-8812", "record", "m1").external_key("charge"),
    }
    assert job.external_key("charge") not in others and len(others) == 3
    with pytest.raises(ConfigurationError, match="step must be a non-empty string"):
        job.external_key("")


def test_job_accessors_outside_a_job_explain_themselves():
    with pytest.raises(NoCurrentJob, match="outside a job"):
        external_key("charge")
    with pytest.raises(NoCurrentJob, match="outside a job"):
        current_job()
    with pytest.raises(NoCurrentJob, match="idempotency='transactional'"):
        job_connection()


def test_external_key_inside_record_mode_job_is_the_same_on_every_attempt(broker):
    keys: list[str] = []

    @dramatiq.actor(idempotency="record", idempotency_key=lambda order_id: f"order-{order_id}", max_retries=1)
    def charge(order_id: int) -> None:
        keys.append(external_key("charge"))
        with pytest.raises(NoCurrentJob, match="mode 'record'"):
            job_connection()
        raise RuntimeError("provider timeout")

    middleware = _middleware(broker)
    # Record mode reads its store before running: keep keys in memory instead of a database.
    middleware._record_store = InMemoryIdempotencyStore()
    charge.send_with_options(args=(8812,), min_backoff=1, max_backoff=2)
    _run(broker)
    assert len(keys) == 2
    assert keys[0] == keys[1] == Job("charge", "order-8812", "record", "x").external_key("charge")


@given(
    args=st.lists(st.integers() | st.text(max_size=5), max_size=4),
    kwargs=st.dictionaries(st.text(min_size=1, max_size=5), st.integers(), max_size=4),
)
def test_payload_hash_ignores_keyword_order_and_sees_every_value(args: list[Any], kwargs: dict[str, Any]) -> None:
    reordered = dict(reversed(list(kwargs.items())))
    assert payload_hash(tuple(args), kwargs) == payload_hash(list(args), reordered)
    assert payload_hash(tuple(args), kwargs) != payload_hash((*args, "extra"), kwargs)


def test_payload_hash_is_unchanged_so_keys_stored_by_earlier_versions_still_match():
    args, kwargs = (1, "é", [2.5, None]), {"b": {"y": 1, "x": 2}, "a": object}
    earlier = json.dumps([list(args), kwargs], sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=False)
    assert payload_hash(args, kwargs) == hashlib.sha256(earlier.encode()).digest()


def test_the_purge_actor_shares_the_middleware_database_and_runs_without_idempotency(broker):
    purge = make_purge_actor(broker, batch_size=100)
    assert purge.options["idempotency"] == "off"
    assert purge.queue_name == "dramatiq_reliable"
    with pytest.raises(ConfigurationError, match="batch_size must be an int >= 1, got 0"):
        make_purge_actor(broker, batch_size=0, actor_name="other_purge")
    bare = StubBroker()
    try:
        with pytest.raises(ConfigurationError, match=r"pass database='postgresql://...'"):
            make_purge_actor(bare)
    finally:
        bare.close()


# -- failing closed ---------------------------------------------------------------------------


def test_an_unreachable_database_stops_the_actor_and_the_message_is_retried(seen):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool: ConnectionPool[Any] = ConnectionPool(
        f"postgresql://nobody@127.0.0.1:{port}/x", min_size=1, max_size=2, open=False, timeout=0.3
    )
    pool.open(wait=False)  # a pool you pass in is yours to open and close
    stub = StubBroker()
    stub.add_middleware(Idempotency(database=pool, connection_timeout_ms=300))
    runs: list[int] = []
    try:

        @dramatiq.actor(broker=stub, max_retries=1, min_backoff=1, max_backoff=2)
        def task() -> None:
            runs.append(1)

        task.send()
        _run(stub)
        assert runs == []
        (dead,) = stub.dead_letters
        assert dead.options["retries"] == 2  # first attempt, one retry, then given up
        unavailable = [e for e in seen if e.name == "idempotency.unavailable"]
        assert len(unavailable) == 2
        assert "PoolTimeout" in unavailable[0].as_attributes()["error"]
        assert "nobody" not in unavailable[0].as_attributes()["error"]  # no conninfo in events
    finally:
        stub.close()
        pool.close()
    assert issubclass(DatabaseUnavailable, MiddlewareError)
