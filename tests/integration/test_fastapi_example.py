"""examples/fastapi_app: the order and its message commit or roll back together, through the app's
own AsyncSession transaction, and a real worker confirms each committed order once."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from starlette.testclient import TestClient

from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration

APP = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app" / "app.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("fastapi_app_example", APP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the app's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["outbox", "queue"])
def shops(
    request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str, queue_name: str
) -> Iterator[tuple[Any, Any]]:
    """The web process's app and the worker process's: two builds, as two processes would have."""
    example = _example()
    built = [
        example.build(
            database_url,
            rabbitmq_url=rabbitmq_url if request.param == "outbox" else None,
            schema=db_schema,
            queue_name=queue_name,
        )
        for _ in range(2)
    ]
    yield built[0], built[1]
    for shop in built:
        shop.broker.close()


def _count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()
    assert row is not None
    return int(row[0])


def _messages(db: psycopg.Connection[Any], shop: Any) -> int:
    return _count(db, shop.broker.schema, shop.broker.table)


def test_a_refused_order_leaves_no_message_and_a_committed_one_is_confirmed_once(
    shops: tuple[Any, Any], db: psycopg.Connection[Any], db_schema: str
) -> None:
    shop, worker_side = shops
    with TestClient(shop.app) as client:  # runs the lifespan: tables, pools
        refused = client.post("/orders", json={"item": "book", "refuse": True})
        assert refused.status_code == 409, refused.text
        assert _count(db, db_schema, "orders") == 0
        assert _messages(db, shop) == 0, "the refused order's message rolled back with it"

        created = client.post("/orders", json={"item": "lamp"})
        assert created.status_code == 201, created.text
        order_id = created.json()["id"]
    assert _count(db, db_schema, "orders") == 1
    assert _messages(db, shop) == 1, "one message for the committed order"
    assert shop.broker.database._async_pools == {}, "the lifespan closed the broker's async pool"
    assert shop.broker.database.pool.closed, "and its pool"

    worker = dramatiq.Worker(worker_side.broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        wait_for(lambda: _count(db, db_schema, "order_confirmations") == 1, message="the order was never confirmed")
        worker_side.broker.join(worker_side.confirm_order.queue_name, timeout=20_000)
    finally:
        worker.stop()
    confirmed = db.execute(
        sql.SQL("SELECT order_id FROM {}").format(sql.Identifier(db_schema, "order_confirmations"))
    ).fetchall()
    assert confirmed == [(order_id,)]
