"""DeadLetters with the in-memory store under StubBroker: what users get in their own unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_reliable import ClassifiedRetries, DeadLetters, DeadLetterStore, Unrecoverable
from dramatiq_reliable.dead_letters import DeadLetterFilter
from dramatiq_reliable.testing import InMemoryDeadLetterStore


@pytest.fixture
def setup() -> Iterator[tuple[StubBroker, InMemoryDeadLetterStore, dramatiq.Worker]]:
    store = InMemoryDeadLetterStore()
    broker = StubBroker(
        middleware=[DeadLetters(store=store), ClassifiedRetries(max_retries=1, min_backoff=1, max_backoff=2)]
    )
    broker.emit_after("process_boot")
    store.broker = broker
    dramatiq.set_broker(broker)
    worker = dramatiq.Worker(broker, worker_timeout=50)
    worker.start()
    yield broker, store, worker
    worker.stop()
    broker.close()


def test_the_in_memory_store_is_a_dead_letter_store():
    assert isinstance(InMemoryDeadLetterStore(), DeadLetterStore)


def test_a_failing_actor_lands_in_the_store_with_its_reason_and_a_replay_runs_it_again(setup):
    broker, store, worker = setup
    runs: list[int] = []
    fixed = False

    @dramatiq.actor(queue_name="default", broker=broker)
    def charge(n: int) -> None:
        runs.append(n)
        if not fixed:
            raise Unrecoverable(f"card {n} declined")

    @dramatiq.actor(queue_name="default", broker=broker)
    def flaky(n: int) -> None:
        raise TimeoutError("upstream slow")

    sent = charge.send(1)
    flaky.send(2)
    broker.join("default", fail_fast=False)
    worker.join()

    rows = {row.actor_name: row for row in store.list().items}
    assert (rows["charge"].reason, rows["charge"].attempts, rows["charge"].message_id) == (
        "unrecoverable",
        1,
        sent.message_id,
    )
    assert rows["charge"].error_message == "card 1 declined"
    assert (rows["flaky"].reason, rows["flaky"].attempts) == ("retries_exhausted", 2)
    assert store.count() == 2 and [group.count for group in store.stats()] == [1, 1]

    fixed = True
    runs.clear()
    result = store.replay(where=DeadLetterFilter(actor_name="charge"))
    assert result.replayed == 1
    broker.join("default", fail_fast=False)
    worker.join()
    assert runs == [1]
    assert store.get(rows["charge"].id).state == "replayed"  # type: ignore[union-attr]
    assert store.discard(ids=[rows["charge"].id]).problems == {rows["charge"].id: "already replayed"}
    assert store.purge().handled == 1 and store.count(state=None) == 1


def test_a_second_death_of_a_dead_message_refreshes_its_row(setup):
    broker, store, _ = setup
    dead_letters = DeadLetters(store=store)
    from dramatiq.broker import MessageProxy
    from dramatiq.message import Message

    message = Message(queue_name="default", actor_name="ghost", args=(), kwargs={}, options={})
    for _ in range(2):
        proxy = MessageProxy(message)
        proxy.stuff_exception(ValueError("x"))
        proxy.fail()
        dead_letters.capture(broker, proxy)
    [row] = store.list().items
    assert row.captures == 2 and row.reason == "failed"


def test_store_and_database_together_are_refused():
    from dramatiq_reliable import ConfigurationError

    with pytest.raises(ConfigurationError, match="not both"):
        DeadLetters(store=InMemoryDeadLetterStore(), database="postgresql://x@localhost/x")
