"""WorkerRelay inside a real worker process: SIGTERM finishes the batch in hand and exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

_WORKER = """
import os
import dramatiq
from dramatiq_reliable import OutboxBroker, WorkerRelay

broker = OutboxBroker(url=os.environ["T_RABBITMQ_URL"], database=os.environ["T_DATABASE_URL"],
                      schema=os.environ["T_SCHEMA"])
broker.add_middleware(WorkerRelay(batch_size=50, listen=False, poll_interval_ms=50))
dramatiq.set_broker(broker)

@dramatiq.actor(queue_name=os.environ["T_QUEUE"] + "_w")
def unrelated():
    pass
"""


def _published(db: psycopg.Connection[Any], db_schema: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {}.outbox WHERE published_at IS NOT NULL")
    row = db.execute(query.format(psycopg.sql.Identifier(db_schema))).fetchone()
    return int(row[0]) if row else 0


def test_a_worker_with_worker_relay_exits_on_sigterm_and_leaves_no_row_locked(
    broker, queue_name, queues, rabbit, db, db_schema, database_url, rabbitmq_url, tmp_path
):
    queues.add(f"{queue_name}_w")  # the worker process declares it: deleted after the test, failed or not
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    with broker.transaction():
        sent = {task.send(i).message_id for i in range(3000)}
    (tmp_path / "relay_worker_app.py").write_text(textwrap.dedent(_WORKER))
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "T_RABBITMQ_URL": rabbitmq_url,
        "T_DATABASE_URL": database_url,
        "T_SCHEMA": db_schema,
        "T_QUEUE": queue_name,
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "relay_worker_app", "--processes", "1", "--threads", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: _published(db, db_schema) >= 50, timeout_ms=60000, message="the worker's relay made no progress"
        )
        worker.send_signal(signal.SIGTERM)
        at_signal = _published(db, db_schema)
        _, stderr = worker.communicate(timeout=90)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, stderr
    assert "outbox relay stopped" in stderr, stderr
    assert at_signal < 3000, "the relay finished before SIGTERM; the test proved nothing"
    # No lock left behind: every unpublished row can be locked at once.
    with psycopg.connect(database_url) as conn:
        query = psycopg.sql.SQL(
            "SELECT count(*) FROM (SELECT id FROM {}.outbox WHERE published_at IS NULL FOR UPDATE NOWAIT) AS s"
        )
        conn.execute(query.format(psycopg.sql.Identifier(db_schema))).fetchone()
    from dramatiq_reliable.testing import drain_outbox

    drain_outbox(broker)
    assert _published(db, db_schema) == 3000
    assert {body["message_id"] for body in rabbit.take_all(queue_name, expect=3000)} == sent
