"""Behind PgBouncer in transaction mode (tests/pgbouncer.py): the pooler is detected, prepared
statements are not used there, and what needs a session (LISTEN) goes to ``listen_database=``
or polls.  The rest of the parts run through the pooler in the tests marked ``pooler``."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import dramatiq
import psycopg
import pytest
from support import closed_port, proxied, running

from dramatiq_reliable import Database, OutboxBroker, PostgresBroker, Relay
from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.outbox import wake, wake_relays
from dramatiq_reliable.pooler import listen_target
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def pooled(pgbouncer_url: str) -> Any:
    database = Database(url=pgbouncer_url, max_size=2)
    yield database
    database.close()


def test_the_pooler_is_detected_and_postgres_itself_is_not(pooled, direct_database_url):
    direct = Database(url=direct_database_url, max_size=1)
    try:
        assert pooled.transaction_pooled() is True
        assert direct.transaction_pooled() is False
    finally:
        direct.close()


def test_a_statement_run_many_times_while_the_server_process_changes_does_not_fail(pooled, pgbouncer_url):
    # psycopg prepares a statement after 5 runs, on the server process of that moment; here each
    # second run goes to another process (the other client holds the first one's), where a
    # prepared statement would not exist ("prepared statement _pg3_0 does not exist").
    with pooled.autocommit() as conn, psycopg.connect(pgbouncer_url, autocommit=True) as other:
        assert conn.prepare_threshold is None
        backends = set()
        for i in range(12):
            if i % 2:
                with other.transaction():
                    other.execute("SELECT 1")
                    row = conn.execute("SELECT %s::int + 1, pg_backend_pid()", (i,)).fetchone()
            else:
                row = conn.execute("SELECT %s::int + 1, pg_backend_pid()", (i,)).fetchone()
            assert row is not None and row[0] == i + 1
            backends.add(row[1])
        assert len(backends) > 1  # the case that broke: one client, several server processes


def test_the_web_pages_read_pool_prepares_nothing_so_it_works_behind_the_pooler(pgbouncer_url):
    from dramatiq_reliable.web.pools import ReadPool

    reads = ReadPool(pgbouncer_url, statement_timeout_ms=5_000)
    try:
        with reads.get().connection() as conn:
            assert conn.prepare_threshold is None
    finally:
        reads.close()


def test_the_web_pages_statement_timeout_bounds_its_reads_behind_the_pooler_and_stays_with_them(pgbouncer_url):
    # PgBouncer refuses libpq's ``options`` (or, told to ignore it as here, drops it), so the
    # page's bound cannot ride on the connection: each borrow sets it for its own transaction.
    from dramatiq_reliable.web.pools import ReadPool

    reads = ReadPool(pgbouncer_url, statement_timeout_ms=300)
    try:
        for borrow in (reads.get().connection, reads.get().autocommit):
            with pytest.raises(psycopg.errors.QueryCanceled), borrow() as conn:
                conn.execute("SELECT pg_sleep(5)")
            with borrow() as conn:
                assert conn.execute("SHOW statement_timeout").fetchone() == ("300ms",)
                with conn.transaction():  # what the library runs inside nests, still bounded
                    assert conn.execute("SHOW statement_timeout").fetchone() == ("300ms",)
        # Nothing stays on the server processes that other clients of the pooler get next.
        with psycopg.connect(pgbouncer_url, autocommit=True, prepare_threshold=None) as other:
            for _ in range(12):
                assert other.execute("SHOW statement_timeout").fetchone() == ("0",)
    finally:
        reads.close()


def test_directly_statements_are_still_prepared(direct_database_url):
    direct = Database(url=direct_database_url, max_size=1)
    try:
        with direct.connection() as conn:
            assert conn.prepare_threshold == 5
    finally:
        direct.close()


def _actor(broker: Any, queue_name: str, ran: list[int] | None = None) -> dramatiq.Actor[Any, Any]:
    def record(value: int) -> None:
        if ran is not None:
            ran.append(value)

    return dramatiq.actor(record, actor_name=f"{queue_name}_actor", queue_name=queue_name, broker=broker)


def test_behind_the_pooler_the_relay_polls_says_so_once_and_publishes(
    pgbouncer_url, db_schema, queue_name, rabbit, caplog
):
    broker = OutboxBroker(database=pgbouncer_url, schema=db_schema, url=rabbit.url)
    try:
        task = _actor(broker, queue_name)
        relay = Relay.from_broker(broker, poll_interval_ms=200)
        with caplog.at_level(logging.WARNING, "dramatiq_reliable.pooler"), running(relay.run, relay.stop):
            wait_for(lambda: relay._sleeping_s is not None, message="relay never went idle")
            with broker.transaction():
                task.send(1)
            wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="row never relayed")
        assert relay.listen is False and relay._listener is None
        said = [r.getMessage() for r in caplog.records if "transaction pooler" in r.getMessage()]
        assert len(said) == 1 and "listen_database=" in said[0]
    finally:
        broker.close()


def test_with_listen_database_the_relay_hears_wake_ups_on_the_direct_connection(
    pgbouncer_url, direct_database_url, db_schema, queue_name, rabbit, monkeypatch
):
    monkeypatch.setattr(wake, "FIRST_IDLE_S", 600.0)  # only a wake-up delivers within the timeout
    broker = OutboxBroker(database=pgbouncer_url, schema=db_schema, url=rabbit.url)
    try:
        task = _actor(broker, queue_name)
        relay = Relay.from_broker(broker, poll_interval_ms=600_000, listen_database=direct_database_url)
        with running(relay.run, relay.stop):
            wait_for(lambda: (relay._sleeping_s or 0) > 60, message="relay never went to sleep")
            assert relay._listener is not None and relay._listener.info.port != psycopg.conninfo.conninfo_to_dict(
                pgbouncer_url
            ).get("port")
            with broker.transaction() as conn:  # through the pooler: NOTIFY is sent at commit
                task.send(1)
                wake_relays(conn, schema=db_schema)
            wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="wake-up not heard")
    finally:
        broker.close()


def _consume(broker: PostgresBroker, queue_name: str) -> list[int]:
    ran: list[int] = []
    task = _actor(broker, queue_name, ran)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        task.send(7)
        wait_for(lambda: ran == [7], timeout_ms=10_000, message="the job never ran")
    finally:
        worker.stop()
    return ran


def test_behind_the_pooler_postgres_consumers_poll_without_a_listener(pgbouncer_url, db_schema, queue_name, caplog):
    broker = PostgresBroker(database=pgbouncer_url, schema=db_schema)
    try:
        with caplog.at_level(logging.WARNING, "dramatiq_reliable.pooler"):
            assert _consume(broker, queue_name) == [7]
        assert not broker.listener.listening.is_set()
        assert any("queue listener" in r.getMessage() and "polling" in r.getMessage() for r in caplog.records)
    finally:
        broker.close()


def test_with_listen_database_postgres_consumers_listen_directly(
    pgbouncer_url, direct_database_url, db_schema, queue_name
):
    broker = PostgresBroker(database=pgbouncer_url, schema=db_schema, listen_database=direct_database_url)
    try:
        assert _consume(broker, queue_name) == [7]
        wait_for(broker.listener.listening.is_set, message="the listener never listened on the direct URL")
    finally:
        broker.close()


def test_a_listen_database_through_the_pooler_is_refused_with_the_fix(pooled, pgbouncer_url):
    with pytest.raises(ConfigurationError, match="goes through a transaction pooler too.*direct Postgres URL"):
        listen_target(pooled, pgbouncer_url, who="outbox relay")


def test_an_unreachable_listen_database_is_refused_without_its_password(pooled, direct_database_url):
    wrong = psycopg.conninfo.make_conninfo(
        proxied(direct_database_url, closed_port(), connect_timeout="2"), password="s3cret-pw"
    )
    with pytest.raises(ConfigurationError, match="cannot connect to listen_database=") as raised:
        listen_target(pooled, wrong, who="outbox relay")
    assert "s3cret-pw" not in str(raised.value)


def test_a_listen_database_of_another_database_is_refused(pooled, direct_database_url, db):
    name = f"dr_pooler_{uuid.uuid4().hex[:8]}"
    db.execute(f"DROP DATABASE IF EXISTS {name}")
    db.execute(f"CREATE DATABASE {name}")
    try:
        other = psycopg.conninfo.make_conninfo(direct_database_url, dbname=name)
        with pytest.raises(ConfigurationError, match="notifications would never arrive"):
            listen_target(pooled, other, who="outbox relay")
    finally:
        db.execute(f"DROP DATABASE IF EXISTS {name}")


def test_a_relay_given_a_wrong_listen_database_logs_the_error_and_still_publishes(
    pgbouncer_url, db_schema, queue_name, rabbit, caplog
):
    broker = OutboxBroker(database=pgbouncer_url, schema=db_schema, url=rabbit.url)
    try:
        task = _actor(broker, queue_name)
        relay = Relay.from_broker(broker, poll_interval_ms=200, listen_database=pgbouncer_url)
        with caplog.at_level(logging.ERROR, "dramatiq_reliable.outbox.relay"), running(relay.run, relay.stop):
            with broker.transaction():
                task.send(1)
            wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="row never relayed")
        assert any("goes through a transaction pooler too" in r.getMessage() for r in caplog.records)
    finally:
        broker.close()
