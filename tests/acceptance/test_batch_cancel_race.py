"""A batch cancelled while 8 worker threads finish its children: the cancel returns (no deadlock), the callback
never runs, and no child starts after it.

CI runs one round; ``DR_SOAK_RUNS=N`` repeats it (a soak, quoted in the report that added it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import Cancellation, Idempotency, PostgresBroker, cancel_batch
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.workflows import Batch, Batches, batch_status

pytestmark = [pytest.mark.integration, pytest.mark.acceptance, pytest.mark.timeout(600)]

CHILDREN = 1000
RUNS = int(os.environ.get("DR_SOAK_RUNS", "1"))


@pytest.fixture
def broker(database_url: str, db_schema: str) -> Iterator[PostgresBroker]:
    made = PostgresBroker(database=database_url, schema=db_schema)
    made.add_middleware(Cancellation(), before=Callbacks)
    made.add_middleware(Idempotency(), before=Callbacks)
    made.add_middleware(Batches())
    dramatiq.set_broker(made)
    yield made
    made.close()


@pytest.mark.parametrize("run", range(RUNS))
def test_a_batch_cancelled_while_eight_threads_finish_its_children_never_fires(
    broker: PostgresBroker, db: psycopg.Connection[Any], db_schema: str, run: int
) -> None:
    started: list[int] = []
    fired: list[str] = []
    lock = threading.Lock()

    @dramatiq.actor(queue_name="cancel_race", broker=broker)
    def child(n: int) -> None:
        with lock:
            started.append(n)

    @dramatiq.actor(queue_name="cancel_race", broker=broker)
    def callback(what: str) -> None:
        fired.append(what)

    batch = Batch(callback=callback.message("callback"), on_failure=callback.message("on_failure"), broker=broker)
    with broker.transaction(), batch:
        for n in range(CHILDREN):
            batch.add(child.message(n))
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=8)
    worker.start()
    try:
        wait_for(
            lambda: batch_status(broker.database, db_schema, batch.id).done >= CHILDREN // 20,
            timeout_ms=60_000,
            message="the children did not start finishing",
        )
        result = cancel_batch(broker.database, db_schema, batch.id, by="race")
        with lock:
            ran_by_then = len(started)
        assert (result.changed, result.state) == (True, "cancelled")
        status = batch_status(broker.database, db_schema, batch.id)
        assert status.state == "cancelled" and status.done < CHILDREN, "the batch finished before the cancel"
        # Every child the cancel reached is gone from the queue table or tombstoned; drain the rest.
        queue = sql.Identifier(db_schema, "queue")
        wait_for(
            lambda: db.execute(sql.SQL("SELECT count(*) FROM {}").format(queue)).fetchone() == (0,),
            timeout_ms=60_000,
            message="the queue table did not drain after the cancel",
        )
        worker.join()
    finally:
        worker.stop()
    assert fired == [], "a cancelled batch fired"
    callback_row = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE message_id = ANY(%s)").format(queue),
        ([batch.callback.message_id, batch.on_failure.message_id] if batch.on_failure else [],),
    ).fetchone()
    assert callback_row == (0,)
    # At most the eight threads' jobs in hand (and their prefetch) ran after the cancel, never the rest.
    assert len(started) - ran_by_then <= 8 * 2 + 8, (len(started), ran_by_then)
    assert len(started) < CHILDREN
