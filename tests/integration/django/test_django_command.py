"""``manage.py migrate`` then ``manage.py rundramatiq_reliable`` on the example: an order sent in atomic() gets its receipt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import SHOP
from psycopg import sql

from dramatiq_reliable.testing import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs_session("creates its database from template1, which PgBouncer's idle connections hold"),
]

_PLACE_ORDER = """
from django.db import transaction
from shop.models import Order
from shop.tasks import send_receipt
with transaction.atomic():
    order = Order.objects.create(item="lamp")
    send_receipt.send(order.pk)
print(order.pk)
"""


@pytest.fixture
def shop_database(database_url: str) -> Iterator[str]:
    """A database of the test's own for the example (dropped afterwards, sessions and all)."""
    name = f"dr_shop_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    params["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**params)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=SHOP, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _receipts(url: str, order_id: int) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT receipts_sent FROM shop_order WHERE id = %s", (order_id,)).fetchone()
        return int(row[0]) if row else 0


@pytest.mark.parametrize("broker", ["postgres", "outbox"])
def test_workers_started_by_the_command_run_the_job_sent_inside_atomic(
    broker: str, shop_database: str, rabbitmq_url: str, queue_name: str
) -> None:
    url = psycopg.conninfo.conninfo_to_dict(shop_database)
    env: dict[str, Any] = {
        **os.environ,
        "DATABASE_URL": f"postgresql://{url.get('user', '')}@{url.get('host', '')}:{url.get('port', 5432)}/{url['dbname']}",
        "SHOP_BROKER": broker,
        "RABBITMQ_URL": rabbitmq_url,
        "SHOP_QUEUE": queue_name,
    }
    if url.get("password"):
        env["PGPASSWORD"] = str(url["password"])
    _manage(env, "migrate", "--verbosity", "0")  # Django's tables and ours
    _manage(env, "migrate", "--verbosity", "0")  # again: nothing to do, no error
    command = subprocess.Popen(
        [sys.executable, "manage.py", "rundramatiq_reliable", "--processes", "1", "--threads", "1"],
        cwd=SHOP,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the workers it starts are ended with it
    )
    try:
        order_id = int(_manage(env, "shell", "--verbosity", "0", "-c", _PLACE_ORDER).strip().splitlines()[-1])
        wait_for(lambda: _receipts(shop_database, order_id) == 1, timeout_ms=60_000, message="no receipt was counted")
        command.send_signal(signal.SIGTERM)
        _, stderr = command.communicate(timeout=60)
        assert command.returncode == 0, stderr
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)  # the command and the workers it started
            command.communicate(timeout=30)
