"""The relay as a process: SIGKILL loses nothing, SIGTERM exits cleanly, the CLI's exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]


def _cli(*args: str, database: str, rabbitmq_url: str | None = None) -> list[str]:
    command = [sys.executable, "-m", "dramatiq_reliable", *args, "--database-url", database]
    if rabbitmq_url:
        command += ["--rabbitmq-url", rabbitmq_url]
    return command


def _published(db: psycopg.Connection[Any], db_schema: str) -> int:
    row = db.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {}.outbox WHERE published_at IS NOT NULL").format(
            psycopg.sql.Identifier(db_schema)
        )
    ).fetchone()
    return int(row[0]) if row else 0


def _send_many(broker: OutboxBroker, queue_name: str, count: int) -> set[str]:
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    with broker.transaction():
        return {task.send(i).message_id for i in range(count)}


def test_relay_killed_with_sigkill_mid_backlog_loses_no_message(
    broker, queue_name, rabbit, db, db_schema, database_url, rabbitmq_url
):
    sent = _send_many(broker, queue_name, 20_000)
    relay = subprocess.Popen(
        _cli("relay", "--schema", db_schema, "--batch-size", "100", database=database_url, rabbitmq_url=rabbitmq_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _published(db, db_schema) >= 1000, timeout_ms=60000, message="relay made no progress")
        relay.send_signal(signal.SIGKILL)
        relay.wait(timeout=10)
    finally:
        if relay.poll() is None:
            relay.kill()
    published_before_kill = _published(db, db_schema)
    assert published_before_kill < 20_000, "the relay finished before the kill; the test proved nothing"

    subprocess.run(
        _cli("relay", "--once", "--schema", db_schema, database=database_url, rabbitmq_url=rabbitmq_url),
        check=True,
        capture_output=True,
    )
    assert _published(db, db_schema) == 20_000
    bodies = rabbit.take_all(queue_name, expect=20_000)
    received = {body["message_id"] for body in bodies}
    assert received == sent
    # At least once: at most the batches in flight at the kill are published twice.  Under a
    # backlog the relay publishes one batch while the previous one's mark commits: two of 100.
    assert 20_000 <= len(bodies) <= 20_000 + 2 * 100


def test_relay_exits_cleanly_on_sigterm_and_leaves_no_row_locked(
    broker, queue_name, rabbit, db, db_schema, database_url, rabbitmq_url
):
    sent = _send_many(broker, queue_name, 5_000)
    relay = subprocess.Popen(
        _cli("relay", "--schema", db_schema, "--batch-size", "50", database=database_url, rabbitmq_url=rabbitmq_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _published(db, db_schema) >= 100, timeout_ms=60000, message="relay made no progress")
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=20)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, stderr
    assert "finishing the batch in hand" in stderr
    # Whatever it published is marked; the rest is claimable at once (no lock left behind).
    subprocess.run(
        _cli("relay", "--once", "--schema", db_schema, database=database_url, rabbitmq_url=rabbitmq_url),
        check=True,
        capture_output=True,
    )
    assert {body["message_id"] for body in rabbit.take_all(queue_name, expect=5_000)} == sent


def test_cli_migrate_sql_stats_and_exit_codes(database_url, unmigrated_schema, rabbitmq_url):
    printed = subprocess.run(
        _cli("migrate", "--sql", "--schema", unmigrated_schema, database=database_url),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert f'CREATE TABLE "{unmigrated_schema}".outbox' in printed

    missing = subprocess.run(
        _cli("outbox", "stats", "--schema", unmigrated_schema, database=database_url),
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 4
    assert "dramatiq-reliable migrate" in missing.stderr
    assert "Traceback" not in missing.stderr

    subprocess.run(_cli("migrate", "--schema", unmigrated_schema, database=database_url), check=True)
    stats = subprocess.run(
        _cli("outbox", "stats", "--json", "--schema", unmigrated_schema, database=database_url),
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(stats.stdout) == {"backlog": 0, "failing": 0, "oldest_age_s": 0.0, "scheduled": 0}

    unreachable = subprocess.run(
        _cli("outbox", "stats", "--schema", unmigrated_schema, database="postgresql://nobody:secret@127.0.0.1:1/x"),
        capture_output=True,
        text=True,
        env={**os.environ, "PGCONNECT_TIMEOUT": "2"},
    )
    assert unreachable.returncode == 3
    assert "secret" not in unreachable.stderr, "credentials must never reach the output"
