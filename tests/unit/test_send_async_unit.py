"""The async send's entry points, with no service: what they refuse, and their StubBroker fallback."""

from __future__ import annotations

import asyncio

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_reliable import (
    ConfigurationError,
    NoCurrentJob,
    OutboxBroker,
    PayloadError,
    job_connection_async,
    send_async,
    send_async_with_options,
)
from dramatiq_reliable.async_sending import BrokerTransaction


@pytest.fixture
def stub() -> StubBroker:
    broker = StubBroker()
    broker.emit_after("process_boot")
    return broker


def test_on_a_broker_that_is_not_ours_send_async_is_its_enqueue(stub: StubBroker) -> None:
    @dramatiq.actor(broker=stub, queue_name="stub_q")
    def task(n: int) -> None:
        pass

    message = asyncio.run(send_async_with_options(task, args=(1,), delay=10))
    assert message.queue_name == "stub_q.DQ" and message.args == (1,)
    assert stub.queues["stub_q.DQ"].qsize() == 1


@pytest.mark.parametrize("target", [None, "task", print])
def test_send_async_refuses_what_is_not_an_actor(target: object) -> None:
    with pytest.raises(ConfigurationError, match="needs a Dramatiq actor"):
        asyncio.run(send_async(target))  # type: ignore[arg-type]


def test_args_and_kwargs_must_be_a_tuple_and_a_dict(stub: StubBroker) -> None:
    task = dramatiq.actor(lambda n: None, actor_name="shape", broker=stub)
    with pytest.raises(ConfigurationError, match="args= as a tuple"):
        asyncio.run(send_async_with_options(task, args=[1]))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="kwargs= as a dict"):
        asyncio.run(send_async_with_options(task, kwargs=[("n", 1)]))  # type: ignore[arg-type]


def test_a_bad_delay_is_refused_before_any_connection() -> None:
    # The database URL points nowhere: the refusal must come before any connect.
    broker = OutboxBroker(url="amqp://127.0.0.1:1", database="postgresql://nobody@127.0.0.1:1/none")
    try:
        task = dramatiq.actor(lambda: None, actor_name="bad_delay", broker=broker)
        with pytest.raises(PayloadError, match="delay=-5"):
            asyncio.run(send_async_with_options(task, delay=-5))
        assert broker.database._async_pools == {}  # no async pool was even created
    finally:
        broker.close()


def test_transaction_returns_one_object_for_with_and_async_with() -> None:
    broker = OutboxBroker(url="amqp://127.0.0.1:1", database="postgresql://nobody@127.0.0.1:1/none")
    try:
        block = broker.transaction()
        assert isinstance(block, BrokerTransaction)
        assert hasattr(block, "__enter__") and hasattr(block, "__aenter__")
    finally:
        broker.close()


def test_job_connection_async_outside_a_job_says_where_it_works() -> None:
    with pytest.raises(NoCurrentJob, match="idempotency='transactional'"):
        job_connection_async()


def test_a_priority_to_a_quorum_queue_is_refused_by_the_async_send_too() -> None:
    broker = OutboxBroker(
        url="amqp://127.0.0.1:1", database="postgresql://nobody@127.0.0.1:1/none", queue_type="quorum"
    )
    try:
        task = dramatiq.actor(lambda: None, actor_name="urgent", broker=broker)
        with pytest.raises(PayloadError, match="quorum queue"):
            asyncio.run(send_async_with_options(task, broker_priority=5))
        with pytest.raises(PayloadError, match="quorum queue"):
            task.send_with_options(broker_priority=5)
    finally:
        broker.close()
