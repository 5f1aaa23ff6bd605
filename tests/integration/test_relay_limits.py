"""The relay under a slow link and hostile rows: confirmed rows are kept, slow ones are charged."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from support import TcpProxy

from dramatiq_reliable import OutboxBroker, PayloadError, Relay
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


class ThrottledProxy(TcpProxy):
    """A :class:`TcpProxy` that forwards at most ``bytes_per_s`` in each direction of a connection."""

    bytes_per_s = 256 * 1024

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:  # type: ignore[override]
        chunk = 16 * 1024
        try:
            while data := source.recv(chunk):
                sink.sendall(data)
                time.sleep(len(data) / self.bytes_per_s)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


def _rows(db: psycopg.Connection[Any], db_schema: str) -> dict[int, tuple[Any, ...]]:
    query = psycopg.sql.SQL(
        "SELECT id, published_at IS NOT NULL, attempts, last_error, octet_length(body) FROM {}.outbox ORDER BY id"
    ).format(psycopg.sql.Identifier(db_schema))
    return {row[0]: row[1:] for row in db.execute(query)}


def test_a_large_row_behind_a_slow_link_is_charged_and_the_small_ones_go_through(
    broker, queue_name, rabbit, db, db_schema, rabbitmq_url, database_url
):
    task = dramatiq.actor(lambda blob: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    broker.max_payload_bytes = None
    with broker.transaction():
        for i in range(3):
            task.send(f"small-{i}")
        task.send("x" * (2 * 1024 * 1024))  # 8 s at 256 KiB/s, far over the confirm timeout
        for i in range(3, 6):
            task.send(f"small-{i}")
    proxy = ThrottledProxy.to(rabbitmq_url, connection_attempts="1").start()
    relay = Relay(
        rabbitmq_url=proxy.url,
        database=broker.database,
        schema=db_schema,
        confirm_timeout_ms=1500,
        max_batch_bytes=64 * 1024,
        max_attempts=2,
        backoff_min_ms=50,
        row_backoff_max_ms=200,
        listen=False,
    )
    try:
        first = relay.drain_once()
        assert (first.published, first.failed) == (3, 0), "the small rows before the large one go in their own batch"
        second = relay.drain_once()
        assert (second.published, second.failed) == (0, 1), "the large row goes alone and is charged an attempt"
        rows = _rows(db, db_schema)
        big = next(row_id for row_id, row in rows.items() if row[3] > 1024 * 1024)
        assert rows[big][1] == 1 and "did not confirm" in rows[big][2]
        third = relay.drain_once()
        assert third.published == 3, "the small rows after the large one are not held back by it"
        # The large row is tried until max_attempts, then left for an operator: no endless copies.
        wait_for(lambda: _rows(db, db_schema)[big][1] >= 2 or relay.drain_once() is None, timeout_ms=30000)
        db.execute(
            psycopg.sql.SQL("UPDATE {}.outbox SET available_at = now()").format(psycopg.sql.Identifier(db_schema))
        )
        assert relay.drain_once().claimed == 0, "past its backoff, a row at max_attempts is not claimed again"
    finally:
        relay.publisher.close()
        proxy.stop()
    rows = _rows(db, db_schema)
    assert sum(1 for row in rows.values() if row[0]) == 6
    assert not rows[big][0] and rows[big][1] == 2
    retried = subprocess.run(
        [
            sys.executable,
            "-m",
            "dramatiq_reliable",
            "outbox",
            "retry",
            "--json",
            "--schema",
            db_schema,
            "--database-url",
            database_url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(retried.stdout) == {"reset": 1}
    assert _rows(db, db_schema)[big][1] == 0, "outbox retry gives a poisoned row a fresh start"


def test_a_confirm_timeout_keeps_the_rows_rabbitmq_confirmed(broker, queue_name, rabbit, db, db_schema, rabbitmq_url):
    task = dramatiq.actor(lambda blob: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    broker.max_payload_bytes = None
    with broker.transaction():
        for i in range(3):
            task.send(f"small-{i}")
        task.send("x" * (2 * 1024 * 1024))
        task.send("small-after")
    proxy = ThrottledProxy.to(rabbitmq_url, connection_attempts="1").start()
    relay = Relay(
        rabbitmq_url=proxy.url, database=broker.database, schema=db_schema, confirm_timeout_ms=1500, listen=False
    )
    try:
        result = relay.drain_once()
    finally:
        relay.publisher.close()
        proxy.stop()
    assert (result.published, result.failed) == (3, 2)
    rows = list(_rows(db, db_schema).values())
    assert [row[0] for row in rows] == [True, True, True, False, False]
    assert [row[1] for row in rows] == [0, 0, 0, 1, 1], "stats must show the unconfirmed rows as failing"


def test_a_row_with_an_empty_queue_name_is_refused_without_declaring_a_queue(broker, db, db_schema, rabbitmq_url):
    with broker.transaction() as conn:
        conn.execute(
            psycopg.sql.SQL(
                "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body) VALUES ('m', '', 'a', '\\x7b7d')"
            ).format(psycopg.sql.Identifier(db_schema))
        )
    declared: list[str] = []
    relay = Relay.from_broker(broker, listen=False)
    original = relay.publisher._declarer.declare_queue
    relay.publisher._declarer.declare_queue = lambda name, **kw: (declared.append(name), original(name, **kw))[1]  # type: ignore[method-assign]
    try:
        result = relay.drain_once()
    finally:
        relay.publisher.close()
    assert (result.published, result.failed) == (0, 1)
    assert declared == []
    [(published, attempts, error, _size)] = _rows(db, db_schema).values()
    assert not published and attempts == 1 and "queue name" in error


def test_send_refuses_an_empty_queue_name_and_leaves_the_transaction_usable(broker, db, db_schema):
    message: Message[Any] = Message(queue_name="", actor_name="a", args=(), kwargs={}, options={})
    with broker.transaction() as conn:
        with pytest.raises(PayloadError, match="queue name"):
            broker.enqueue(message)
        conn.execute("SELECT 1")
    assert _rows(db, db_schema) == {}


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"eta": "tomorrow"}, "milliseconds"),
        ({"eta": 1.5}, "milliseconds"),
        ({"eta": 10**18}, "9999"),
        ({"delay": 10**17}, "9999"),
        ({"idempotency_key": "order\x00-1"}, "NUL"),
        ({"idempotency_key": 42}, "non-empty string"),
        ({"idempotency_key": "\ud800x"}, "Unicode"),
    ],
)
def test_send_refuses_bad_options_like_a_bad_payload_and_the_caller_can_still_commit(
    broker: OutboxBroker, queue_name, db, db_schema, options, fix
):
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    with broker.transaction() as conn:
        conn.execute("CREATE TEMP TABLE done (x int) ON COMMIT DROP")
        with pytest.raises(PayloadError, match=fix):
            task.send_with_options(**options)
        conn.execute("INSERT INTO done VALUES (1)")
        task.send()
    assert len(_rows(db, db_schema)) == 1, "the transaction committed with the good send"


def _unpublished(db: psycopg.Connection[Any], db_schema: str) -> int:
    return sum(1 for row in _rows(db, db_schema).values() if not row[0])


@pytest.mark.parametrize("batch_size", [500, 4], ids=["rows-fewer-than-a-batch", "rows-over-a-batch"])
def test_drain_publishes_a_backlog_short_in_rows_but_long_in_bytes(
    broker, queue_name, rabbit, db, db_schema, batch_size
):
    """A pass that left rows for later by max_batch_bytes is not the end of the backlog.

    Before: with fewer rows than batch_size (or a last batch short of it) drain() stopped after
    the pass that deferred rows: 1 of 6 rows published (4 of 6 in batches of 4), the rest left.
    """
    task = dramatiq.actor(lambda blob: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    broker.max_payload_bytes = None
    with broker.transaction():
        for i in range(6):
            task.send(f"{i}-" + "x" * 2048)  # each row alone is over max_batch_bytes
    relay = Relay.from_broker(broker, batch_size=batch_size, max_batch_bytes=1024, listen=False)
    try:
        assert relay.drain() == 6
    finally:
        relay.publisher.close()
    assert _unpublished(db, db_schema) == 0
    assert len(rabbit.take_all(queue_name, expect=6)) == 6


def test_relay_once_publishes_a_backlog_short_in_rows_but_long_in_bytes(
    broker, queue_name, rabbit, db, db_schema, database_url, rabbitmq_url, capsys
):
    """``relay --once`` drains rows left for later by the default 4 MiB max_batch_bytes.

    Before: it printed "published 1 row" and exited 0 with 2 of 3 rows left in the outbox.
    """
    task = dramatiq.actor(lambda blob: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    broker.max_payload_bytes = None
    with broker.transaction():
        for i in range(3):
            task.send(f"{i}-" + "x" * (2 * 1024 * 1024 + 4096))  # two rows do not fit in 4 MiB
    code = main(
        ["relay", "--once", "--database-url", database_url, "--rabbitmq-url", rabbitmq_url, "--schema", db_schema]
    )
    out, _ = capsys.readouterr()
    assert (code, out) == (ExitCode.OK, "published 3 rows\n")
    assert _unpublished(db, db_schema) == 0
    assert rabbit.count(queue_name) == 3


def test_a_confirm_timeout_of_weeks_still_claims(broker, queue_name, rabbit, db, db_schema):
    """The claim's idle bound (twice the confirm timeout plus a statement) stays within Postgres's range.

    Before: confirm_timeout_ms=30 days passed validation and every claim failed with Postgres's
    "outside the valid range" for idle_in_transaction_session_timeout.
    """
    task = dramatiq.actor(lambda: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    task.send()
    relay = Relay.from_broker(broker, confirm_timeout_ms=30 * 86_400_000, listen=False)
    try:
        assert relay.drain() == 1
    finally:
        relay.publisher.close()
    assert _unpublished(db, db_schema) == 0
