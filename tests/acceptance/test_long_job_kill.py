"""A long job whose worker is SIGKILLed runs again once its lease runs out: never lost, never twice at once.

``LongJobs`` acks the RabbitMQ delivery as the job starts, so after a ``kill -9`` RabbitMQ has
nothing to deliver again: only the lease in Postgres remembers the job.  Another worker's relay
moves the lease back to the outbox when it runs out, and the job runs again, once.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from rabbitmq_nodes import RabbitNode
from support import Rabbit
from worker_apps import start_app, stop_app

from dramatiq_reliable.outbox import OutboxBroker
from dramatiq_reliable.outbox.long_jobs import leased_jobs
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("long_worker_app.py")
LEASE_MS = 2000


def _worker(node: RabbitNode, database_url: str, schema: str, queue: str, *, stall: bool) -> subprocess.Popen[str]:
    return start_app(
        APP,
        DATABASE_URL=database_url,
        RABBITMQ_URL=node.url,
        SCHEMA=schema,
        QUEUE=queue,
        STALL="1" if stall else "0",
        LEASE_MS=str(LEASE_MS),
    )


@pytest.fixture
def runs(db: psycopg.Connection[Any], db_schema: str) -> sql.Composed:
    table = sql.Identifier(db_schema, "runs")
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id serial PRIMARY KEY, pid int, "
            "started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz)"
        ).format(table)
    )
    db.commit()
    return sql.SQL("SELECT pid, started_at, finished_at FROM {} ORDER BY started_at").format(table)


@pytest.fixture
def sender(rabbitmq_short_timeout_node: RabbitNode, database_url: str, db_schema: str) -> Iterator[OutboxBroker]:
    broker = OutboxBroker(url=rabbitmq_short_timeout_node.url, database=database_url, schema=db_schema)
    yield broker
    broker.close()


def test_a_long_job_whose_worker_was_killed_runs_again_after_its_lease_once(
    rabbitmq_short_timeout_node: RabbitNode,
    database_url: str,
    db_schema: str,
    db: psycopg.Connection[Any],
    runs: sql.Composed,
    sender: OutboxBroker,
    queue_name: str,
) -> None:
    job = dramatiq.actor(lambda: None, actor_name="job", queue_name=queue_name, broker=sender)
    job.send()
    doomed = _worker(rabbitmq_short_timeout_node, database_url, db_schema, queue_name, stall=True)
    try:
        wait_for(lambda: db.execute(runs).fetchall(), timeout_ms=30_000, message="the first worker never ran the job")
        wait_for(lambda: leased_jobs(db, db_schema), message="the running job holds no lease")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=10)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(timeout=10)
        if doomed.stdin is not None:
            doomed.stdin.close()
    killed_at = time.monotonic()
    survivor = _worker(rabbitmq_short_timeout_node, database_url, db_schema, queue_name, stall=False)
    try:
        wait_for(
            lambda: [r for r in db.execute(runs).fetchall() if r[2] is not None],
            timeout_ms=40_000,
            message="the killed worker's job never ran again",
        )
        # It ran again because the lease ran out, not sooner.
        assert time.monotonic() - killed_at > (LEASE_MS - 500) / 1000
        wait_for(lambda: not leased_jobs(db, db_schema), message="the lease ended with the job")
        rabbit = Rabbit(rabbitmq_short_timeout_node.url)
        try:
            wait_for(lambda: rabbit.count(queue_name) == 0, message="a copy of the job is still queued")
        finally:
            rabbit.close()
    finally:
        stop_app(survivor)
    first, *later = db.execute(runs).fetchall()
    assert first[0] == doomed.pid and first[2] is None
    assert [r[0] for r in later] == [survivor.pid], f"the job ran {len(later)} times after the kill"
    pending = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(sql.Identifier(db_schema, "outbox"))
    ).fetchone()
    assert pending == (0,)
