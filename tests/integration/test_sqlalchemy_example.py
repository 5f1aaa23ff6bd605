"""examples/sqlalchemy_flask: the order endpoint's message commits with the order, and a real worker makes one receipt.

The Flask app runs in-process (its test client) on the real Postgres, with a PostgresBroker and
a real Dramatiq worker: an order over the stock rolls back after its send (409, no message,
no receipt); a good order commits its message, and the worker writes exactly one receipt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from sqlalchemy_flask.app import Shop, create_shop

pytestmark = pytest.mark.integration


@pytest.fixture
def shop(database_url: str, unmigrated_schema: str) -> Iterator[Shop]:
    shop = create_shop(database_url, schema=unmigrated_schema, stock={"mug": 5})
    yield shop
    shop.close()


def count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {}").format(psycopg.sql.Identifier(schema, table))
    row = db.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_an_order_that_rolls_back_sends_nothing_and_one_that_commits_makes_one_receipt(shop, db, unmigrated_schema):
    client = shop.app.test_client()

    refused = client.post("/orders", json={"item": "mug", "quantity": 9})
    assert refused.status_code == 409, refused.get_json()
    assert count(db, unmigrated_schema, "orders") == 0
    assert count(db, unmigrated_schema, "queue") == 0, "the rolled-back order's message was kept"

    placed = client.post("/orders", json={"item": "mug", "quantity": 2})
    assert placed.status_code == 201, placed.get_json()
    order_id = placed.get_json()["order_id"]
    assert count(db, unmigrated_schema, "queue") == 1

    worker = dramatiq.Worker(shop.broker, worker_threads=1, worker_timeout=100)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while count(db, unmigrated_schema, "receipts") == 0:
            assert time.monotonic() < deadline, "no receipt after 30 s: the worker did not run send_receipt"
            time.sleep(0.05)
        shop.broker.join(shop.send_receipt.queue_name, timeout=30_000)
    finally:
        worker.stop()
    receipts = db.execute(
        psycopg.sql.SQL("SELECT order_id FROM {}").format(psycopg.sql.Identifier(unmigrated_schema, "receipts"))
    ).fetchall()
    assert receipts == [(order_id,)]
    left = db.execute(
        psycopg.sql.SQL("SELECT left_count FROM {}").format(psycopg.sql.Identifier(unmigrated_schema, "stock"))
    ).fetchall()
    assert left == [(3,)]


def test_a_bad_order_is_refused_before_any_write(shop, db, unmigrated_schema):
    response = shop.app.test_client().post("/orders", json={"item": "mug", "quantity": 0})
    assert response.status_code == 400
    assert count(db, unmigrated_schema, "orders") == count(db, unmigrated_schema, "queue") == 0
