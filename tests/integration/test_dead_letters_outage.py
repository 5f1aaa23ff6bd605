"""Dead letters through a Postgres blip: a cut costs a delay, not the row, and every wait is bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.common import xq_name
from dramatiq.message import Message
from dramatiq.middleware import Retries
from psycopg import sql
from support import TcpProxy

from dramatiq_reliable import Database, OutboxBroker, WorkerRelay
from dramatiq_reliable.dead_letters import DeadLetters
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _through(url: str, proxy: TcpProxy) -> str:
    """``url`` with its host and port replaced by the proxy's (user, database and options kept)."""
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.pop("hostaddr", None)
    params.update(host="127.0.0.1", port=str(proxy.port), connect_timeout="2")
    return psycopg.conninfo.make_conninfo("", **params)


def _proxy_to(url: str) -> TcpProxy:
    params = psycopg.conninfo.conninfo_to_dict(url)
    return TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    running = _proxy_to(database_url).start()
    yield running
    running.stop()


@pytest.fixture
def make_broker(rabbitmq_url: str, database_url: str, db_schema: str) -> Iterator[Callable[..., OutboxBroker]]:
    made: list[OutboxBroker] = []
    workers: list[dramatiq.Worker] = []

    def make(*middleware: Any) -> OutboxBroker:
        broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, middleware=list(middleware))
        dramatiq.set_broker(broker)
        made.append(broker)
        return broker

    make.workers = workers  # type: ignore[attr-defined]
    yield make
    for worker in workers:
        worker.stop()
    for broker in made:
        broker.close()


def _rows(db: psycopg.Connection[Any], db_schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL("SELECT message_id, reason FROM {}.dead_letters ORDER BY id").format(sql.Identifier(db_schema))
    ).fetchall()


def _failed(queue_name: str) -> MessageProxy:
    proxy = MessageProxy(Message(queue_name=queue_name, actor_name="charge", args=(1,), kwargs={}, options={}))
    try:
        raise ValueError("card declined")
    except ValueError as error:
        proxy.stuff_exception(error)
    proxy.fail()
    return proxy


def test_a_postgres_cut_while_a_job_dies_costs_a_delay_and_the_row_is_stored_on_a_fresh_connection(
    make_broker, proxy, database_url, queue_name, rabbit, db, db_schema, caplog
):
    dead_letters = DeadLetters(database=_through(database_url, proxy), schema=db_schema, timeout_ms=20_000)
    broker = make_broker(dead_letters, WorkerRelay(poll_interval_ms=100), Retries(max_retries=0))
    # A first dead letter leaves a pooled connection through the proxy: the cut resets its socket.
    assert dead_letters.capture(broker, _failed(queue_name)) is not None

    def fails(n: int) -> None:
        raise KeyError(f"order {n}")

    task = dramatiq.actor(fails, actor_name=f"{queue_name}_f", queue_name=queue_name, broker=broker, throws=KeyError)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    make_broker.workers.append(worker)
    proxy.stop()  # Postgres is cut
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.dead_letters"):
        message = task.send(7)
        wait_for(
            lambda: any("retrying on a fresh connection" in r.getMessage() for r in caplog.records),
            timeout_ms=15_000,
            message="the write was not retried",
        )
        assert _rows(db, db_schema)[1:] == []
        proxy.start()  # ... and back within the deadline
        wait_for(lambda: len(_rows(db, db_schema)) == 2, timeout_ms=20_000, message="the row was never stored")
    assert _rows(db, db_schema)[1][0] == message.message_id
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]
    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, timeout_ms=10_000, message="the nack did not follow")


def test_timeout_ms_bounds_the_wait_even_on_a_shared_pool_whose_own_timeout_is_longer(
    make_broker, database_url, queue_name, db, db_schema, caplog
):
    shared = Database(url=database_url, max_size=1, timeout_ms=10_000)
    broker = make_broker(Retries(max_retries=0))
    dead_letters = DeadLetters(database=shared, schema=db_schema, timeout_ms=500)
    try:
        with shared.connection():  # the pool's only connection is busy
            started = time.monotonic()
            with caplog.at_level(logging.CRITICAL, logger="dramatiq_reliable.dead_letters"):
                stored = dead_letters.capture(broker, _failed(queue_name))
            waited = time.monotonic() - started
    finally:
        shared.close()
    assert stored is None
    assert waited < 5, f"waited {waited:.1f} s: the pool's 10 s, not timeout_ms=500"
    assert any("NOT stored" in r.getMessage() for r in caplog.records)
    assert _rows(db, db_schema) == []
