"""A message that kills its worker every time ends in ``dead_letters`` at the delivery limit, never dropped."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from worker_apps import start_app, stop_app

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("quorum_worker_app.py")
LIMIT = 3


def _worker(rabbitmq_urls: str, database_url: str, schema: str, queue: str) -> subprocess.Popen[str]:
    return start_app(
        APP,
        RABBITMQ_URLS=rabbitmq_urls,
        DATABASE_URL=database_url,
        SCHEMA=schema,
        QUEUE=queue,
        DELIVERY_LIMIT=str(LIMIT),
    )


@pytest.fixture
def runs(db: psycopg.Connection[Any], db_schema: str) -> sql.Identifier:
    table = sql.Identifier(db_schema, "runs")
    db.execute(sql.SQL("CREATE TABLE {} (actor text, n int, pid int)").format(table))
    return table


def test_a_message_that_kills_its_worker_lands_in_dead_letters_at_the_limit_and_is_not_run_again(
    rabbitmq_url, database_url, db_schema, queue_name, runs, db
):
    sender = OutboxBroker(
        url=rabbitmq_url, database=database_url, schema=db_schema, queue_type="quorum", delivery_limit=LIMIT
    )
    poison = dramatiq.actor(lambda n: None, actor_name="poison", queue_name=queue_name, broker=sender)
    fine = dramatiq.actor(lambda n: None, actor_name="fine", queue_name=queue_name, broker=sender)
    with sender.transaction():
        for n in range(3):
            fine.send(n)
        message = poison.send(99)
        for n in range(3, 6):
            fine.send(n)
    assert drain_outbox(sender) == 7

    def count(actor: str) -> int:
        row = db.execute(sql.SQL("SELECT count(*) FROM {} WHERE actor = %s").format(runs), (actor,)).fetchone()
        return int(row[0]) if row else 0

    def dead_letter() -> Any:
        return db.execute(
            sql.SQL("SELECT reason, attempts, error_type, error_message FROM {} WHERE message_id = %s").format(
                sql.Identifier(db_schema, "dead_letters")
            ),
            (message.message_id,),
        ).fetchone()

    workers = [_worker(rabbitmq_url, database_url, db_schema, queue_name)]
    try:

        def stored_restarting_dead_workers() -> Any:
            if workers[-1].poll() is not None:  # the poison killed it: a supervisor would start another
                assert workers[-1].returncode == -signal.SIGKILL, f"the worker exited with {workers[-1].returncode}"
                workers.append(_worker(rabbitmq_url, database_url, db_schema, queue_name))
            return dead_letter()

        row = wait_for(
            stored_restarting_dead_workers,
            timeout_ms=90_000,
            interval_ms=100,
            message=f"the poison message reaches dead_letters after {LIMIT} killed workers",
        )
        reason, attempts, error_type, error_message = row
        assert (reason, attempts, error_type) == ("delivery_limit", LIMIT, "dramatiq_reliable.DeliveryLimitReached")
        assert f"delivery_limit={LIMIT}" in error_message and queue_name in error_message
        assert count("poison") == LIMIT
        assert len(workers) == LIMIT + 1  # killed LIMIT times; the last one stored it and lives on

        # Nothing lost: every other message ran, and the poison never runs again.
        with sender.transaction():
            fine.send(6)
        assert drain_outbox(sender) == 1
        wait_for(lambda: count("fine") >= 7, timeout_ms=30_000, message="the fine messages all run")
        assert count("poison") == LIMIT
        assert workers[-1].poll() is None
        rows = db.execute(sql.SQL("SELECT n FROM {} WHERE actor = 'fine' ORDER BY n").format(runs)).fetchall()
        assert [n for (n,) in rows] == list(range(7))
    finally:
        for process in workers:
            stop_app(process)
        sender.close()
