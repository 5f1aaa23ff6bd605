"""A PostgresBroker worker killed with SIGKILL mid-job: its message runs again elsewhere after the lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import PostgresBroker
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

APP = Path(__file__).with_name("pg_worker_app.py")


def _worker(database_url: str, schema: str, queue: str, *, stall: bool) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": database_url, "SCHEMA": schema, "QUEUE": queue, "STALL": "1" if stall else "0"}
    return subprocess.Popen(
        [sys.executable, str(APP)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _runs(db: psycopg.Connection[Any], schema: str) -> list[tuple[int, int]]:
    return db.execute(sql.SQL("SELECT n, pid FROM {} ORDER BY at").format(sql.Identifier(schema, "runs"))).fetchall()


def test_a_worker_killed_mid_job_loses_nothing_its_message_runs_after_the_lease(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    queue = f"pk_{uuid.uuid4().hex[:10]}"
    db.execute(
        sql.SQL("CREATE TABLE {} (n int, pid int, at timestamptz DEFAULT clock_timestamp())").format(
            sql.Identifier(db_schema, "runs")
        )
    )
    broker = PostgresBroker(database=database_url, schema=db_schema)
    try:
        task = dramatiq.actor(lambda n: None, actor_name="job", queue_name=queue, broker=broker)
        with broker.transaction():
            task.send(7)

        doomed = _worker(database_url, db_schema, queue, stall=True)
        try:
            wait_for(
                lambda: len(_runs(db, db_schema)) == 1, timeout_ms=30_000, message="the first worker never ran the job"
            )
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(timeout=10)
        finally:
            if doomed.poll() is None:
                doomed.kill()
        killed_at = time.monotonic()
        (first_run,) = _runs(db, db_schema)
        assert first_run[1] == doomed.pid

        survivor = _worker(database_url, db_schema, queue, stall=False)
        try:
            wait_for(lambda: len(_runs(db, db_schema)) == 2, timeout_ms=30_000, message="the message never came back")
            # It came back because the lease (2 s) ran out, not at once.
            assert time.monotonic() - killed_at > 1.0
            broker.declare_queue(queue)
            broker.join(queue, timeout=10_000)
        finally:
            assert survivor.stdin is not None
            survivor.stdin.close()
            survivor.wait(timeout=30)
        second_run = _runs(db, db_schema)[1]
        assert second_run == (7, survivor.pid)
    finally:
        broker.close()
