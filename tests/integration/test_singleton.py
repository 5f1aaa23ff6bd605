"""Singleton actors against a real Postgres and RabbitMQ: runs sharing a key never overlap."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Callbacks, MiddlewareError
from psycopg import sql
from support import closed_port

from dramatiq_reliable import Database, DatabaseUnavailable, OutboxBroker, Tracing, WorkerRelay, events
from dramatiq_reliable.singleton import Singleton, current_lease
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _install(broker: OutboxBroker, **options: Any) -> Singleton:
    middleware = Singleton(**options)
    broker.add_middleware(middleware, before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    return middleware


def _leases(db: psycopg.Connection[Any], db_schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL("SELECT key, token, message_id, buffered_message_id FROM {} ORDER BY key").format(
            sql.Identifier(db_schema, "singleton_leases")
        )
    ).fetchall()


def _held(seen: list[events.Event]) -> list[dict[str, Any]]:
    return [e.as_attributes() for e in seen if e.name == "singleton.held"]


@pytest.mark.pooler
def test_a_run_sent_while_the_key_is_held_is_skipped_and_the_lease_goes_with_the_run(
    broker, queue_name, worker, db, db_schema, seen
):
    _install(broker)
    release = threading.Event()
    tokens: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True, singleton_when_held="skip")
    def nightly(n: int) -> None:
        lease = current_lease()
        assert lease is not None
        tokens.append(lease.token)
        release.wait(10)

    worker.start()
    nightly.send(1)
    wait_for(lambda: tokens, message="the first run never started")
    assert [row[0] for row in _leases(db, db_schema)] == [nightly.actor_name]
    second = nightly.send(2)
    wait_for(lambda: _held(seen), timeout_ms=15000, message="the second run was not settled")
    release.set()
    wait_for(lambda: not _leases(db, db_schema), message="the lease was not released after the run")
    assert len(tokens) == 1
    (held,) = _held(seen)
    assert held["action"] == "skipped" and held["message_id"] == second.message_id and held["key"] == nightly.actor_name


def test_a_postponed_run_runs_after_the_release_without_spending_its_retries(
    broker, queue_name, worker, db, db_schema, seen
):
    _install(broker, retry_delay_ms=200)
    release = threading.Event()
    runs: list[tuple[int, dict[str, Any]]] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, concurrency_key=lambda account, n: f"sync-{account}")
    def sync(account: int, n: int) -> None:
        lease = current_lease()
        assert lease is not None
        runs.append((n, dict(dramatiq.middleware.CurrentMessage.get_current_message().options)))
        release.wait(10)

    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    worker.start()
    sync.send(7, 1)
    wait_for(lambda: runs, message="the first run never started")
    sync.send(7, 2)
    wait_for(lambda: _held(seen), timeout_ms=15000, message="the second run was not postponed")
    release.set()
    wait_for(lambda: len(runs) == 2, timeout_ms=15000, message="the postponed run never ran")
    wait_for(lambda: not _leases(db, db_schema), message="the lease was not released")
    assert [n for n, _ in runs] == [1, 2]
    options = runs[1][1]
    assert options["singleton_postponed"] >= 1
    assert options.get("retries", 0) == 0
    assert {h["action"] for h in _held(seen)} == {"postponed"}


def test_buffer_keeps_one_message_for_the_release_and_skips_the_rest(broker, queue_name, worker, db, db_schema, seen):
    _install(broker, when_held="buffer")
    release = threading.Event()
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def report(n: int) -> None:
        runs.append(n)
        if n == 1:
            release.wait(10)

    worker.start()
    report.send(1)
    wait_for(lambda: runs, message="the first run never started")
    buffered = report.send(2)
    wait_for(lambda: len(_held(seen)) == 1, timeout_ms=15000, message="the second message was not buffered")
    report.send(3)
    wait_for(lambda: len(_held(seen)) == 2, timeout_ms=15000, message="the third message was not settled")
    assert _leases(db, db_schema)[0][3] == buffered.message_id
    release.set()
    wait_for(lambda: len(runs) == 2, timeout_ms=15000, message="the buffered message never ran")
    wait_for(lambda: not _leases(db, db_schema), message="the lease was not released")
    assert runs == [1, 2]
    assert [h["action"] for h in _held(seen)] == ["buffered", "skipped"]


def test_a_failed_run_releases_its_lease(broker, queue_name, worker, db, db_schema):
    _install(broker)
    attempts: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True, max_retries=0)
    def broken() -> None:
        attempts.append(1)
        raise RuntimeError("boom")

    worker.start()
    broken.send()
    wait_for(lambda: attempts, message="the run never started")
    wait_for(lambda: not _leases(db, db_schema), message="the failed run kept its lease")


def test_a_lapsed_lease_is_taken_over_with_a_larger_fencing_token(broker, queue_name, worker, db, db_schema, seen):
    _install(broker, when_held="skip")
    tokens: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def job() -> None:
        lease = current_lease()
        assert lease is not None
        tokens.append(lease.token)

    table = sql.Identifier(db_schema, "singleton_leases")
    tokens_seq = sql.Identifier(db_schema, "singleton_tokens")
    # A holder that died: its lease is live for a while, then lapses.
    db.execute(
        sql.SQL(
            "INSERT INTO {} (key, token, message_id, owner, expires_at) "
            "VALUES (%s, nextval({}), 'dead', 'dead-host:1', now() + interval '1 hour')"
        ).format(table, sql.Literal(tokens_seq.as_string(db))),
        (job.actor_name,),
    )
    dead_token = _leases(db, db_schema)[0][1]
    worker.start()
    job.send()
    wait_for(lambda: _held(seen), timeout_ms=15000, message="a live foreign lease did not hold the key")
    assert tokens == []
    db.execute(sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second'").format(table))
    job.send()
    wait_for(lambda: tokens, timeout_ms=15000, message="the lapsed lease was not taken over")
    assert tokens[0] > dead_token
    wait_for(lambda: not _leases(db, db_schema), message="the new holder did not release")


def test_postgres_down_fails_closed_so_the_actor_cannot_run(broker, queue_name):
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres?connect_timeout=1"
    middleware = _install(broker, database=Database(url=url, timeout_ms=1000))

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def guarded() -> None:
        raise AssertionError("must not run")

    message = MessageProxy(guarded.message())
    # A MiddlewareError is what Dramatiq lets out of a before-hook: the actor does not run and
    # the retry middleware retries the message.
    with pytest.raises(DatabaseUnavailable, match="the actor did not run") as caught:
        middleware.before_process_message(broker, message)
    assert isinstance(caught.value, MiddlewareError)
    assert "password" not in str(caught.value)
    assert current_lease() is None


def test_the_heartbeat_keeps_a_long_run_s_lease_and_reports_a_lease_taken_over(
    broker, queue_name, worker, db, db_schema, seen
):
    middleware = _install(broker, lease_ms=600, when_held="skip")
    release = threading.Event()
    started: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def long_run() -> None:
        started.append(1)
        release.wait(10)

    table = sql.Identifier(db_schema, "singleton_leases")
    worker.start()
    long_run.send()
    wait_for(lambda: started, message="the run never started")
    (first,) = db.execute(sql.SQL("SELECT token, expires_at FROM {}").format(table)).fetchall()
    # Past three lease lengths the lease is still this run's, renewed, not lapsed.
    wait_for(
        lambda: (
            db.execute(sql.SQL("SELECT expires_at FROM {}").format(table)).fetchone()[0] > first[1]
            and db.execute("SELECT now() - %s > interval '1.8 s'", (first[1],)).fetchone()[0]
        ),
        timeout_ms=10_000,
        message="the lease was not renewed",
    )
    (still,) = db.execute(sql.SQL("SELECT token, expires_at > now() FROM {}").format(table)).fetchall()
    assert still == (first[0], True)
    # Another run takes the key over (as after a lapse): the heartbeat notices and says so.
    db.execute(sql.SQL("UPDATE {} SET token = token + 1000").format(table))
    middleware.renew(broker)
    release.set()
    lost = [e.as_attributes() for e in seen if e.name == "singleton.lease_lost"]
    assert lost, "the heartbeat did not report the lease taken over"
    assert lost[0]["token"] == first[0] and lost[0]["key"] == long_run.actor_name


def test_a_message_buffered_under_a_dead_holder_is_sent_once_its_lease_lapses(
    broker, queue_name, worker, db, db_schema
):
    middleware = _install(broker, when_held="buffer")
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def job(n: int) -> None:
        runs.append(n)

    table = sql.Identifier(db_schema, "singleton_leases")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (key, token, message_id, owner, expires_at) "
            "VALUES (%s, 1, 'dead', 'dead-host:1', now() + interval '1 hour')"
        ).format(table),
        (job.actor_name,),
    )
    worker.start()
    job.send(5)
    wait_for(
        lambda: db.execute(sql.SQL("SELECT buffered_body IS NOT NULL FROM {}").format(table)).fetchone() == (True,),
        timeout_ms=15000,
        message="the message was not buffered",
    )
    assert middleware.sweep(broker) == 0  # the holder's lease is live: nothing to hand on
    db.execute(sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second'").format(table))
    assert middleware.sweep(broker) == 1
    wait_for(lambda: runs == [5], timeout_ms=15000, message="the buffered message never ran")
    wait_for(lambda: not _leases(db, db_schema), message="the lease was not released")


def test_under_tracing_a_held_key_marks_the_span_and_counts_by_action(broker, queue_name, worker, otel):
    tracing = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider, health_cache_ms=0)
    broker.add_middleware(tracing, before=Callbacks)
    _install(broker, when_held="skip")
    release = threading.Event()
    started: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def nightly(n: int) -> None:
        started.append(n)
        release.wait(10)

    try:
        worker.start()
        nightly.send(1)
        wait_for(lambda: started, message="the first run never started")
        nightly.send(2)
        wait_for(
            lambda: (
                otel.total("dramatiq_reliable.singleton_held", **{"dramatiq_reliable.singleton.held": "skipped"}) == 1
            ),
            timeout_ms=15000,
            message="the held key was not counted",
        )
        release.set()
        wait_for(
            lambda: [s for s in otel.spans() if s.attributes.get("dramatiq_reliable.singleton.held") == "skipped"],
            timeout_ms=15000,
            message="the skipped attempt's span was not marked",
        )
    finally:
        release.set()
        tracing.close()
    assert started == [1]
