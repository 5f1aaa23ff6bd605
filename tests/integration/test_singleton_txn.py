"""Singleton keys taken in the job's own transaction (transactional Idempotency), against real services.

The key is a row lock of the job's transaction: held exactly as long as it, settled without
waiting by every other run, whether that run takes its keys the same way or with an autocommit
lease (a mixed fleet during a rolling deploy, an actor without Idempotency).
"""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import Idempotency, OutboxBroker, WorkerRelay, events, job_connection
from dramatiq_reliable.singleton import Lease, Singleton, current_lease
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _install(broker: OutboxBroker, **options: Any) -> Singleton:
    middleware = Singleton(retry_delay_ms=100, **options)
    broker.add_middleware(middleware, before=Callbacks)
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    return middleware


def _lease_row(db: psycopg.Connection[Any], db_schema: str, key: str) -> tuple[Any, ...] | None:
    """The committed row of ``key`` (token, expires_at is -infinity); read without waiting for a lock.

    A free row written for the job-transaction path has token 0.
    """
    return db.execute(
        sql.SQL("SELECT token, expires_at = '-infinity' FROM {} WHERE key = %s").format(
            sql.Identifier(db_schema, "singleton_leases")
        ),
        (key,),
    ).fetchone()


def _locked(db: psycopg.Connection[Any], db_schema: str, key: str) -> bool:
    """Whether a transaction holds the key's row right now."""
    try:
        with db.transaction():
            db.execute(
                sql.SQL("SELECT 1 FROM {} WHERE key = %s FOR UPDATE NOWAIT").format(
                    sql.Identifier(db_schema, "singleton_leases")
                ),
                (key,),
            )
    except psycopg.errors.LockNotAvailable:
        return True
    return False


def _held(seen: list[events.Event]) -> list[dict[str, Any]]:
    return [e.as_attributes() for e in seen if e.name == "singleton.held"]


def test_two_runs_contending_in_job_transactions_never_overlap_and_the_lock_ends_with_the_commit(
    broker, queue_name, worker, db, db_schema, seen
):
    _install(broker)
    release = threading.Event()
    leases: list[Lease] = []
    table = sql.Identifier(db_schema, "done")
    db.execute(sql.SQL("CREATE TABLE {} (n int)").format(table))

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True, singleton_when_held="skip")
    def nightly(n: int) -> None:
        lease = current_lease()
        assert lease is not None
        leases.append(lease)
        job_connection().execute(sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(table), (n,))
        if n == 1:
            release.wait(10)

    worker.start()  # two worker threads: the second message meets the first one's lock
    nightly.send(1)
    wait_for(lambda: leases, message="the first run never started")
    assert leases[0].in_transaction
    assert _locked(db, db_schema, nightly.actor_name)
    second = nightly.send(2)
    wait_for(lambda: _held(seen), timeout_ms=15000, message="the second run was not settled while the first ran")
    (held,) = _held(seen)
    assert held["action"] == "skipped" and held["message_id"] == second.message_id
    release.set()
    wait_for(lambda: not _locked(db, db_schema, nightly.actor_name), message="the commit did not release the key")
    # The row was locked, never written: still free, nothing to delete, nothing to lapse.
    assert _lease_row(db, db_schema, nightly.actor_name) == (0, True)
    assert db.execute(sql.SQL("SELECT n FROM {}").format(table)).fetchall() == [(1,)]
    nightly.send(3)
    wait_for(lambda: len(leases) == 2, timeout_ms=15000, message="the key was not free after the commit")
    assert leases[1].token > leases[0].token  # fencing tokens still grow


def test_a_rolled_back_job_releases_its_key_and_the_next_token_is_larger(broker, queue_name, worker, db, db_schema):
    _install(broker)
    tokens: list[int] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True, max_retries=1, min_backoff=10)
    def flaky() -> None:
        lease = current_lease()
        assert lease is not None and lease.in_transaction
        tokens.append(lease.token)
        if len(tokens) == 1:
            raise RuntimeError("boom")

    worker.start()
    flaky.send()
    wait_for(lambda: len(tokens) == 2, timeout_ms=15000, message="the retry after the rollback never ran")
    assert tokens[1] > tokens[0]
    wait_for(lambda: not _locked(db, db_schema, flaky.actor_name), message="the key stayed locked")
    assert _lease_row(db, db_schema, flaky.actor_name) == (0, True)


