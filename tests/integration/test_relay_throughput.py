"""The relay's fast paths keep its promises: the claim stays on its index, coalesced frames
arrive intact, and a drain that overlaps Postgres with RabbitMQ marks only what was confirmed."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import pika
import psycopg
import pytest
from support import server_pid

from dramatiq_reliable import OutboxBroker, Relay, _sql, events
from dramatiq_reliable.errors import BrokerUnavailable
from dramatiq_reliable.outbox import publisher as publisher_module
from dramatiq_reliable.outbox import relay as relay_module
from dramatiq_reliable.outbox.publisher import Publication, Publisher

pytestmark = pytest.mark.integration


def _send(broker: OutboxBroker, queue_name: str, count: int) -> set[str]:
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_actor", queue_name=queue_name, broker=broker)
    with broker.transaction():
        return {task.send(i).message_id for i in range(count)}


def _unpublished(db: psycopg.Connection[Any], db_schema: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {}.outbox WHERE published_at IS NULL").format(
        psycopg.sql.Identifier(db_schema)
    )
    return int(db.execute(query).fetchone()[0])


def _assert_no_row_locked(db: psycopg.Connection[Any], db_schema: str) -> None:
    query = psycopg.sql.SQL("SELECT id FROM {}.outbox FOR UPDATE NOWAIT").format(psycopg.sql.Identifier(db_schema))
    with db.transaction():
        db.execute(query)  # raises LockNotAvailable while any relay transaction still holds a row


def _take(rabbitmq_url: str, queue: str, count: int) -> list[tuple[Any, bytes]]:
    """``count`` messages of ``queue`` with their AMQP properties (fewer if the queue runs dry)."""
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        taken = []
        for _ in range(count):
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            taken.append((properties, body))
        return taken
    finally:
        connection.close()


def test_the_claim_walks_its_index_even_before_the_table_was_ever_analyzed(db, db_schema):
    db.execute(
        psycopg.sql.SQL(
            "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body) "
            "SELECT n::text, 'q', 'a', 'body' FROM generate_series(1, 5000) AS n"
        ).format(psycopg.sql.Identifier(db_schema))
    )
    with db.transaction():
        db.execute(_sql.query("outbox_relay_local", db_schema), {"statement_timeout": "30000", "idle_timeout": "60000"})
        claim = _sql.query("outbox_claim", db_schema).as_string(db)
        plan = "\n".join(
            row[0]
            for row in db.execute(
                psycopg.sql.SQL("EXPLAIN ") + psycopg.sql.SQL(claim), {"batch_size": 500, "max_attempts": 25}
            )
        )
    assert "Sort" not in plan, plan
    assert "Index Scan using outbox_due" in plan, plan


@pytest.mark.parametrize("coalesced", [True, False], ids=["frames-written-together", "basic-publish-fallback"])
def test_large_and_small_bodies_arrive_intact_with_their_properties(rabbitmq_url, queue_name, monkeypatch, coalesced):
    if not coalesced:
        monkeypatch.setattr(publisher_module, "_frame_writer", lambda channel: None)
    publisher = Publisher(pika.URLParameters(rabbitmq_url), max_priority=9)
    big = b"x" * 300_000  # over RabbitMQ's default frame_max (128 KiB): three body frames
    bodies = [b"small-0", big, b"", b"small-3", *(f"n-{i}".encode() for i in range(300))]
    publications = [
        Publication(key=i, routing_key=queue_name, body=body, message_id=f"m-{i}", priority=i % 10)
        for i, body in enumerate(bodies)
    ]
    try:
        outcome = publisher.publish(publications)
    finally:
        publisher.close()
    assert sorted(outcome.confirmed) == list(range(len(bodies))) and not outcome.failed
    taken = _take(rabbitmq_url, queue_name, len(bodies) + 1)
    by_id = {properties.message_id: (properties, body) for properties, body in taken}
    assert len(taken) == len(bodies)
    for i, body in enumerate(bodies):
        properties, arrived = by_id[f"m-{i}"]
        assert arrived == body
        assert (properties.delivery_mode, properties.priority) == (2, i % 10)


def test_a_message_that_cannot_be_encoded_fails_alone_among_coalesced_frames(rabbitmq_url, queue_name):
    publisher = Publisher(pika.URLParameters(rabbitmq_url), max_priority=9)
    publications = [
        Publication(key=i, routing_key=queue_name, body=b"ok", message_id=f"m-{i}", priority=300 if i == 1 else None)
        for i in range(3)
    ]
    try:
        outcome = publisher.publish(publications)
    finally:
        publisher.close()
    assert sorted(outcome.confirmed) == [0, 2]
    assert list(outcome.failed) == [1] and "cannot publish" in outcome.failed[1]
    assert sorted(p.message_id for p, _ in _take(rabbitmq_url, queue_name, 4)) == ["m-0", "m-2"]


def test_a_backlog_drained_with_the_helper_thread_publishes_and_reports_every_row_once(
    broker, queue_name, rabbit, db, db_schema, seen
):
    sent = _send(broker, queue_name, 95)
    relay = Relay.from_broker(broker, batch_size=10)
    try:
        assert relay.drain() == 95
    finally:
        relay.publisher.close()
    assert _unpublished(db, db_schema) == 0
    _assert_no_row_locked(db, db_schema)
    reported = [m.message_id for e in seen if isinstance(e, relay_module.OutboxBatchPublished) for m in e.messages]
    assert sorted(reported) == sorted(sent)
    assert sum(e.count for e in seen if isinstance(e, relay_module.OutboxPublished)) == 95
    assert {b["message_id"] for b in rabbit.take_all(queue_name, expect=95)} == sent


def test_an_outage_mid_drain_keeps_the_confirmed_batches_and_rolls_back_the_batch_claimed_ahead(
    broker, queue_name, rabbit, db, db_schema
):
    sent = _send(broker, queue_name, 95)
    relay = Relay.from_broker(broker, batch_size=10)
    publish = relay.publisher.publish
    calls: list[int] = []

    def failing_third(publications: Any) -> Any:
        calls.append(len(publications))
        if len(calls) == 3:
            raise BrokerUnavailable("cut for the test")
        return publish(publications)

    relay.publisher.publish = failing_third  # type: ignore[method-assign]
    try:
        with pytest.raises(BrokerUnavailable, match="cut for the test"):
            relay.drain()
        assert _unpublished(db, db_schema) == 75, "the two confirmed batches are marked, nothing else"
        _assert_no_row_locked(db, db_schema)
        relay.publisher.publish = publish  # type: ignore[method-assign]
        assert relay.drain() == 75
    finally:
        relay.publisher.close()
    assert {b["message_id"] for b in rabbit.take_all(queue_name, expect=95)} == sent


def test_a_commit_that_fails_mid_drain_leaves_its_rows_for_a_later_pass_and_no_row_locked(
    broker, queue_name, rabbit, db, db_schema, monkeypatch
):
    sent = _send(broker, queue_name, 95)
    finish = relay_module._Batch.finish
    calls: list[int] = []

    def failing_second(self: Any, relay: Relay, outcome: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            # The connection drops between the confirms and the marks.
            db.execute("SELECT pg_terminate_backend(%s)", (server_pid(self.conn),))
        finish(self, relay, outcome)

    monkeypatch.setattr(relay_module._Batch, "finish", failing_second)
    relay = Relay.from_broker(broker, batch_size=10)
    try:
        with pytest.raises(psycopg.OperationalError):
            relay.drain()
        # The first batch committed; the second was confirmed but not marked (published again
        # later, at least once), the one claimed ahead rolled back.
        assert 75 <= _unpublished(db, db_schema) <= 85
        _assert_no_row_locked(db, db_schema)
        monkeypatch.setattr(relay_module._Batch, "finish", finish)
        relay.drain()
    finally:
        relay.publisher.close()
    assert _unpublished(db, db_schema) == 0
    assert {b["message_id"] for b in rabbit.take_all(queue_name, expect=95)} >= sent


def test_events_of_an_overlapped_drain_reach_listeners_on_the_draining_thread(broker, queue_name):
    _send(broker, queue_name, 30)
    threads: set[str] = set()

    def listener(event: events.Event) -> None:
        if isinstance(event, relay_module.OutboxBatchPublished):
            threads.add(threading.current_thread().name)

    events.subscribe(listener)
    relay = Relay.from_broker(broker, batch_size=10)
    try:
        relay.drain()
    finally:
        events.unsubscribe(listener)
        relay.publisher.close()
    assert threads == {threading.current_thread().name}
