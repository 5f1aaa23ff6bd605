"""Singleton acquires commit without a WAL flush: what a Postgres crash would lose is put right.

The machine's Postgres is not ours to crash, so each test does to the tables what crash
recovery does: the unflushed acquire's lease row is gone, and the UNLOGGED guard table is empty
(Postgres truncates unlogged tables after a crash, an immediate shutdown or a failover).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import SkipMessage
from psycopg import sql

from dramatiq_reliable.singleton import TOKEN_GAP, Singleton, current_lease
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration

LEASE_MS = 300


@pytest.fixture
def setup(database_url: str, db_schema: str) -> Iterator[tuple[StubBroker, Singleton, dramatiq.Actor[Any, Any]]]:
    broker = StubBroker()
    middleware = Singleton(database=database_url, schema=db_schema, lease_ms=LEASE_MS, when_held="skip")
    broker.add_middleware(middleware)

    @dramatiq.actor(broker=broker, queue_name="crash_guard", concurrency_key=lambda key: key)
    def job(key: str) -> None:
        pass

    yield broker, middleware, job
    database, _ = middleware.database_for(broker)
    database.close()
    broker.close()


def _start(broker: StubBroker, middleware: Singleton, job: dramatiq.Actor[Any, Any], key: str) -> MessageProxy:
    """Run the before-hook of a fresh message for ``key``; the lease it took is current_lease()."""
    message = MessageProxy(job.message(key))
    middleware.before_process_message(broker, message)
    return message


def _crash(db: psycopg.Connection[Any], db_schema: str, *keys: str) -> None:
    """What recovery leaves after a crash that lost the unflushed acquires of ``keys``."""
    leases = sql.Identifier(db_schema, "singleton_leases")
    db.execute(sql.SQL("DELETE FROM {} WHERE key = ANY(%s)").format(leases), (list(keys),))
    db.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(db_schema, "singleton_guard")))


def _token(db: psycopg.Connection[Any], db_schema: str, key: str) -> int | None:
    row = db.execute(
        sql.SQL("SELECT token FROM {} WHERE key = %s").format(sql.Identifier(db_schema, "singleton_leases")), (key,)
    ).fetchone()
    return None if row is None else int(row[0])


def test_after_a_crash_no_key_is_handed_out_for_lease_ms_and_the_lost_run_gets_its_key_back(setup, db, db_schema, seen):
    broker, middleware, job = setup
    _start(broker, middleware, job, "a")
    lost = current_lease()
    assert lost is not None and _token(db, db_schema, "a") == lost.token
    _crash(db, db_schema, "a")

    # Every key waits out the quarantine, even a free one: postponed, never skipped.
    with pytest.raises(SkipMessage, match="quarantine"):
        _start(broker, middleware, job, "b")
    (postponed,) = [e.as_attributes() for e in seen if e.name == "singleton.held"]
    assert postponed["action"] == "postponed" and postponed["key"] == "b"
    assert 0 < postponed["delay_ms"] <= LEASE_MS
    assert broker.queues["crash_guard.DQ"].qsize() == 1

    # The run that lost its row in the crash is still going: its heartbeat puts the row back,
    # a live lease with the run's own token.
    middleware.renew(broker)
    assert _token(db, db_schema, "a") == lost.token and not lost.lost
    (live,) = db.execute(
        sql.SQL("SELECT expires_at > now() FROM {} WHERE key = 'a'").format(
            sql.Identifier(db_schema, "singleton_leases")
        )
    ).fetchone()
    assert live

    # After the quarantine, new leases carry tokens past any a lost acquire could have had...
    wait_for(lambda: _try(broker, middleware, job, "b"), timeout_ms=5000, message="the quarantine never ended")
    after = current_lease()
    assert after is not None and after.token > lost.token + TOKEN_GAP


def _try(broker: StubBroker, middleware: Singleton, job: dramatiq.Actor[Any, Any], key: str) -> bool:
    try:
        _start(broker, middleware, job, key)
    except SkipMessage:
        return False
    return True


def test_a_second_crash_notice_does_not_move_the_tokens_again(setup, db, db_schema):
    broker, middleware, job = setup
    _start(broker, middleware, job, "a")
    first = current_lease()
    assert first is not None
    _crash(db, db_schema)
    for key in ("b", "c"):  # two acquires find the row gone or the quarantine on: one jump
        with pytest.raises(SkipMessage, match="quarantine"):
            _start(broker, middleware, job, key)
    wait_for(lambda: _try(broker, middleware, job, "d"), timeout_ms=5000, message="the quarantine never ended")
    after = current_lease()
    assert after is not None and first.token + TOKEN_GAP < after.token < first.token + 2 * TOKEN_GAP


def test_a_lease_that_may_have_lapsed_is_not_put_back_but_reported_lost(setup, db, db_schema, seen):
    broker, middleware, job = setup
    _start(broker, middleware, job, "a")
    lease = current_lease()
    assert lease is not None
    # The heartbeat stalled past lease_ms: a successor may have run and released the key since.
    stalled_until = time.monotonic() + LEASE_MS / 1000
    wait_for(lambda: time.monotonic() > stalled_until, message="the clock did not move")
    db.execute(sql.SQL("DELETE FROM {} WHERE key = 'a'").format(sql.Identifier(db_schema, "singleton_leases")))
    middleware.renew(broker)
    assert _token(db, db_schema, "a") is None
    assert lease.lost
    assert [e.as_attributes()["key"] for e in seen if e.name == "singleton.lease_lost"] == ["a"]


def test_a_released_run_is_never_put_back_by_a_heartbeat_that_raced_it(setup, db, db_schema):
    broker, middleware, job = setup
    message = _start(broker, middleware, job, "a")
    middleware.after_process_message(broker, message)
    middleware.renew(broker)
    assert _token(db, db_schema, "a") is None


def test_a_takeover_of_a_lapsed_lease_lost_in_a_crash_is_taken_over_again_by_the_heartbeat(setup, db, db_schema):
    broker, middleware, job = setup
    leases = sql.Identifier(db_schema, "singleton_leases")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (key, token, message_id, owner, expires_at) "
            "VALUES ('a', 1, 'dead-run', 'dead-host', now() - interval '1 minute')"
        ).format(leases)
    )
    _start(broker, middleware, job, "a")
    lease = current_lease()
    assert lease is not None and _token(db, db_schema, "a") == lease.token
    # The crash brings back the lapsed row the takeover had replaced.
    db.execute(
        sql.SQL("UPDATE {} SET token = 1, message_id = 'dead-run', expires_at = now() - interval '1 minute'").format(
            leases
        )
    )
    _crash(db, db_schema)
    middleware.renew(broker)
    assert _token(db, db_schema, "a") == lease.token and not lease.lost