def test_job_transaction_and_autocommit_leases_respect_each_other_without_waiting(
    broker, queue_name, worker, db, db_schema, seen
):
    _install(broker)
    in_txn, in_autocommit = threading.Event(), threading.Event()
    leases: list[Lease] = []

    def key(n: int) -> str:
        return "shared"

    @dramatiq.actor(queue_name=queue_name, broker=broker, concurrency_key=key, singleton_when_held="skip")
    def transactional(n: int) -> None:
        lease = current_lease()
        assert lease is not None
        leases.append(lease)
        in_txn.wait(10)

    # No Idempotency for this one: the autocommit lease, as an older worker of the fleet takes it.
    @dramatiq.actor(
        queue_name=queue_name, broker=broker, concurrency_key=key, idempotency="off", singleton_when_held="buffer"
    )
    def plain(n: int) -> None:
        lease = current_lease()
        assert lease is not None
        leases.append(lease)
        in_autocommit.wait(10)

    worker.start()
    transactional.send(1)
    wait_for(lambda: leases, message="the transactional run never started")
    # when_held='buffer' cannot buffer on a row a job transaction holds: postponed, never dropped.
    buffered = plain.send(2)
    wait_for(lambda: _held(seen), timeout_ms=15000, message="the autocommit run waited for the job transaction")
    assert _held(seen)[0]["action"] == "postponed" and _held(seen)[0]["message_id"] == buffered.message_id
    assert len(leases) == 1
    in_txn.set()
    wait_for(lambda: len(leases) == 2, timeout_ms=15000, message="the postponed autocommit run never ran")
    assert not leases[1].in_transaction and leases[1].token > leases[0].token
    # Now the autocommit lease holds the key: the job transaction's run is held, not run.
    skipped = transactional.send(3)
    wait_for(lambda: len(_held(seen)) == 2, timeout_ms=15000, message="the transactional run was not settled")
    assert _held(seen)[1]["action"] == "skipped" and _held(seen)[1]["message_id"] == skipped.message_id
    in_autocommit.set()
    wait_for(lambda: _lease_row(db, db_schema, "shared") is None, message="the autocommit lease was not released")
    transactional.send(4)
    wait_for(lambda: len(leases) == 3, timeout_ms=15000, message="the key did not come back to the job transaction")
    assert leases[2].in_transaction and leases[2].token > leases[1].token


def test_job_transaction_false_keeps_the_autocommit_lease(broker, queue_name, worker, db, db_schema):
    _install(broker, job_transaction=False)
    leases: list[Lease] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def nightly() -> None:
        lease = current_lease()
        assert lease is not None
        leases.append(lease)

    worker.start()
    nightly.send()
    wait_for(lambda: leases, message="the run never started")
    assert not leases[0].in_transaction
    wait_for(lambda: _lease_row(db, db_schema, nightly.actor_name) is None, message="the lease was not released")


def test_two_pools_on_the_same_url_still_take_the_key_in_the_job_transaction(
    broker, queue_name, worker, database_url, db_schema
):
    # Singleton(database=URL) and Idempotency(database=URL) built apart hold two pools on one
    # database: the key is still a lock of the job's transaction, not an autocommit lease.
    broker.add_middleware(Singleton(retry_delay_ms=100, database=database_url, schema=db_schema), before=Callbacks)
    broker.add_middleware(Idempotency(database=database_url, schema=db_schema), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    leases: list[Lease] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, singleton=True)
    def nightly() -> None:
        lease = current_lease()
        assert lease is not None
        job_connection().execute("SELECT 1")
        leases.append(lease)

    worker.start()
    nightly.send()
    wait_for(lambda: leases, message="the run never started")
    assert leases[0].in_transaction
