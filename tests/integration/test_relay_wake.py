"""How an idle relay wakes: by itself within its ceiling, at once on an explicit wake-up, and
never through a trigger on the producer's insert."""

from __future__ import annotations

from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from support import running

from dramatiq_reliable import OutboxBroker, Relay, _sql, schema
from dramatiq_reliable.outbox import wake, wake_relays
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _actor(broker: OutboxBroker, queue_name: str) -> dramatiq.Actor[Any, Any]:
    def noop(*args: Any) -> None:
        return None

    return dramatiq.actor(noop, actor_name=f"{queue_name}_actor", queue_name=queue_name, broker=broker)


def _outbox_triggers(db: psycopg.Connection[Any], db_schema: str) -> list[str]:
    rows = db.execute(
        "SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal",
        (sql.Identifier(db_schema, "outbox").as_string(db),),
    ).fetchall()
    return [row[0] for row in rows]


def _notify_function(db: psycopg.Connection[Any], db_schema: str) -> int:
    row = db.execute(
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s AND p.proname = 'outbox_notify'",
        (db_schema,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_migrated_schema_has_no_trigger_on_the_outbox(db, db_schema):
    assert _outbox_triggers(db, db_schema) == []
    assert _notify_function(db, db_schema) == 0


def _as_release_5_left_it(database_url: str, schema_name: str) -> None:
    """Migrations 1-5 only, the 0001 trigger included."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute(schema._header(schema_name))
        for migration in schema.migrations()[:5]:
            conn.execute(_sql.compose(migration.text, schema_name))
            conn.execute(schema._record(schema_name, migration))


def test_migrating_a_version_5_schema_removes_the_old_notify_trigger(database_url, db, unmigrated_schema):
    _as_release_5_left_it(database_url, unmigrated_schema)
    assert schema.current_version(db, schema=unmigrated_schema) == 5
    assert _outbox_triggers(db, unmigrated_schema) == ["outbox_notify"]

    assert schema.migrate(database_url, schema=unmigrated_schema) == [
        m.version for m in schema.migrations() if m.version >= 6
    ]
    assert _outbox_triggers(db, unmigrated_schema) == []
    assert _notify_function(db, unmigrated_schema) == 0


def test_code_that_lands_before_migration_6_still_sends_and_relays(
    database_url, db, unmigrated_schema, queue_name, rabbit, listen_url
):
    # Migration 6 only removes a cost: a deploy whose code runs before it must not refuse sends.
    _as_release_5_left_it(database_url, unmigrated_schema)
    broker = OutboxBroker(database=database_url, schema=unmigrated_schema, url=rabbit.url)
    try:
        task = _actor(broker, queue_name)
        relay = Relay.from_broker(broker, poll_interval_ms=60_000, listen_database=listen_url)
        with running(relay.run, relay.stop):
            wait_for(lambda: relay._sleeping_s is not None, message="relay never went idle")
            with broker.transaction():
                task.send(1)
            # The old trigger's NOTIFY is on the relays' channel: it ends the minute-long sleep.
            wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="row never relayed")
    finally:
        broker.close()
    assert schema.current_version(db, schema=unmigrated_schema) == 5


def test_an_idle_relay_picks_up_a_new_row_within_its_ceiling_without_any_notify(
    broker, queue_name, rabbit, direct_database_url, db_schema
):
    task = _actor(broker, queue_name)
    relay = Relay.from_broker(broker, poll_interval_ms=300)
    with psycopg.connect(direct_database_url, autocommit=True) as listener, running(relay.run, relay.stop):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(wake.channel(db_schema))))
        # Idle long enough that its sleeps reached the ceiling (the upper half of 300 ms).
        wait_for(lambda: (relay._sleeping_s or 0) > 0.15, message="relay never backed off to its ceiling")
        with broker.transaction():
            task.send(1)
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="idle relay never found the row")
        # The producer's commit notified nobody.
        assert list(listener.notifies(timeout=0.05)) == []


def test_wake_relays_ends_a_long_idle_sleep_at_once(broker, queue_name, rabbit, monkeypatch, listen_url):
    # Every idle sleep is now 5-10 minutes: only the wake-up can deliver within the timeout below.
    monkeypatch.setattr(wake, "FIRST_IDLE_S", 600.0)
    task = _actor(broker, queue_name)
    relay = Relay.from_broker(broker, poll_interval_ms=600_000, listen_database=listen_url)
    with running(relay.run, relay.stop):
        wait_for(lambda: (relay._sleeping_s or 0) > 60, message="relay never went to sleep")
        with broker.transaction() as conn:
            task.send(1)
            wake_relays(conn, schema=broker.schema)
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="wake_relays did not wake the relay")


def test_a_wake_up_sent_outside_a_transaction_is_heard_too(
    broker, queue_name, rabbit, database_url, monkeypatch, listen_url
):
    monkeypatch.setattr(wake, "FIRST_IDLE_S", 600.0)
    task = _actor(broker, queue_name)
    relay = Relay.from_broker(broker, poll_interval_ms=600_000, listen_database=listen_url)
    with running(relay.run, relay.stop):
        wait_for(lambda: (relay._sleeping_s or 0) > 60, message="relay never went to sleep")
        with broker.transaction():
            task.send(1)
        with psycopg.connect(database_url, autocommit=True) as conn:
            wake_relays(conn, schema=broker.schema)
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="wake_relays did not wake the relay")


def test_rows_locked_by_another_relay_do_not_make_an_idle_relay_spin(broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    with broker.transaction():
        task.send(1)
    relay = Relay.from_broker(broker, poll_interval_ms=400)
    # Another relay's claim in progress: the row is there, but this relay cannot take it.
    with psycopg.connect(broker.database.conninfo) as holder:
        holder.execute(sql.SQL("SELECT id FROM {} FOR UPDATE").format(sql.Identifier(db_schema, "outbox")))
        with running(relay.run, relay.stop):
            # Its probes see the row, its passes find nothing: the backoff still grows to the ceiling.
            wait_for(lambda: (relay._sleeping_s or 0) > 0.2, message="relay kept passing at a locked row")
        holder.rollback()
    row = db.execute(sql.SQL("SELECT published_at FROM {}").format(sql.Identifier(db_schema, "outbox"))).fetchone()
    assert row is not None and row[0] is None


# -- the paths that wake the relays explicitly -----------------------------------------------------


@pytest.fixture
def wake_ups(direct_database_url: str, db_schema: str) -> Any:
    """A LISTEN connection on the relays' channel (directly: a session): ``wake_ups()`` returns what arrived since."""
    with psycopg.connect(direct_database_url, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(wake.channel(db_schema))))
        yield lambda: list(listener.notifies(timeout=1.0, stop_after=1))


def test_a_producer_send_notifies_nobody(broker, queue_name, wake_ups):
    task = _actor(broker, queue_name)
    with broker.transaction():
        task.send(1)
    task.send(2)  # unbound: its own transaction
    assert wake_ups() == []


def test_outbox_retry_wakes_the_relays_when_it_reset_rows(database_url, db, db_schema, broker, queue_name, wake_ups):
    from dramatiq_reliable.cli import ExitCode, main

    task = _actor(broker, queue_name)
    task.send(1)
    db.execute(sql.SQL("UPDATE {} SET attempts = 25").format(sql.Identifier(db_schema, "outbox")))
    assert main(["outbox", "retry", "--database-url", database_url, "--schema", db_schema]) == ExitCode.OK
    [note] = wake_ups()
    assert note.channel == wake.channel(db_schema)


def test_a_dead_letter_replay_to_the_outbox_wakes_the_relays(broker, db_schema, wake_ups):
    from dramatiq.broker import MessageProxy
    from dramatiq.message import Message

    from dramatiq_reliable.dead_letters import DeadLetters, PostgresDeadLetterStore

    proxy = MessageProxy(Message(queue_name="default", actor_name="send_email", args=(1,), kwargs={}, options={}))
    try:
        raise ValueError("boom")
    except ValueError as raised:
        proxy.stuff_exception(raised)
    proxy.fail()
    stored = DeadLetters().capture(broker, proxy)
    assert stored is not None
    assert PostgresDeadLetterStore.from_broker(broker).replay(ids=[stored.id]).replayed == 1
    [note] = wake_ups()
    assert note.channel == wake.channel(db_schema)


def test_a_scheduler_pass_that_fires_and_a_manual_trigger_wake_the_relays(database_url, db_schema, wake_ups):
    import datetime as dt

    from dramatiq_reliable.scheduler import Registry, Scheduler, schedule, trigger_schedule

    registry = Registry()
    schedule("every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    loop = Scheduler(database=database_url, schema=db_schema, registry=registry)
    try:
        loop.sync()
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
        assert loop.tick_once(now=later).fired >= 1
        assert len(wake_ups()) == 1
        trigger_schedule(database_url, "every-second", schema=db_schema)
        assert len(wake_ups()) == 1
    finally:
        loop.close()
