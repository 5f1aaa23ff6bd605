"""examples/django_shop's own tests pass under ``manage.py test`` on the real Postgres, with both brokers.

``manage.py test`` creates the test database and runs ``migrate`` there, our migration included
(no ``SchemaNotReady``), and the example's runner closes our pool so the test database is dropped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest
from conftest import SHOP
from psycopg import sql

pytestmark = [
    pytest.mark.integration,
    # The runner creates and drops a test database of its own; PgBouncer keeps idle server
    # connections to it, so the DROP fails there (a project runs its tests directly on Postgres).
    pytest.mark.needs_session("Django's test runner drops its test database, which PgBouncer's idle connections hold"),
]


def _manage_test(database_url: str, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    test_database = f"test_shop_{uuid.uuid4().hex[:10]}"
    environ = {
        **os.environ,
        "DATABASE_URL": database_url,
        "SHOP_TEST_DATABASE": test_database,
        "SHOP_SCHEMA": f"t_{uuid.uuid4().hex[:12]}",
        **env,
    }
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", "test", "shop", "--noinput"],
            cwd=SHOP,
            env=environ,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            left = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (test_database,)).fetchone()
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(test_database)))
    assert left is None, "the test database outlived the run: the runner did not close the broker's pool"
    return done, test_database


def test_the_shop_tests_pass_on_the_postgres_broker(database_url):
    done, _ = _manage_test(database_url, SHOP_BROKER="postgres")
    assert done.returncode == 0, done.stderr
    assert "Ran 2 tests" in done.stderr


def test_the_shop_tests_pass_on_the_outbox_broker_with_a_relay(database_url, rabbitmq_url, queue_name):
    done, _ = _manage_test(database_url, SHOP_BROKER="outbox", RABBITMQ_URL=rabbitmq_url, SHOP_QUEUE=queue_name)
    assert done.returncode == 0, done.stderr
    assert "Ran 2 tests" in done.stderr
