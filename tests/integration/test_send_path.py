"""One send path for every Postgres-backed broker: the same refusals, before any SQL, on both.

A refused send raises ``PayloadError`` in the caller and leaves the caller's transaction as it
was: the business row written before it and a good send after it both commit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.common import current_millis

from dramatiq_reliable import NotBound, OutboxBroker, OutboxWriteError, PayloadError, PostgresBroker, bind
from dramatiq_reliable.binding import register_ambient
from dramatiq_reliable.sending import MAX_ETA_MS

pytestmark = pytest.mark.integration


@pytest.fixture(params=["outbox", "queue"])
def row_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str) -> Iterator[Any]:
    if request.param == "outbox":
        broker: Any = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema)
    else:
        broker = PostgresBroker(database=database_url, schema=db_schema)
    yield broker
    broker.close()


def _rows(db: psycopg.Connection[Any], schema: str, table: str) -> list[tuple[Any, ...]]:
    return db.execute(
        psycopg.sql.SQL("SELECT message_id FROM {}.{}").format(
            psycopg.sql.Identifier(schema), psycopg.sql.Identifier(table)
        )
    ).fetchall()


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"delay": 10**16}, "9999"),
        ({"delay": -1}, "non-negative int of milliseconds"),
        ({"delay": True}, "non-negative int of milliseconds"),
        ({"delay": 1.5}, "non-negative int of milliseconds"),
        ({"delay": float("inf")}, "non-negative int of milliseconds"),
        ({"eta": "tomorrow"}, "Unix timestamp in milliseconds"),
        ({"eta": True}, "Unix timestamp in milliseconds"),
        ({"eta": float("nan")}, "Unix timestamp in milliseconds"),
        ({"eta": float("inf")}, "Unix timestamp in milliseconds"),
        ({"eta": MAX_ETA_MS + 1}, "9999"),
        ({"eta": -1}, "9999"),
        ({"broker_priority": 256}, "0 to 255"),
        ({"broker_priority": True}, "0 to 255"),
        ({"broker_priority": "high"}, "0 to 255"),
        ({"idempotency_key": "a\x00b"}, "NUL"),
        ({"idempotency_key": "\ud800"}, "Unicode"),
    ],
)
def test_a_bad_send_is_refused_before_any_sql_and_the_callers_transaction_commits(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str, options: dict[str, Any], fix: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with row_broker.transaction() as conn:
        conn.execute("CREATE TEMP TABLE business (x int) ON COMMIT DROP")
        conn.execute("INSERT INTO business VALUES (1)")
        with pytest.raises(PayloadError, match=fix):
            task.send_with_options(**options)
        good = task.send()
        assert conn.execute("SELECT count(*) FROM business").fetchone() == (1,), "the business row is still there"
    assert [row[0] for row in _rows(db, db_schema, row_broker.table)] == [good.message_id]


def test_a_payload_over_the_limit_is_refused_and_one_over_the_warning_is_kept(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    row_broker.max_payload_bytes, row_broker.payload_limit_bytes = 1_000, 10_000
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda text: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with row_broker.transaction():
        with pytest.raises(PayloadError, match="over payload_limit_bytes=10000; send IDs"):
            task.send("x" * 20_000)
        kept = task.send("x" * 2_000)
    assert "over max_payload_bytes=1000" in caplog.text
    assert [row[0] for row in _rows(db, db_schema, row_broker.table)] == [kept.message_id]


def test_a_delayed_send_stores_its_eta_on_both_brokers(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    before = current_millis()
    sent = task.send_with_options(delay=3_600_000)
    column = "eta" if row_broker.table == "outbox" else "available_at"
    (due,) = db.execute(
        psycopg.sql.SQL("SELECT (extract(epoch FROM {}) * 1000)::bigint FROM {}.{} WHERE message_id = %s").format(
            psycopg.sql.Identifier(column), psycopg.sql.Identifier(db_schema), psycopg.sql.Identifier(row_broker.table)
        ),
        (sent.message_id,),
    ).fetchone()
    assert before + 3_600_000 <= due <= current_millis() + 3_600_000


# -- the bound connection must be a transaction send() may join -------------------------------------


@pytest.mark.parametrize("state", ["autocommit-idle", "failed", "closed"])
def test_a_send_on_a_bound_connection_in_the_wrong_state_is_refused_and_writes_nothing(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any], db_schema: str, state: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    fix = {"autocommit-idle": "conn.transaction", "failed": "roll back", "closed": "open connection"}[state]
    with psycopg.connect(database_url, autocommit=state == "autocommit-idle") as conn, bind(conn):
        if state == "failed":
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1/0")
        elif state == "closed":
            conn.close()
        with pytest.raises(NotBound, match=fix):
            task.send()
    assert _rows(db, db_schema, row_broker.table) == []


def test_a_send_bound_to_another_database_is_refused(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    other = f"sp_other_{uuid.uuid4().hex[:8]}"
    db.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(other)))
    try:
        name = f"sp_{uuid.uuid4().hex[:8]}"
        task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
        url = psycopg.conninfo.make_conninfo(database_url, dbname=other)
        with (
            psycopg.connect(url) as conn,
            conn.transaction(),
            bind(conn),
            pytest.raises(NotBound, match="broker's database"),
        ):
            task.send()
    finally:
        db.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(other)))
    assert _rows(db, db_schema, row_broker.table) == []


def test_a_transaction_an_ambient_source_sees_is_joined_and_rolls_back_with_it(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with psycopg.connect(database_url) as conn:
        unregister = register_ambient(lambda database: conn)
        try:
            task.send()
            conn.rollback()
            assert _rows(db, db_schema, row_broker.table) == [], "the send rolled back with the ambient transaction"
            sent = task.send()
            conn.commit()
        finally:
            unregister()
    assert [row[0] for row in _rows(db, db_schema, row_broker.table)] == [sent.message_id]


async def _send_inside_async_binding(url: str, task: Any) -> None:
    async with await psycopg.AsyncConnection.connect(url) as conn, conn.transaction(), bind(conn):
        task.send()


def test_a_plain_send_inside_an_async_binding_is_refused(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with pytest.raises(NotBound, match="send_async"):
        asyncio.run(_send_inside_async_binding(database_url, task))
    assert _rows(db, db_schema, row_broker.table) == []


def test_a_send_in_a_read_only_transaction_names_that_not_the_connection(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with pytest.raises(OutboxWriteError) as raised, row_broker.transaction() as conn:
        conn.execute("SET TRANSACTION READ ONLY")
        task.send()
    text = str(raised.value)
    assert "read-only" in text and "read-write transaction on the primary" in text
    assert "check the database connection" not in text
    assert _rows(db, db_schema, row_broker.table) == []


def test_a_send_that_waits_on_a_dedupe_key_past_lock_timeout_says_what_it_waited_for(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str, database_url: str
) -> None:
    name = f"sp_{uuid.uuid4().hex[:8]}"
    task = dramatiq.actor(lambda: None, actor_name=f"{name}_a", queue_name=name, broker=row_broker)
    with psycopg.connect(database_url) as holder:
        with bind(holder):  # a transaction that holds the key and does not commit yet
            first = task.send_with_options(dedupe_key="order-7")
        with pytest.raises(OutboxWriteError) as raised, row_broker.transaction() as conn:
            conn.execute("SET LOCAL lock_timeout = '100ms'")
            task.send_with_options(dedupe_key="order-7")
        holder.commit()
    text = str(raised.value)
    assert "lock_timeout" in text and "dedupe_key" in text and "retry the transaction" in text
    assert "check the database connection" not in text
    assert [row[0] for row in _rows(db, db_schema, row_broker.table)] == [first.message_id]
