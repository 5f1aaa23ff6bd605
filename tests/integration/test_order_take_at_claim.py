"""Order per key on a PostgresBroker: the take made when a consumer claims its batch (postgres/claims.py),
and the leases of messages that never run under it let go at once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import PostgresBroker
from dramatiq_reliable.flow import OrderedKeys
from dramatiq_reliable.postgres.consumer import PostgresMessage
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def booted(database_url: str, db_schema: str) -> Iterator[tuple[PostgresBroker, OrderedKeys, dramatiq.Actor[Any, Any]]]:
    """A PostgresBroker whose OrderedKeys went through worker boot (its claim listener is registered)."""
    broker = PostgresBroker(database=database_url, schema=db_schema)
    middleware = OrderedKeys(lease_ms=1000)
    broker.add_middleware(middleware, before=Callbacks)
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name="ordered", broker=broker, order_key=str)
    middleware.after_worker_boot(broker, None)
    yield broker, middleware, step
    middleware.before_worker_shutdown(broker, None)
    broker.close()


def _state(db: psycopg.Connection[Any], schema: str, message_id: str) -> tuple[str, str | None]:
    query = sql.SQL("SELECT state, owner FROM {} WHERE message_id = %s").format(sql.Identifier(schema, "order_jobs"))
    row = db.execute(query, (message_id,)).fetchone()
    assert row is not None, f"message {message_id} lost its place"
    return row[0], row[1]


def _claim(broker: PostgresBroker) -> list[PostgresMessage]:
    consumer = broker.consume("ordered", prefetch=10, timeout=2000)
    claimed = [m for m in itertools.islice(iter(consumer), 1) if m is not None]
    claimed += list(consumer._buffer)  # the rest of the batch, as the worker would get it next
    consumer._buffer.clear()
    assert claimed, "nothing was claimed"
    return claimed  # type: ignore[return-value]


def test_an_ordered_job_is_taken_when_its_batch_is_claimed_before_a_worker_thread_has_it(
    booted: tuple[PostgresBroker, OrderedKeys, Any], db: psycopg.Connection[Any], db_schema: str
) -> None:
    broker, middleware, step = booted
    sent = [step.send(n) for n in range(3)]  # three keys: three heads
    claimed = _claim(broker)
    assert sorted(m.message_id for m in claimed) == sorted(m.message_id for m in sent)
    for message in claimed:
        assert message.notes["order"]["outcome"] == "run"
        assert _state(db, db_schema, message.message_id) == ("running", middleware.owner)
    # The heartbeat renews these leases although no worker thread holds them yet.
    assert middleware._held.renewal(middleware.lease_ms) is not None
    middleware.before_process_message(broker, claimed[0])
    assert "order" not in claimed[0].notes, "the note was not used up"
    middleware.after_process_message(broker, claimed[0], result=None)
    wait_for(
        lambda: (
            db.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(
                    sql.Identifier(db_schema, "order_jobs")
                ),
                (claimed[0].message_id,),
            ).fetchone()
            == (0,)
        ),
        message="the finished head kept its place",
    )


def test_messages_given_back_or_stopped_before_ordered_keys_let_their_lease_go_at_once(
    booted: tuple[PostgresBroker, OrderedKeys, Any], db: psycopg.Connection[Any], db_schema: str
) -> None:
    broker, middleware, step = booted
    step.send(1)
    step.send(2)
    given, skipped = sorted(_claim(broker), key=lambda m: m.args[0])
    broker.consume("ordered").requeue([given])  # a stopping worker gives it back
    # Skipped by a middleware before OrderedKeys (a cancellation, a rate limit's postponement).
    middleware.after_skip_message(broker, skipped)
    for message in (given, skipped):
        wait_for(
            lambda message=message: _state(db, db_schema, message.message_id) == ("waiting", None),
            message=f"message {message.message_id} kept its lease until it lapsed",
        )
    assert middleware._held.renewal(middleware.lease_ms) is None, "a lease let go is still renewed"
    # Given back, the message comes round again and runs as its key's head.
    again = _claim(broker)
    assert [m.message_id for m in again] == [given.message_id]
    assert again[0].notes["order"]["outcome"] == "run"


def test_a_job_claimed_before_its_turn_is_parked_and_acked_without_reaching_a_worker_thread(
    booted: tuple[PostgresBroker, OrderedKeys, Any], db: psycopg.Connection[Any], db_schema: str
) -> None:
    broker, middleware, _ = booted
    step = dramatiq.actor(
        lambda n: None, actor_name="same", queue_name="ordered", broker=broker, order_key=lambda n: "k"
    )
    head, early = step.send(0), step.send(1)
    claimed = _claim(broker)
    assert [m.message_id for m in claimed] == [head.message_id], "the early job was handed to a worker thread"
    assert _state(db, db_schema, early.message_id) == ("parked", None)
    queue = sql.Identifier(db_schema, "queue")
    wait_for(
        lambda: db.execute(sql.SQL("SELECT message_id FROM {}").format(queue)).fetchall() == [(head.message_id,)],
        message="the parked job's delivery was not acked",
    )
    middleware.before_process_message(broker, claimed[0])
    middleware.after_process_message(broker, claimed[0], result=None)
    again = _claim(broker)  # woken by the head's release
    assert [m.message_id for m in again] == [early.message_id]
    assert again[0].notes["order"]["outcome"] == "run"
