"""PostgresBroker wake-ups without a trigger: producers notify nobody, consumers still find their rows.

A producer in another process, a plain SQL insert and a send in the consumer's own process are
each found by a consumer whose own ``timeout`` (Dramatiq's ``worker_timeout``) is far longer
than the test waits, so only the consumer's own polling or a direct wake-up can deliver them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import PostgresBroker, _sql, schema
from dramatiq_reliable.postgres import consumer as consumer_module
from dramatiq_reliable.postgres import wake_consumers
from dramatiq_reliable.postgres.consumer import PostgresConsumer, PostgresMessage, channel
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration

# Longer than any wait below: a consumer that returns a message did not get it from its timeout.
CONSUMER_TIMEOUT_MS = 120_000


class Taker:
    """Calls ``next()`` on a consumer in a thread until it returns a message."""

    def __init__(self, consumer: PostgresConsumer) -> None:
        self.consumer = consumer
        self.taken: list[PostgresMessage] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.taken:
            message = next(self.consumer)
            if message is not None:
                self.taken.append(message)

    def message_ids(self) -> list[str]:
        return [m.message_id for m in self.taken]


def _actor(broker: PostgresBroker, queue_name: str) -> dramatiq.Actor[Any, Any]:
    return dramatiq.actor(lambda n: None, actor_name="wake_probe", queue_name=queue_name, broker=broker)


@pytest.fixture
def listening(database_url: str, db_schema: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the schema's queue channel, to see what producers notify."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(db_schema))))
        yield conn


def _queue_triggers(conn: psycopg.Connection[Any], schema_name: str) -> list[str]:
    rows = conn.execute(
        "SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n"
        " ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = 'queue' AND NOT t.tgisinternal",
        (schema_name,),
    ).fetchall()
    return [name for (name,) in rows]


def test_a_send_from_another_process_is_claimed_with_no_notification(
    database_url, db_schema, queue_name, listening, db
):
    assert _queue_triggers(db, db_schema) == []
    broker = PostgresBroker(database=database_url, schema=db_schema)
    try:
        _actor(broker, queue_name)
        consumer = broker.consume(queue_name, prefetch=1, timeout=CONSUMER_TIMEOUT_MS)
        taker = Taker(consumer)
        script = textwrap.dedent(
            f"""
            import dramatiq
            from dramatiq_reliable import PostgresBroker
            broker = PostgresBroker(database={database_url!r}, schema={db_schema!r})
            actor = dramatiq.actor(lambda n: None, actor_name="wake_probe", queue_name={queue_name!r}, broker=broker)
            print(actor.send(1).message_id)
            broker.close()
            """
        )
        sent = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=dict(os.environ), check=True
        ).stdout.split()[-1]
        wait_for(lambda: taker.message_ids() == [sent], message="the other process's message was never claimed")
        # The producer paid no NOTIFY: nothing was sent on the channel.
        assert list(listening.notifies(timeout=0.05)) == []
        consumer.ack(taker.taken[0])
        consumer.close()
    finally:
        broker.close()


def test_a_plain_sql_insert_from_another_connection_is_claimed(database_url, db_schema, queue_name, db):
    broker = PostgresBroker(database=database_url, schema=db_schema)
    try:
        actor = _actor(broker, queue_name)
        consumer = broker.consume(queue_name, prefetch=1, timeout=CONSUMER_TIMEOUT_MS)
        taker = Taker(consumer)
        message = actor.message(2)
        # The columns docs/postgres-broker.md names for a row written around the broker.
        db.execute(
            sql.SQL("INSERT INTO {} (queue_name, message_id, actor_name, body) VALUES (%s, %s, %s, %s)").format(
                sql.Identifier(db_schema, "queue")
            ),
            (queue_name, message.message_id, message.actor_name, message.encode()),
        )
        wait_for(lambda: taker.message_ids() == [message.message_id], message="the inserted row was never claimed")
        consumer.close()
    finally:
        broker.close()


@pytest.fixture
def sleepy(monkeypatch, database_url, listen_url, db_schema, queue_name) -> Iterator[tuple[PostgresBroker, Taker]]:
    """A consumer whose idle sleeps last ten minutes: only a wake-up ends them within a test."""
    monkeypatch.setattr(consumer_module, "FIRST_IDLE_S", 600.0)
    broker = PostgresBroker(
        database=database_url, schema=db_schema, poll_interval_ms=600_000, listen_database=listen_url
    )
    try:
        _actor(broker, queue_name)
        consumer = broker.consume(queue_name, prefetch=1, timeout=CONSUMER_TIMEOUT_MS)
        taker = Taker(consumer)
        wait_for(lambda: consumer._empty_claims >= 1, message="the consumer never went to sleep")
        yield broker, taker
        consumer.close()
    finally:
        broker.close()


def test_a_send_in_the_consumers_process_wakes_it_at_once(sleepy, queue_name):
    broker, taker = sleepy
    sent = broker.actors["wake_probe"].send(3)
    wait_for(lambda: taker.message_ids() == [sent.message_id], message="the local send did not wake the consumer")


@pytest.mark.parametrize("named", [True, False], ids=["queue", "every-queue"])
def test_wake_consumers_after_rows_written_around_the_broker_wakes_a_sleeping_consumer(
    sleepy, database_url, db_schema, queue_name, named
):
    broker, taker = sleepy
    message = broker.actors["wake_probe"].message(4)
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute(
            sql.SQL("INSERT INTO {} (queue_name, message_id, actor_name, body) VALUES (%s, %s, %s, %s)").format(
                sql.Identifier(db_schema, "queue")
            ),
            (queue_name, message.message_id, message.actor_name, message.encode()),
        )
        wake_consumers(conn, schema=db_schema, queue_name=queue_name if named else None)
    wait_for(lambda: taker.message_ids() == [message.message_id], message="the NOTIFY did not wake the consumer")


def _as_release_17_left_it(database_url: str, schema_name: str) -> None:
    """Migrations 1-17 only: the queue's NOTIFY trigger of 0004 still in place."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute(schema._header(schema_name))
        for migration in schema.migrations()[:17]:
            conn.execute(_sql.compose(migration.text, schema_name))
            conn.execute(schema._record(schema_name, migration))


def test_migrating_drops_the_queue_trigger_keeps_waiting_rows_and_wakes_workers_once(
    database_url, direct_database_url, db, unmigrated_schema, queue_name
):
    _as_release_17_left_it(database_url, unmigrated_schema)
    assert _queue_triggers(db, unmigrated_schema) == ["queue_notify"]
    broker = PostgresBroker(database=database_url, schema=unmigrated_schema)
    try:
        waiting = _actor(broker, queue_name).send(5)
        with psycopg.connect(direct_database_url, autocommit=True) as listen:  # LISTEN needs a session
            listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(unmigrated_schema))))
            assert schema.migrate(database_url, schema=unmigrated_schema)[:1] == [18]  # later ones may follow
            # One notification with no payload, at the migration's commit: every consumer looks now.
            [note] = list(listen.notifies(timeout=5, stop_after=1))
            assert note.payload == ""
        assert _queue_triggers(db, unmigrated_schema) == []
        functions = db.execute(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s AND p.proname = 'queue_notify'",
            (unmigrated_schema,),
        ).fetchone()
        assert functions == (0,)
        consumer = broker.consume(queue_name, prefetch=1, timeout=CONSUMER_TIMEOUT_MS)
        taker = Taker(consumer)
        wait_for(lambda: taker.message_ids() == [waiting.message_id], message="the row sent before was lost")
        consumer.close()
    finally:
        broker.close()
