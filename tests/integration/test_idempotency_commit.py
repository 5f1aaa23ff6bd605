"""A job's COMMIT against real Postgres and RabbitMQ: an unknown outcome is retried, a refusal is classified.

A proxy of the test's own stands between the middleware and Postgres and breaks the
connection at the COMMIT, either after the server answered (the commit landed, the reply is
lost) or before the COMMIT reached it (nothing landed).  Both look the same to the worker.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.common import xq_name
from dramatiq.middleware import Callbacks
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool
from support import TcpProxy

from dramatiq_reliable import ClassifiedRetries, DeadLetters, OutboxBroker, WorkerRelay, build_middleware, events
from dramatiq_reliable.idempotency import Idempotency, job_connection
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


class CommitCutter(TcpProxy):
    """A TCP proxy that, while armed, breaks each connection at its next ``COMMIT``.

    ``landed=True``: the COMMIT reaches Postgres and its reply is dropped (the commit happened,
    the client cannot know).  ``landed=False``: the COMMIT is dropped (nothing happened).
    """

    def __init__(self, target_host: str, target_port: int, *, landed: bool, once: bool) -> None:
        super().__init__(target_host, target_port)
        self.landed, self.once = landed, once
        self.armed = threading.Event()
        self.cuts = 0
        self._doomed: set[socket.socket] = set()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._backward, args=(upstream, client), daemon=True).start()

    def _forward(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                # psycopg sends COMMIT as a simple query: 'Q', length, "COMMIT\0".
                if self.armed.is_set() and b"COMMIT\x00" in data:
                    with self._lock:
                        self.cuts += 1
                    if self.once:
                        self.armed.clear()
                    if self.landed:
                        self._doomed.add(upstream)  # its reply, and the connection, die upstream
                        upstream.sendall(data)
                    else:
                        self._cut(client, upstream)
                    continue
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

    def _backward(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                if upstream in self._doomed:
                    self._cut(client, upstream)  # the server answered the COMMIT: drop the answer
                    return
                client.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)

    def _cut(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def seen() -> Iterator[list[events.Event]]:
    received: list[events.Event] = []
    events.subscribe(received.append)
    yield received
    events.unsubscribe(received.append)


@pytest.fixture
def effects(db: psycopg.Connection[Any], db_schema: str) -> str:
    table = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (id serial PRIMARY KEY, n int NOT NULL)").format(table))
    return table.as_string(db)


def _proxied(database_url: str, *, landed: bool, once: bool) -> tuple[CommitCutter, ConnectionPool[Any]]:
    """A cutter in front of the configured Postgres and a pool that connects through it."""
    params = conninfo_to_dict(database_url)
    proxy = CommitCutter(
        str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432), landed=landed, once=once
    )
    proxy.start()
    pool: ConnectionPool[Any] = ConnectionPool(
        make_conninfo(database_url, host="127.0.0.1", port=str(proxy.port)),
        min_size=1,
        max_size=4,
        timeout=5,
        open=True,
    )
    return proxy, pool


@contextlib.contextmanager
def _worker(broker: OutboxBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def _count(db: psycopg.Connection[Any], table: str) -> int:
    row = db.execute(f"SELECT count(*) FROM {table}").fetchone()  # type: ignore[arg-type]
    assert row is not None
    return int(row[0])


def _named(seen: list[events.Event], name: str) -> list[dict[str, Any]]:
    return [e.as_attributes() for e in seen if e.name == name]


def _keys(db: psycopg.Connection[Any], db_schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL("SELECT job_key, message_id FROM {}").format(sql.Identifier(db_schema, "processed_jobs"))
    ).fetchall()


@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed-reply-lost", "commit-never-arrived"])
def test_a_commit_cut_by_the_network_is_retried_outside_the_budget_and_has_one_effect(
    broker, queue_name, db, db_schema, database_url, effects, seen, rabbit, landed
):
    proxy, pool = _proxied(database_url, landed=landed, once=True)
    runs: list[int] = []
    try:
        broker.add_middleware(
            Idempotency(database=pool, schema=db_schema, unknown_outcome_backoff_ms=20), before=Callbacks
        )
        broker.add_middleware(WorkerRelay(poll_interval_ms=50))

        # max_retries=0: were the unknown outcome counted as a failure, the message would die at once.
        @dramatiq.actor(queue_name=queue_name, broker=broker, max_retries=0)
        def record(n: int) -> None:
            runs.append(n)
            job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))

        pool.wait(timeout=10)
        proxy.armed.set()
        with _worker(broker):
            message = record.send(7)
            if landed:
                wait_for(lambda: _named(seen, "idempotency.duplicate"), timeout_ms=20_000, message="no skip")
            else:
                wait_for(lambda: len(runs) == 2 and _keys(db, db_schema), timeout_ms=20_000, message="no rerun")
        assert proxy.cuts == 1
        (failed,) = _named(seen, "idempotency.commit_failed")
        assert (failed["message_id"], failed["outcome"]) == (message.message_id, "unknown")
        (scheduled,) = _named(seen, "retry.scheduled")
        assert (scheduled["message_id"], scheduled["reason"]) == (message.message_id, "commit_outcome_unknown")
        assert _count(db, effects) == 1
        assert _keys(db, db_schema) == [(message.message_id, message.message_id)]
        assert runs == ([7] if landed else [7, 7])
        # The retry went through the outbox (a row due after its backoff), counted apart from "retries".
        (body,) = db.execute(
            sql.SQL("SELECT body FROM {} WHERE queue_name = %s AND eta IS NOT NULL").format(
                sql.Identifier(db_schema, "outbox")
            ),
            (queue_name,),
        ).fetchone()
        options = _options(body)
        assert options["unknown_outcome_retries"] == 1
        assert options.get("retries", 0) == 0
        assert options["retry_decision"]["reason"] == "commit_outcome_unknown"
        assert rabbit.count(xq_name(queue_name)) == 0
    finally:
        pool.close()
        proxy.stop()


def _options(body: Any) -> dict[str, Any]:
    import json

    raw = bytes(body) if not isinstance(body, (str, dict)) else body
    data = raw if isinstance(raw, dict) else json.loads(raw)
    return dict(data["options"])


def test_commits_that_keep_breaking_end_as_dead_letters_with_reason_commit_outcome_unknown(
    rabbitmq_url, database_url, db, db_schema, queue_name, effects, seen
):
    proxy, pool = _proxied(database_url, landed=False, once=False)
    broker = OutboxBroker(
        url=rabbitmq_url,
        database=database_url,
        schema=db_schema,
        middleware=build_middleware(
            retries=ClassifiedRetries(max_retries=0),
            middleware=[
                DeadLetters(),
                Idempotency(database=pool, schema=db_schema, unknown_outcome_retries=2, unknown_outcome_backoff_ms=10),
            ],
        ),
    )
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    runs: list[int] = []
    try:

        @dramatiq.actor(queue_name=queue_name, broker=broker)
        def record(n: int) -> None:
            runs.append(n)
            job_connection().execute(f"INSERT INTO {effects} (n) VALUES (%s)", (n,))

        pool.wait(timeout=10)
        proxy.armed.set()
        with _worker(broker):
            message = record.send(1)
            table = sql.Identifier(db_schema, "dead_letters")
            row = wait_for(
                lambda: db.execute(
                    sql.SQL("SELECT reason, error_type, error_message, attempts FROM {}").format(table)
                ).fetchone(),
                timeout_ms=30_000,
                message="no dead letter",
            )
        reason, error_type, error_message, attempts = row
        assert reason == "commit_outcome_unknown"
        assert error_type == "dramatiq_reliable.CommitOutcomeUnknown"
        assert "outcome is unknown" in error_message and "were not saved" not in error_message
        assert attempts == 1  # the unknown outcomes did not count as failed attempts
        assert runs == [1, 1, 1]  # the first run and its two retries
        assert proxy.cuts == 3
        assert _count(db, effects) == 0
        gave_up = _named(seen, "retry.gave_up")
        assert [(e["message_id"], e["outcome"], e["reason"]) for e in gave_up] == [
            (message.message_id, "outcome_unknown", "commit_outcome_unknown")
        ]
    finally:
        broker.close()
        pool.close()
        proxy.stop()


def test_a_commit_refused_by_a_deferred_constraint_keeps_its_classification(
    rabbitmq_url, database_url, db, db_schema, queue_name, seen
):
    table = sql.Identifier(db_schema, "unique_orders")
    db.execute(sql.SQL("CREATE TABLE {} (order_id int UNIQUE DEFERRABLE INITIALLY DEFERRED)").format(table))
    db.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(table))
    broker = OutboxBroker(
        url=rabbitmq_url,
        database=database_url,
        schema=db_schema,
        middleware=build_middleware(
            retries=ClassifiedRetries(max_retries=5, min_backoff=10, max_backoff=20),
            middleware=[DeadLetters(), Idempotency()],
        ),
    )
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    runs: list[int] = []
    try:

        @dramatiq.actor(queue_name=queue_name, broker=broker)
        def place(order_id: int) -> None:
            runs.append(order_id)
            # The duplicate passes the INSERT and fails only at COMMIT (the constraint is deferred).
            job_connection().execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(table), (order_id,))

        with _worker(broker):
            place.send(1)
            dead = sql.Identifier(db_schema, "dead_letters")
            row = wait_for(
                lambda: db.execute(
                    sql.SQL("SELECT reason, retry_decision->>'reason', error_type, attempts FROM {}").format(dead)
                ).fetchone(),
                timeout_ms=20_000,
                message="no dead letter",
            )
        assert row == ("unrecoverable", "integrity_error", "dramatiq_reliable.JobCommitFailed", 1)
        assert runs == [1]  # permanent: not retried
        (failed,) = _named(seen, "idempotency.commit_failed")
        assert failed["outcome"] == "failed"
        assert not _named(seen, "retry.scheduled")
    finally:
        broker.close()
