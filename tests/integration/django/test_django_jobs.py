"""Inside a job, the ORM writes on the job's own transaction: they commit with the idempotency key or not at all."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import pytest
from psycopg import sql

from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _worker(broker: Any) -> Any:
    from shop.tests import worker  # the example's: a worker thread, and the relay with the outbox

    return worker(broker)


def _counting_actor(broker: Any, fail_once: set[int], seen: dict[str, Any]) -> Any:
    from django.db import connection, transaction
    from django.db.models import F
    from shop.models import Order

    from dramatiq_reliable import job_connection

    def count_receipt(order_id: int) -> None:
        Order.objects.filter(pk=order_id).update(receipts_sent=F("receipts_sent") + 1)
        seen["same_connection"] = job_connection() is connection.connection
        transaction.on_commit(lambda: seen.setdefault("committed", []).append(order_id))
        if order_id in fail_once:
            fail_once.discard(order_id)
            raise ConnectionError("the mail server hung up after the receipt was counted")

    return dramatiq.actor(
        count_receipt, broker=broker, actor_name="count_receipt", queue_name="receipts", min_backoff=10, max_backoff=20
    )


def _key_committed(broker: Any) -> bool:
    """Whether the job's idempotency key committed (the successful run's transaction)."""
    with broker.database.connection() as conn:
        query = sql.SQL("SELECT count(*) FROM {} WHERE actor_name = 'count_receipt'")
        row = conn.execute(query.format(sql.Identifier(broker.schema, "processed_jobs"))).fetchone()
        conn.rollback()
        return bool(row and row[0] == 1)


def _run_once_failing(broker: Any) -> tuple[int, dict[str, Any]]:
    """An order whose job counts a receipt with the ORM, fails once after that write, then succeeds."""
    from shop.models import Order

    seen: dict[str, Any] = {}
    fail_once: set[int] = set()
    actor = _counting_actor(broker, fail_once, seen)
    order = Order.objects.create(item="lamp")
    fail_once.add(order.pk)
    actor.send(order.pk)
    with _worker(broker):
        wait_for(lambda: _key_committed(broker), timeout_ms=20_000, message="the job never committed")
    assert not fail_once, "the first run did not fail as planned"
    order.refresh_from_db()
    return order.receipts_sent, seen


def test_an_orm_write_before_a_retryable_error_applies_once(django_broker):
    receipts, seen = _run_once_failing(django_broker)
    assert receipts == 1
    assert seen["same_connection"] is True
    # on_commit ran once, for the run that committed; the failed run's callback was dropped
    assert len(seen["committed"]) == 1


def test_with_pooled_job_connections_the_orm_write_escapes_the_job(django_project, django_schema):
    """The control: Idempotency on its own pool, the ORM writes commit by themselves, twice."""
    from django.db import connections

    from dramatiq_reliable import Idempotency, PostgresBroker, build_middleware
    from dramatiq_reliable.django import CloseOldConnections, DjangoDatabase

    middleware = build_middleware(middleware=[CloseOldConnections(), Idempotency()])
    broker = PostgresBroker(database=DjangoDatabase("default"), schema=django_schema, middleware=middleware)
    try:
        receipts, seen = _run_once_failing(broker)
    finally:
        broker.close()
        with connections["default"].cursor() as cursor:
            cursor.execute("TRUNCATE shop_order")
    assert receipts == 2
    assert seen["same_connection"] is False
    assert len(seen["committed"]) == 2  # autocommit: each run's on_commit ran at once


def test_a_job_leaves_no_atomic_block_open_on_the_worker_thread(django_broker):
    from django.db import connection

    states: list[tuple[bool, bool]] = []
    done = threading.Event()

    def inspect() -> None:
        states.append((connection.in_atomic_block, connection.get_autocommit()))
        done.set()

    actor = dramatiq.actor(inspect, broker=django_broker, actor_name="inspect", queue_name="inspect")
    after = dramatiq.actor(
        lambda: states.append((connection.in_atomic_block, connection.get_autocommit())) or done.set(),
        broker=django_broker,
        actor_name="after",
        queue_name="inspect",
        idempotency="off",
    )
    actor.send()
    with _worker(django_broker):
        wait_for(done.is_set, message="the job never ran")
        done.clear()
        after.send()
        wait_for(done.is_set, message="the second job never ran")
    # inside the transactional job: Django's connection is in atomic(); the next job (off) is back in autocommit
    assert states == [(True, False), (False, True)]


def test_job_connections_on_another_database_than_the_keys_are_refused(django_broker):
    from dramatiq_reliable import ConfigurationError
    from dramatiq_reliable.django import DjangoJobConnections

    with pytest.raises(ConfigurationError, match=r"another database than DATABASES\['other'\]"):
        DjangoJobConnections("other").acquire(django_broker.database, 1.0)
