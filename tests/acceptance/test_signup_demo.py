"""The README's first command: the signup demo runs end to end and proves one effect per signup."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

DEMO = Path(__file__).resolve().parents[2] / "examples" / "signup"


def test_the_signup_demo_tells_each_part_and_ends_with_one_effect_per_signup(database_url, rabbitmq_url):
    env = {**os.environ, "DATABASE_URL": database_url, "RABBITMQ_URL": rabbitmq_url}
    done = subprocess.run(
        [sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ledger: 6 signups from 7 clicks: 6 welcome emails, 6 payment customers, 6 chat messages: "
        r"one effect per signup \(\d+s\)",
        last,
    ), last
    # From the output alone: what the outbox, the relay, idempotency, retries and dead letters did.
    for said in (
        "outbox rows, committed with the accounts",
        "relay          published",
        "idempotency    Ada's welcome email (second click): skipped",
        "failed on attempt 2 with HTTP 429",
        "stored as dead letter #1",
        "1 dead letter replayed through the outbox",
    ):
        assert said in done.stdout, said
    assert "Traceback" not in done.stdout + done.stderr
    # It cleans up what it made, and only that: its schema is gone.
    schema = re.search(r"schema '(signup_demo_[0-9a-f]+)'", done.stdout)
    assert schema is not None
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema[1],)).fetchone() is None


@pytest.fixture
def unused_tcp_port_url() -> str:
    """An AMQP URL on a port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"amqp://guest:guest@127.0.0.1:{port}/%2F"


def test_the_signup_demo_runs_on_postgres_alone_when_rabbitmq_is_not_there(database_url, unused_tcp_port_url):
    # RabbitMQ "down": a closed port.  --broker postgres makes the choice explicit (auto-selection
    # only falls back when RABBITMQ_URL is unset and nothing answers at the default URL).
    env = {**os.environ, "DATABASE_URL": database_url, "RABBITMQ_URL": unused_tcp_port_url}
    done = subprocess.run(
        [sys.executable, str(DEMO), "--broker", "postgres"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runs on   PostgresBroker (no RabbitMQ, no relay); Postgres from DATABASE_URL" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ledger: 6 signups from 7 clicks: 6 welcome emails, 6 payment customers, 6 chat messages: "
        r"one effect per signup \(\d+s\)",
        last,
    ), last
    for said in ("stored as dead letter #1", "1 dead letter replayed through the queue", "A deploy, with no relay"):
        assert said in done.stdout, said
    assert "Traceback" not in done.stdout + done.stderr
