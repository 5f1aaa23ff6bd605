"""Delays wait in Postgres, not in worker memory: every delayed path is an outbox row published when due.

A delayed send, a retry's backoff and a delayed replay each become an outbox row addressed to the
queue itself and due at its eta; the relay publishes it when due, and the worker runs it at once.
No worker holds a delayed message unacked, so RabbitMQ's ``consumer_timeout`` never closes a
channel under a delay (the test on a node with a 3 s ``consumer_timeout`` shows it).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import current_millis, dq_name
from dramatiq.message import Message
from psycopg import sql
from support import capture_dead_letter, running

from dramatiq_reliable import OutboxBroker, PostgresDeadLetterStore, Relay, WorkerRelay, _sql
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


class Runs:
    """When each message ran (ms), by message id, recorded by the actor."""

    def __init__(self) -> None:
        self.at: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def record(self) -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        assert message is not None
        with self._lock:
            self.at.setdefault(message.message_id, []).append(current_millis())

    def count(self) -> int:
        with self._lock:
            return sum(len(times) for times in self.at.values())


def _actor(broker: Any, queue_name: str, runs: Runs, **options: Any) -> dramatiq.Actor[Any, Any]:
    if not any(isinstance(m, dramatiq.middleware.CurrentMessage) for m in broker.middleware):
        broker.add_middleware(dramatiq.middleware.CurrentMessage())
    return dramatiq.actor(
        lambda *args: runs.record(), actor_name=f"{queue_name}_job", queue_name=queue_name, broker=broker, **options
    )


def _outbox(db: psycopg.Connection[Any], db_schema: str) -> list[dict[str, Any]]:
    cursor = db.cursor(row_factory=psycopg.rows.dict_row)
    return cursor.execute(
        sql.SQL("SELECT queue_name, eta, available_at, published_at, body FROM {}.outbox ORDER BY id").format(
            sql.Identifier(db_schema)
        )
    ).fetchall()


def _lateness_ms(runs: Runs, etas: dict[str, int]) -> list[int]:
    return [runs.at[message_id][0] - eta for message_id, eta in etas.items()]


# -- each path ----------------------------------------------------------------------------------------


def test_a_delayed_send_runs_once_within_a_second_of_its_eta_and_never_enters_the_delay_queue(
    broker, worker, queue_name, rabbit, db, db_schema
):
    runs = Runs()
    task = _actor(broker, queue_name, runs)
    broker.add_middleware(WorkerRelay())
    worker.start()
    sent = [task.send_with_options(args=(n,), delay=1500 + 300 * n) for n in range(3)]
    etas = {message.message_id: message.options["eta"] for message in sent}
    # Waiting in Postgres, addressed to the queue itself, due at the eta.
    rows = _outbox(db, db_schema)
    assert {row["queue_name"] for row in rows} == {queue_name}
    assert all(row["published_at"] is None and row["available_at"] == row["eta"] for row in rows)
    wait_for(lambda: runs.count() == 3, timeout_ms=20_000, message="the delayed messages never ran")
    lateness = _lateness_ms(runs, etas)
    assert all(0 <= late < 1000 for late in lateness), lateness
    assert rabbit.count(dq_name(queue_name)) == 0
    assert {message_id: len(times) for message_id, times in runs.at.items()} == dict.fromkeys(etas, 1)


def test_an_idle_relay_publishes_a_delayed_row_when_due_not_a_poll_interval_later(broker, queue_name, rabbit):
    runs = Runs()
    task = _actor(broker, queue_name, runs)
    relay = Relay.from_broker(broker, poll_interval_ms=60_000)
    probes = 0
    probe = relay._probe

    def counted() -> float | None:
        nonlocal probes
        probes += 1
        return probe()

    relay._probe = counted  # type: ignore[method-assign]
    with running(relay.run, relay.stop):
        wait_for(lambda: relay._sleeping_s is not None, message="the relay never went idle")
        message = task.send_with_options(delay=2000)
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=10_000, message="the row was never published")
        published_at = current_millis()
    # Woken for the due time: a wait of its 60 s poll interval would be about a minute late
    # (the bound leaves room for a busy machine).
    assert 0 <= published_at - message.options["eta"] < 2000
    # It woke for the due time, without spinning: the idle backoff's probes and one at the due time.
    assert probes < 100


def test_a_retry_waits_for_its_backoff_in_the_outbox_and_comes_back_to_its_queue(
    broker, worker, queue_name, rabbit, db, db_schema
):
    attempts: list[int] = []

    def flaky() -> None:
        attempts.append(current_millis())
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")

    dramatiq.actor(
        flaky,
        actor_name=f"{queue_name}_flaky",
        queue_name=queue_name,
        broker=broker,
        min_backoff=1200,
        max_backoff=1200,
    )
    broker.add_middleware(WorkerRelay())
    worker.start()
    broker.get_actor(f"{queue_name}_flaky").send()
    wait_for(lambda: len(attempts) == 2, timeout_ms=20_000, message="the retry never ran")
    retry = _outbox(db, db_schema)[1]
    assert retry["queue_name"] == queue_name and retry["eta"] is not None
    assert json.loads(bytes(retry["body"]))["options"]["retries"] == 1
    # Dramatiq's jitter draws the backoff from 600-1200 ms; it ran when due (the bound leaves
    # room for a busy machine: the on-time figures are the delayed-send tests' and the benchmark's).
    eta_ms = int(retry["eta"].timestamp() * 1000)
    assert 0 <= attempts[1] - eta_ms < 2000
    assert attempts[1] - attempts[0] >= 500
    assert rabbit.count(dq_name(queue_name)) == 0


def test_a_delayed_replay_of_a_dead_letter_runs_once_when_due(broker, worker, queue_name, db, db_schema):
    runs = Runs()
    _actor(broker, queue_name, runs)
    stored = capture_dead_letter(broker, actor_name=f"{queue_name}_job", queue_name=queue_name)
    broker.add_middleware(WorkerRelay())
    worker.start()
    store = PostgresDeadLetterStore.from_broker(broker)
    replayed_at = current_millis()
    assert store.replay(ids=[stored.id], delay_ms=1500).replayed == 1
    [row] = _outbox(db, db_schema)
    assert row["queue_name"] == queue_name and row["published_at"] is None
    wait_for(lambda: runs.count() == 1, timeout_ms=20_000, message="the replay never ran")
    late = runs.at[stored.message_id][0] - int(row["eta"].timestamp() * 1000)
    assert 0 <= late < 2000
    assert runs.at[stored.message_id][0] - replayed_at >= 1500


def test_a_message_delayed_the_old_way_in_its_delay_queue_still_runs_at_its_eta(
    broker, worker, queue_name, rabbitmq_url
):
    """A .DQ message published before this version (or by a plain RabbitmqBroker) still drains."""
    runs = Runs()
    task = _actor(broker, queue_name, runs)
    plain = RabbitmqBroker(url=rabbitmq_url)
    try:
        plain.declare_queue(queue_name)
        old = plain.enqueue(
            Message(queue_name=queue_name, actor_name=task.actor_name, args=(), kwargs={}, options={}), delay=1500
        )
    finally:
        plain.close()
    assert old.queue_name == dq_name(queue_name)
    worker.start()
    wait_for(lambda: runs.count() == 1, timeout_ms=20_000, message="the legacy .DQ message never ran")
    assert runs.at[old.message_id][0] >= old.options["eta"]


# -- join, flush and the claim -------------------------------------------------------------------------


def test_join_waits_for_a_delayed_message_and_flush_drops_one(broker, worker, queue_name, db, db_schema):
    runs = Runs()
    task = _actor(broker, queue_name, runs)
    broker.add_middleware(WorkerRelay())
    worker.start()
    message = task.send_with_options(delay=1500)
    broker.join(queue_name, timeout=20_000)
    assert runs.at[message.message_id][0] >= message.options["eta"]

    task.send_with_options(delay=600_000)
    broker.flush(queue_name)
    assert [row for row in _outbox(db, db_schema) if row["published_at"] is None] == []


def test_claiming_due_rows_reads_none_of_ten_thousand_rows_scheduled_for_later(db, db_schema):
    outbox = sql.Identifier(db_schema, "outbox")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, eta, available_at) "
            "SELECT 'later' || n, 'q', 'a', 'body', now() + make_interval(mins => 1 + n % 60), "
            "now() + make_interval(mins => 1 + n % 60) FROM generate_series(1, 10000) AS n"
        ).format(outbox)
    )
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, eta, available_at) "
            "SELECT 'due' || n, 'q', 'a', 'body', now() - make_interval(secs => n), now() - make_interval(secs => n) "
            "FROM generate_series(1, 3) AS n"
        ).format(outbox)
    )
    db.execute(sql.SQL("ANALYZE {}").format(outbox))
    with db.transaction():
        db.execute(_sql.query("outbox_relay_local", db_schema), {"statement_timeout": "30000", "idle_timeout": "60000"})
        claim = _sql.query("outbox_claim", db_schema).as_string(db)
        [[plan]] = db.execute(
            sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + sql.SQL(claim), {"batch_size": 500, "max_attempts": 25}
        ).fetchall()
        claimed = db.execute(sql.SQL(claim), {"batch_size": 500, "max_attempts": 25}).fetchall()
    scan = plan[0]["Plan"]
    while "Index Name" not in scan:
        scan = scan["Plans"][0]
    assert scan["Index Name"] == "outbox_due"
    assert scan["Actual Rows"] == 3 and scan.get("Rows Removed by Filter", 0) == 0
    # Due order: the row due longest ago first.
    assert [row[1] for row in claimed] == ["due3", "due2", "due1"]


# -- a RabbitMQ node with a 3 s consumer_timeout ---------------------------------------------------------


def test_delays_well_past_the_consumer_timeout_run_once_on_time_with_no_channel_closed(
    rabbitmq_short_timeout_node, database_url, db_schema, queue_name, caplog
):
    """Dramatiq would hold these in worker memory from .DQ for 5-7 s: the node would close the channel
    under them (PRECONDITION_FAILED) and redeliver.  Kept in Postgres, none is held at all."""
    node = rabbitmq_short_timeout_node
    timeouts_before = node.log_text().count("timed out waiting for")
    broker = OutboxBroker(url=node.url, database=database_url, schema=db_schema)
    runs = Runs()
    task = _actor(broker, queue_name, runs)
    broker.add_middleware(WorkerRelay())
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    try:
        worker.start()
        sent = [task.send_with_options(args=(n,), delay=5000 + 500 * n) for n in range(5)]
        etas = {message.message_id: message.options["eta"] for message in sent}
        # Each message was sent 5-7 s before its eta, past the 3 s timeout and its 1 s check: a
        # channel holding one would have been closed by the time it ran.
        wait_for(lambda: runs.count() >= 5, timeout_ms=30_000, message="the delayed messages never ran")
    finally:
        worker.stop()
        broker.close()
    lateness = _lateness_ms(runs, etas)
    assert {message_id: len(times) for message_id, times in runs.at.items()} == dict.fromkeys(etas, 1)
    assert all(0 <= late < 1000 for late in lateness), lateness
    assert "PRECONDITION_FAILED" not in caplog.text
    assert node.log_text().count("timed out waiting for") == timeouts_before
