"""A batch child's count cut off by a real Postgres outage (a TCP proxy cut) lands once Postgres is back.

With no job transaction bound the count runs on a connection of its own after the actor
returned; it is tried again while the worker holds the message, so the outage costs a pause,
not the count.  In acceptance (not test-alt): it waits out a two-second outage.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import dramatiq
import pytest
from support import TcpProxy

from dramatiq_reliable import Database, DeadLetters, PostgresBroker, PostgresDeadLetterStore
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.workflows import Batch, Batches, batch_status

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]


def _dead_letters(broker: PostgresBroker) -> list[Any]:
    return list(PostgresDeadLetterStore.from_broker(broker).list().items)


def test_a_count_cut_off_by_a_postgres_outage_lands_when_postgres_is_back(
    database_url: str, db_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = TcpProxy.to(database_url).start()
    # A pool that waits 0.3 s for a connection: without the retry, the count gives up mid-outage.
    database = Database(url=proxy.url, timeout_ms=300)
    broker = PostgresBroker(database=database, schema=db_schema)
    broker.add_middleware(DeadLetters())
    broker.add_middleware(Batches())
    dramatiq.set_broker(broker)
    ran: list[str] = []

    @dramatiq.actor(queue_name="outage", broker=broker, max_retries=0)
    def child(n: int) -> None:
        ran.append(f"child {n}")
        proxy.stop()  # every connection reset, none accepted: the count meets the outage
        threading.Timer(2.0, proxy.start).start()

    @dramatiq.actor(queue_name="outage", broker=broker)
    def report() -> None:
        ran.append("report")

    batch = Batch(callback=report.message(), broker=broker)
    with broker.transaction(), batch:
        batch.add(child.message(1))
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    try:
        with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.workflows"):
            worker.start()
            wait_for(lambda: "report" in ran, timeout_ms=30_000, message="the count was lost to the outage")
        assert any("trying again" in r.getMessage() for r in caplog.records), "the outage never met the count"
        assert ran == ["child 1", "report"]
        assert _dead_letters(broker) == []
        status = batch_status(broker.database, db_schema, batch.id)
        assert (status.done, status.dead, status.state) == (1, 0, "succeeded")
    finally:
        worker.stop()
        broker.close()
        database.close()
        proxy.stop()
