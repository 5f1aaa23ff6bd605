"""Dedupe at enqueue: one message per (actor, key) inside the window, on both Postgres-backed brokers.

The key is written in the sender's transaction with the message's row, so concurrent senders
wait on it, a rollback frees it, and an expired key is taken over by the next send.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import ActorOptionError, OutboxBroker, PayloadError, PostgresBroker, WorkerRelay
from dramatiq_reliable.dedupe import MAX_DEDUPE_KEY_BYTES, purge_dedupe_keys
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(params=["outbox", "queue"])
def row_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str) -> Iterator[Any]:
    if request.param == "outbox":
        broker: Any = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, pool_max_size=12)
    else:
        broker = PostgresBroker(database=database_url, schema=db_schema, pool_max_size=12)
    yield broker
    broker.close()


def _actor(broker: Any, fn: Any = None, **options: Any) -> dramatiq.Actor[Any, Any]:
    name = f"dd_{uuid.uuid4().hex[:8]}"
    return dramatiq.actor(fn or (lambda *args: None), actor_name=name, queue_name=name, broker=broker, **options)


def _message_ids(db: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    query = sql.SQL("SELECT message_id FROM {}.{} ORDER BY message_id").format(
        sql.Identifier(schema), sql.Identifier(table)
    )
    return [row[0] for row in db.execute(query).fetchall()]


def _expire_keys(db: psycopg.Connection[Any], schema: str) -> None:
    db.execute(
        sql.SQL("UPDATE {}.send_dedupe SET expires_at = now() - interval '1 second'").format(sql.Identifier(schema))
    )


def test_fifty_threads_sending_one_key_at_once_write_one_row(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    start = threading.Barrier(50)
    returned: list[str] = []
    errors: list[BaseException] = []

    def send(index: int) -> None:
        start.wait()
        try:
            if index % 2:  # half in a transaction of their own, half autocommit: both paths
                with row_broker.transaction():
                    returned.append(task.send_with_options(args=(index,), dedupe_key="order-42").message_id)
            else:
                returned.append(task.send_with_options(args=(index,), dedupe_key="order-42").message_id)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=send, args=(index,)) for index in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    written = _message_ids(db, db_schema, row_broker.table)
    assert len(written) == 1, "one row for fifty sends of one key"
    assert returned == [written[0]] * 50, "every sender got the id of the message written"


def test_a_second_send_returns_the_first_message_and_writes_nothing(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    other = _actor(row_broker)
    first = task.send_with_options(args=(1,), dedupe_key="order-42")
    second = task.send_with_options(args=(2,), dedupe_key="order-42")
    assert second.message_id == first.message_id
    assert second.args == (2,), "the returned message is the caller's, readdressed to the first id"
    # Keys are per actor: another actor's send with the same key is its own message.
    elsewhere = other.send_with_options(dedupe_key="order-42")
    # No key: no dedupe.
    plain = task.send(3)
    assert _message_ids(db, db_schema, row_broker.table) == sorted(
        [first.message_id, elsewhere.message_id, plain.message_id]
    )


def test_an_actor_option_derives_the_key_from_the_arguments(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(
        row_broker,
        lambda order_id, note=None: None,
        dedupe_key=lambda order_id, note=None: None if order_id == 0 else f"order-{order_id}",
        dedupe_window_ms=60_000,
    )
    first = task.send(7, note="a")
    assert task.send(7, note="b").message_id == first.message_id
    # The message option wins over the actor's function.
    own = task.send_with_options(args=(7,), dedupe_key="manual")
    # The function may opt a call out of dedupe by returning None.
    unkeyed = [task.send(0).message_id, task.send(0).message_id]
    assert _message_ids(db, db_schema, row_broker.table) == sorted([first.message_id, own.message_id, *unkeyed])
    window = db.execute(
        sql.SQL("SELECT expires_at - created_at FROM {}.send_dedupe WHERE dedupe_key = 'order-7'").format(
            sql.Identifier(db_schema)
        )
    ).fetchone()
    assert window is not None and window[0].total_seconds() == 60


def test_a_rolled_back_send_frees_the_key_for_a_sender_waiting_on_it(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    sent, roll_back = threading.Event(), threading.Event()
    waiting: dict[str, str] = {}

    def first_sender() -> None:
        with pytest.raises(RuntimeError), row_broker.transaction():
            task.send_with_options(dedupe_key="order-42")
            sent.set()
            roll_back.wait(30)
            raise RuntimeError("the caller's transaction fails")

    def second_sender() -> None:
        with row_broker.transaction():
            waiting["id"] = task.send_with_options(dedupe_key="order-42").message_id

    first = threading.Thread(target=first_sender)
    first.start()
    assert sent.wait(30)
    second = threading.Thread(target=second_sender)
    second.start()
    wait_for(
        lambda: db.execute(
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%send_dedupe%'"
        ).fetchone(),
        message="the second sender waits on the key the first holds",
    )
    assert "id" not in waiting
    roll_back.set()
    first.join(30)
    second.join(30)
    assert _message_ids(db, db_schema, row_broker.table) == [waiting["id"]], "the second sender took the freed key"


def test_a_sender_waiting_on_a_committed_key_gets_the_first_message(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    sent, commit = threading.Event(), threading.Event()
    ids: dict[str, str] = {}

    def first_sender() -> None:
        with row_broker.transaction():
            ids["first"] = task.send_with_options(dedupe_key="order-42").message_id
            sent.set()
            commit.wait(30)

    def second_sender() -> None:
        ids["second"] = task.send_with_options(dedupe_key="order-42").message_id

    first = threading.Thread(target=first_sender)
    first.start()
    assert sent.wait(30)
    second = threading.Thread(target=second_sender)
    second.start()
    wait_for(
        lambda: db.execute(
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%send_dedupe%'"
        ).fetchone(),
        message="the second sender waits on the key the first holds",
    )
    commit.set()
    first.join(30)
    second.join(30)
    assert ids["second"] == ids["first"]
    assert _message_ids(db, db_schema, row_broker.table) == [ids["first"]]


def test_after_the_window_the_next_send_is_a_new_message_and_the_purge_drops_expired_keys(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    first = task.send_with_options(dedupe_key="order-42", dedupe_window_ms=60_000)
    _expire_keys(db, db_schema)
    second = task.send_with_options(dedupe_key="order-42", dedupe_window_ms=60_000)
    assert second.message_id != first.message_id
    assert task.send_with_options(dedupe_key="order-42").message_id == second.message_id, "the new message holds it"
    assert _message_ids(db, db_schema, row_broker.table) == sorted([first.message_id, second.message_id])

    task.send_with_options(dedupe_key="order-43")
    _expire_keys(db, db_schema)
    task.send_with_options(dedupe_key="order-44")  # live: kept
    assert purge_dedupe_keys(row_broker.database, schema=db_schema) == 2
    keys = db.execute(sql.SQL("SELECT dedupe_key FROM {}.send_dedupe").format(sql.Identifier(db_schema))).fetchall()
    assert keys == [("order-44",)]


def test_a_delayed_message_holds_its_key_from_the_send(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(row_broker)
    first = task.send_with_options(dedupe_key="order-42", delay=3_600_000, dedupe_window_ms=60_000)
    assert task.send_with_options(dedupe_key="order-42").message_id == first.message_id, "an undelayed duplicate"
    assert task.send_with_options(dedupe_key="order-42", delay=10).message_id == first.message_id
    row = db.execute(
        sql.SQL("SELECT expires_at - created_at, expires_at < now() + interval '2 minutes' FROM {}.send_dedupe").format(
            sql.Identifier(db_schema)
        )
    ).fetchone()
    assert row is not None and row[0].total_seconds() == 60 and row[1], "the window counts from the send, not the eta"
    assert _message_ids(db, db_schema, row_broker.table) == [first.message_id]


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"dedupe_key": "a\x00b"}, "NUL"),
        ({"dedupe_key": "\ud800"}, "Unicode"),
        ({"dedupe_key": ""}, "non-empty string"),
        ({"dedupe_key": "  "}, "non-empty string"),
        ({"dedupe_key": 42}, "non-empty string"),
        ({"dedupe_key": "é" * (MAX_DEDUPE_KEY_BYTES // 2 + 1)}, "over 1000"),
        ({"dedupe_key": "k", "dedupe_window_ms": 0}, "dedupe_window_ms=0"),
        ({"dedupe_key": "k", "dedupe_window_ms": True}, "dedupe_window_ms=True"),
        ({"dedupe_key": "k", "dedupe_window_ms": 1.5}, "dedupe_window_ms=1.5"),
        ({"dedupe_key": "k", "dedupe_window_ms": "5m"}, "milliseconds"),
        ({"dedupe_window_ms": 1000}, "no dedupe_key"),
    ],
)
def test_a_bad_key_or_window_is_refused_before_any_sql(
    row_broker: Any, db: psycopg.Connection[Any], db_schema: str, options: dict[str, Any], fix: str
) -> None:
    task = _actor(row_broker)
    with row_broker.transaction() as conn:
        conn.execute("CREATE TEMP TABLE business (x int) ON COMMIT DROP")
        with pytest.raises(PayloadError, match=fix):
            task.send_with_options(**options)
        good = task.send_with_options(dedupe_key="fine")
        assert conn.execute("SELECT count(*) FROM business").fetchone() == (0,), "the transaction is usable"
    assert _message_ids(db, db_schema, row_broker.table) == [good.message_id]


def test_bad_actor_options_are_refused_at_declaration_and_a_failing_key_function_at_send(row_broker: Any) -> None:
    with pytest.raises(ActorOptionError, match="must be a callable"):
        _actor(row_broker, dedupe_key="order-42")
    with pytest.raises(ActorOptionError, match="dedupe_window_ms"):
        _actor(row_broker, dedupe_key=lambda: "k", dedupe_window_ms=-1)

    def broken_key(order_id: int) -> str:
        raise KeyError(order_id)

    task = _actor(row_broker, lambda order_id: None, dedupe_key=broken_key)
    with pytest.raises(PayloadError, match="broken_key"):
        task.send(1)
    task_returning_int = _actor(row_broker, lambda order_id: None, dedupe_key=lambda order_id: order_id)
    with pytest.raises(PayloadError, match="not a non-empty string"):
        task_returning_int.send(1)


def test_a_workers_retry_is_sent_even_after_its_key_passed_to_another_message(
    broker: OutboxBroker, queue_name: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    attempts: list[int] = []

    def flaky(n: int) -> None:
        attempts.append(n)
        if attempts == [1]:
            # The key expires and another send takes it over before the retry is sent.
            _expire_keys(db, db_schema)
            task.send(2)
            raise RuntimeError("first attempt fails")

    task = dramatiq.actor(
        flaky,
        actor_name=f"dd_{uuid.uuid4().hex[:8]}",
        queue_name=queue_name,
        broker=broker,
        dedupe_key=lambda n: "order-42",
        min_backoff=10,
        max_backoff=20,
    )
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    worker.start()
    task.send(1)
    wait_for(
        lambda: sorted(attempts) == [1, 1, 2], timeout_ms=20000, message="the retry of the first message never ran"
    )


def test_postgres_brokers_housekeeping_purges_expired_keys(
    pg_broker: PostgresBroker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    task = _actor(pg_broker)
    task.send_with_options(dedupe_key="old")
    _expire_keys(db, db_schema)
    task.send_with_options(dedupe_key="live")
    with pg_broker.database.autocommit() as conn:
        pg_broker._housekeeping(conn)
    keys = db.execute(sql.SQL("SELECT dedupe_key FROM {}.send_dedupe").format(sql.Identifier(db_schema))).fetchall()
    assert keys == [("live",)]
