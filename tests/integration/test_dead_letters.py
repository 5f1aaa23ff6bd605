"""Dead letters against a real Postgres and RabbitMQ: every way a message dies, replay, retention."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.common import xq_name
from dramatiq.message import Message
from dramatiq.middleware import AgeLimit, Callbacks, CurrentMessage, Pipelines, Retries, ShutdownNotifications
from dramatiq.middleware.time_limit import TimeLimit
from psycopg import sql
from support import TcpProxy

from dramatiq_reliable import ClassifiedRetries, OutboxBroker, Unrecoverable, WorkerRelay, events
from dramatiq_reliable.dead_letters import (
    DeadLetter,
    DeadLetterCaptured,
    DeadLetterCaptureFailed,
    DeadLetterFilter,
    DeadLetters,
    DeadLettersReplayed,
    PostgresDeadLetterStore,
    notify_channel,
)
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration

RETRIES = {"max_retries": 2, "min_backoff": 10, "max_backoff": 20}


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture
def make_broker(rabbitmq_url: str, database_url: str, db_schema: str) -> Iterator[Callable[..., OutboxBroker]]:
    made: list[OutboxBroker] = []

    def make(*middleware: Any) -> OutboxBroker:
        broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, middleware=list(middleware))
        dramatiq.set_broker(broker)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.close()


@pytest.fixture
def run_worker(make_broker: Any, queue_name: str) -> Iterator[Callable[[OutboxBroker], dramatiq.Worker]]:
    # Depends on queue_name so the workers stop before the test's queues are deleted.
    workers: list[dramatiq.Worker] = []

    def run(broker: OutboxBroker) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
        worker.start()
        workers.append(worker)
        return worker

    yield run
    for worker in workers:
        worker.stop()


@pytest.fixture
def seen_events() -> Iterator[list[events.Event]]:
    seen: list[events.Event] = []
    events.subscribe(seen.append)
    yield seen
    events.unsubscribe(seen.append)


def _middleware(
    dead_letters: DeadLetters, *, retries: Any = None, time_limit: Any = None, extra: Any = ()
) -> list[Any]:
    """Dramatiq's defaults, then DeadLetters, then the relay, the retry middleware last."""
    return [
        *extra,
        AgeLimit(),
        time_limit or TimeLimit(),
        ShutdownNotifications(),
        Callbacks(),
        Pipelines(),
        dead_letters,
        WorkerRelay(poll_interval_ms=100),
        retries or Retries(**RETRIES),
    ]


def _dead(db: psycopg.Connection[Any], db_schema: str, where: str = "TRUE") -> list[dict[str, Any]]:
    cursor = db.cursor(row_factory=psycopg.rows.dict_row)
    return cursor.execute(
        sql.SQL("SELECT * FROM {}.dead_letters WHERE " + where + " ORDER BY id").format(sql.Identifier(db_schema))
    ).fetchall()


def _outbox(db: psycopg.Connection[Any], db_schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL("SELECT message_id, queue_name, body, eta FROM {}.outbox ORDER BY id").format(sql.Identifier(db_schema))
    ).fetchall()


def _wait_dead(db: psycopg.Connection[Any], db_schema: str, count: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    return wait_for(lambda: (rows := _dead(db, db_schema, **kwargs)) and len(rows) >= count and rows, timeout_ms=20000)


def _capture(
    broker: OutboxBroker,
    *,
    actor_name: str = "send_email",
    queue_name: str = "default",
    error: BaseException | None = None,
    sent_days_ago: float = 0,
    options: dict[str, Any] | None = None,
    dead_letters: DeadLetters | None = None,
) -> DeadLetter:
    """A dead letter the way the middleware stores one, without running a worker."""
    timestamp = int((time.time() - sent_days_ago * 86400) * 1000)
    message = Message(
        queue_name=queue_name,
        actor_name=actor_name,
        args=(42,),
        kwargs={"to": "ada@example.com"},
        options=dict(options or {}),
        message_timestamp=timestamp,
    )
    proxy = MessageProxy(message)
    try:
        raise error or ValueError("boom")
    except BaseException as raised:
        proxy.stuff_exception(raised)
    proxy.fail()
    stored = (dead_letters or DeadLetters()).capture(broker, proxy)
    assert stored is not None
    return stored


# -- every way of dying --------------------------------------------------------------------------


@pytest.mark.pooler
def test_exhausted_retries_land_once_with_the_last_traceback_and_every_attempt_counted(
    make_broker, run_worker, queue_name, rabbit, db, db_schema, seen_events
):
    hooked: list[DeadLetter] = []
    broker = make_broker(*_middleware(DeadLetters(on_dead_letter=hooked.append)))
    attempts: list[int] = []

    def always_fails(order_id: int) -> None:
        attempts.append(order_id)
        raise ValueError(f"attempt {len(attempts)} failed for order {order_id}")

    task = dramatiq.actor(always_fails, actor_name=f"{queue_name}_fails", queue_name=queue_name, broker=broker)
    run_worker(broker)
    message = task.send(7)

    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, timeout_ms=20000, message="message never reached .XQ")
    [row] = _wait_dead(db, db_schema)
    assert len(attempts) == 3
    assert row["message_id"] == message.message_id
    assert row["attempts"] == 3
    assert row["reason"] == "retries_exhausted"
    assert row["error_type"] == "ValueError"
    assert row["error_message"] == "attempt 3 failed for order 7"
    assert "attempt 3 failed" in row["traceback"] and "attempt 2 failed" not in row["traceback"]
    assert row["culprit"].endswith(
        "in test_exhausted_retries_land_once_with_the_last_traceback_and_every_attempt_counted.<locals>.always_fails"
    )
    assert row["first_failed_at"] < row["last_failed_at"]
    assert row["worker_pid"] == os.getpid()
    assert row["message"]["args"] == [7]
    assert row["message"]["options"]["retries"] == 3
    assert row["queue_name"] == queue_name and row["state"] == "dead"
    # The alerting hook and the event saw the same row.
    assert [item.id for item in hooked] == [row["id"]]
    assert [e.dead_letter_id for e in seen_events if isinstance(e, DeadLetterCaptured)] == [row["id"]]


def test_throws_unknown_actor_and_age_limit_are_each_stored_with_their_reason(
    make_broker, run_worker, queue_name, rabbit, db, db_schema
):
    broker = make_broker(*_middleware(DeadLetters()))

    def expected_failure(n: int) -> None:
        raise KeyError(f"no such user {n}")

    def never_runs(n: int) -> None:
        raise AssertionError("the age limit should have dropped this message")

    throws = dramatiq.actor(
        expected_failure, actor_name=f"{queue_name}_throws", queue_name=queue_name, broker=broker, throws=(KeyError,)
    )
    aged = dramatiq.actor(never_runs, actor_name=f"{queue_name}_aged", queue_name=queue_name, broker=broker, max_age=1)
    run_worker(broker)
    sent_throws = throws.send(1)
    sent_aged = aged.send(2)
    ghost = Message(queue_name=queue_name, actor_name="ghost_actor", args=(3,), kwargs={}, options={})
    broker.enqueue(ghost)

    rows = {row["message_id"]: row for row in _wait_dead(db, db_schema, count=3)}
    wait_for(lambda: rabbit.count(xq_name(queue_name)) == 3, timeout_ms=20000)
    assert (rows[sent_throws.message_id]["reason"], rows[sent_throws.message_id]["attempts"]) == ("unrecoverable", 1)
    assert rows[sent_throws.message_id]["error_type"] == "KeyError"
    assert (rows[sent_aged.message_id]["reason"], rows[sent_aged.message_id]["attempts"]) == ("age_limit", 0)
    assert rows[sent_aged.message_id]["error_type"] == "dramatiq.middleware.middleware.SkipMessage"
    assert (rows[ghost.message_id]["reason"], rows[ghost.message_id]["attempts"]) == ("failed", 0)
    assert rows[ghost.message_id]["error_type"] == "dramatiq.errors.ActorNotFound"
    assert rows[ghost.message_id]["actor_name"] == "ghost_actor"


def test_a_time_limit_kill_is_stored_with_the_time_limit_error(make_broker, run_worker, queue_name, db, db_schema):
    broker = make_broker(*_middleware(DeadLetters(), time_limit=TimeLimit(time_limit=10_000, interval=20)))
    broker.emit_after("process_boot")  # starts TimeLimit's timer thread, as the CLI worker does

    def slow(n: int) -> None:
        for _ in range(1000):
            time.sleep(0.01)

    task = dramatiq.actor(
        slow, actor_name=f"{queue_name}_slow", queue_name=queue_name, broker=broker, time_limit=100, max_retries=0
    )
    run_worker(broker)
    task.send(1)

    [row] = _wait_dead(db, db_schema)
    assert row["error_type"] == "dramatiq.middleware.time_limit.TimeLimitExceeded"
    assert (row["reason"], row["attempts"]) == ("time_limit", 1)
    assert row["culprit"].endswith(".slow")


def test_classified_retries_decisions_are_stored_with_reason_and_http_status(
    make_broker, run_worker, queue_name, db, db_schema
):
    broker = make_broker(
        *_middleware(
            DeadLetters(),
            retries=ClassifiedRetries(max_retries=2, min_backoff=10, max_backoff=20, jitter="none"),
        )
    )

    class NotFoundError(Exception):
        def __init__(self) -> None:
            super().__init__("GET /users/9 returned 404")
            self.response = type("Response", (), {"status_code": 404})()

    def unrecoverable(n: int) -> None:
        raise Unrecoverable(f"user {n!r} does not exist")

    def not_found(n: int) -> None:
        raise NotFoundError()

    def times_out(n: int) -> None:
        raise TimeoutError("read timed out")

    sent = {}
    for name, fn in (("unrecoverable", unrecoverable), ("not_found", not_found), ("times_out", times_out)):
        actor = dramatiq.actor(fn, actor_name=f"{queue_name}_{name}", queue_name=queue_name, broker=broker)
        sent[name] = actor
    run_worker(broker)
    ids = {name: actor.send(1).message_id for name, actor in sent.items()}

    rows = {row["message_id"]: row for row in _wait_dead(db, db_schema, count=3)}
    gone = rows[ids["unrecoverable"]]
    assert (gone["reason"], gone["attempts"], gone["error_type"]) == (
        "unrecoverable",
        1,
        "dramatiq_reliable.Unrecoverable",
    )
    assert gone["retry_decision"]["category"] == "permanent"
    missing = rows[ids["not_found"]]
    assert (missing["reason"], missing["attempts"], missing["http_status"]) == ("unrecoverable", 1, 404)
    assert missing["retry_decision"]["reason"] == "http_404"
    slow = rows[ids["times_out"]]
    assert (slow["reason"], slow["attempts"]) == ("retries_exhausted", 3)
    assert slow["retry_decision"]["reason"] == "timeout"


def test_postgres_down_at_capture_still_leaves_the_message_in_the_xq_and_says_so_loudly(
    database_url, make_broker, run_worker, queue_name, rabbit, db, db_schema, caplog, seen_events
):
    proxy = TcpProxy.to(database_url).start()
    proxy.stop()  # an outage: connections to the proxy's port are refused
    down = DeadLetters(database=proxy.url, timeout_ms=300)
    broker = make_broker(*_middleware(down))

    def fails(n: int) -> None:
        raise KeyError("expected")

    task = dramatiq.actor(fails, actor_name=f"{queue_name}_f", queue_name=queue_name, broker=broker, throws=KeyError)
    run_worker(broker)
    with caplog.at_level(logging.CRITICAL, logger="dramatiq_reliable.dead_letters"):
        message = task.send(1)
        wait_for(lambda: rabbit.count(xq_name(queue_name)) == 1, timeout_ms=20000, message="the nack did not happen")

    [body] = rabbit.take_all(xq_name(queue_name), expect=1)
    assert body["message_id"] == message.message_id
    assert _dead(db, db_schema) == []
    assert any(
        message.message_id in record.getMessage() and "NOT stored" in record.getMessage() for record in caplog.records
    )
    [failed] = [e for e in seen_events if isinstance(e, DeadLetterCaptureFailed)]
    assert failed.message_id == message.message_id and failed.dead_letter_queue == xq_name(queue_name)


# -- capture details -----------------------------------------------------------------------------


def test_a_redelivered_message_that_dies_again_refreshes_its_row_instead_of_adding_one(broker, db, db_schema):
    first = _capture(broker, options={"retries": 3})
    message = Message(**{**first.message, "args": tuple(first.message["args"])})  # type: ignore[arg-type]
    proxy = MessageProxy(message)
    try:
        raise ValueError("again")
    except ValueError as error:
        proxy.stuff_exception(error)
    proxy.fail()
    second = DeadLetters().capture(broker, proxy)

    assert second is not None and second.id == first.id and second.captures == 2
    [row] = _dead(db, db_schema)
    assert row["error_message"] == "again" and row["first_failed_at"] == first.first_failed_at


def test_every_new_dead_letter_is_announced_on_the_schema_channel(broker, direct_database_url, db_schema):
    # The test listens directly (LISTEN needs a session); the capture's NOTIFY goes through the pooler.
    with psycopg.connect(direct_database_url, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(db_schema))))
        stored = _capture(broker, actor_name="charge_card")
        [note] = list(listener.notifies(timeout=5, stop_after=1))
    assert note.channel == f"{db_schema}.dead_letters"
    payload = json.loads(note.payload)
    assert payload["id"] == stored.id and payload["actor_name"] == "charge_card"
    assert payload["fingerprint"] == stored.fingerprint and payload["error_type"] == "ValueError"


def test_the_first_failure_time_is_kept_across_retries(broker, db_schema):
    started = int(time.time() * 1000) - 60_000
    stored = _capture(
        broker, options={"retries": 3, "first_failure_ms": started, "requeue_timestamp": started + 50_000}
    )
    assert abs(stored.first_failed_at.timestamp() * 1000 - started) < 2
    assert stored.last_failed_at > stored.first_failed_at


# -- replay --------------------------------------------------------------------------------------


def test_replay_by_id_and_by_filter_runs_the_jobs_again_through_the_outbox_with_their_message_ids(
    make_broker, run_worker, queue_name, db, db_schema
):
    broker = make_broker(*_middleware(DeadLetters(), extra=[CurrentMessage()]))
    store = PostgresDeadLetterStore.from_broker(broker)
    fixed = threading.Event()
    runs: list[tuple[str, str, dict[str, Any]]] = []

    def make(name: str) -> dramatiq.Actor[Any, Any]:
        def job(n: int) -> None:
            current = CurrentMessage.get_current_message()
            assert current is not None
            runs.append((name, current.message_id, dict(current.options)))
            if not fixed.is_set():
                raise LookupError(f"bug in {name}")

        return dramatiq.actor(
            job, actor_name=f"{queue_name}_{name}", queue_name=queue_name, broker=broker, throws=LookupError
        )

    first, second = make("first"), make("second")
    run_worker(broker)
    sent = [first.send(1), first.send(2), first.send(3), second.send(4)]
    rows = _wait_dead(db, db_schema, count=4)
    by_message = {row["message_id"]: row["id"] for row in rows}
    fixed.set()  # the bug is fixed and deployed
    runs.clear()

    one = store.replay(ids=[by_message[sent[0].message_id]])
    assert (one.replayed, one.problems) == (1, {})
    wait_for(lambda: len(runs) == 1, timeout_ms=20000)
    name, message_id, options = runs[0]
    assert (name, message_id) == ("first", sent[0].message_id)
    assert options["replay_of"]["dead_letter_id"] == by_message[sent[0].message_id]
    assert "retries" not in options and "traceback" not in options

    bulk = store.replay(where=DeadLetterFilter(actor_name=f"{queue_name}_first"))
    assert bulk.replayed == 2
    wait_for(lambda: len(runs) == 3, timeout_ms=20000)
    assert sorted(message_id for _, message_id, _ in runs) == sorted(m.message_id for m in sent[:3])
    states = {row["message_id"]: row["state"] for row in _dead(db, db_schema)}
    assert states == {**{m.message_id: "replayed" for m in sent[:3]}, sent[3].message_id: "dead"}


def test_a_replay_in_a_transaction_that_rolls_back_changes_nothing(broker, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    stored = _capture(broker)
    with pytest.raises(RuntimeError, match="changed my mind"), broker.transaction():
        assert store.replay(ids=[stored.id]).replayed == 1
        raise RuntimeError("changed my mind")
    [row] = _dead(db, db_schema)
    assert row["state"] == "dead" and row["handled_at"] is None
    assert _outbox(db, db_schema) == []


def test_a_dead_letter_is_replayed_at_most_once_even_by_concurrent_replays(broker, database_url, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    stored = _capture(broker)
    with psycopg.connect(database_url) as conn:
        assert store.replay(ids=[stored.id], conn=conn).replayed == 1  # not committed yet
        concurrent = store.replay(ids=[stored.id])
        conn.commit()
    assert concurrent.replayed == 0 and "concurrent" in concurrent.problems[stored.id]
    assert store.replay(ids=[stored.id]).problems == {stored.id: "already replayed"}
    assert len(_outbox(db, db_schema)) == 1


def test_replaying_an_old_dead_letter_is_refused_unless_forced(broker, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    old = _capture(broker, sent_days_ago=21)
    fresh = _capture(broker)

    refused = store.replay(ids=[old.id])
    assert refused.replayed == 0 and "force" in refused.problems[old.id]
    bulk = store.replay(where=DeadLetterFilter())
    assert (bulk.replayed, bulk.too_old) == (1, 1)
    assert store.replay_preview(where=DeadLetterFilter(), force=True) == (1, 0)
    forced = store.replay(ids=[old.id], force=True)
    assert forced.replayed == 1
    assert {row["id"]: row["state"] for row in _dead(db, db_schema)} == {old.id: "replayed", fresh.id: "replayed"}


def test_a_replay_can_go_to_another_queue_later_and_decodes_as_a_dramatiq_message(broker, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    stored = _capture(broker, options={"retries": 5, "traceback": "...", "trace_context": {"traceparent": "00-ab"}})
    before = int(time.time() * 1000)
    assert store.replay(ids=[stored.id], queue_name="repair", delay_ms=60_000).replayed == 1

    [(message_id, routing_key, body, eta)] = _outbox(db, db_schema)
    message = Message.decode(bytes(body))
    assert message_id == message.message_id == stored.message_id
    # The delay waits in the outbox: the row is due at its eta and goes to the queue itself,
    # with no eta in the body (a worker would otherwise hold it unacked until then).
    assert routing_key == message.queue_name == "repair"
    assert "eta" not in message.options
    assert eta is not None and eta.timestamp() * 1000 >= before + 60_000
    [(available_at,)] = db.execute(
        sql.SQL("SELECT available_at FROM {}.outbox").format(sql.Identifier(db_schema))
    ).fetchall()
    assert available_at == eta
    assert message.options["trace_context"] == {"traceparent": "00-ab"}
    assert "retries" not in message.options and "traceback" not in message.options
    assert message.message_timestamp >= before
    assert (message.args, message.kwargs) == ((42,), {"to": "ada@example.com"})
    assert _dead(db, db_schema)[0]["replayed_to"] == "repair"


def test_a_replayed_job_that_dies_again_keeps_its_original_age(broker, db, db_schema, seen_events):
    store = PostgresDeadLetterStore.from_broker(broker)
    old = _capture(broker, sent_days_ago=3)
    store.replay(ids=[old.id])
    [(_, _, body, _)] = _outbox(db, db_schema)
    replayed = Message.decode(bytes(body))
    again = _capture(broker, options=replayed.options)
    assert again.id != old.id
    assert abs((again.sent_at - old.sent_at).total_seconds()) < 0.01
    assert [e.count for e in seen_events if isinstance(e, DeadLettersReplayed)] == [1]


def test_drain_outbox_publishes_a_replay_to_the_queue(broker, queue_name, rabbit):
    store = PostgresDeadLetterStore.from_broker(broker)
    stored = _capture(broker, queue_name=queue_name)
    store.replay(ids=[stored.id])
    assert drain_outbox(broker) == 1
    [body] = rabbit.take_all(queue_name, expect=1)
    assert body["message_id"] == stored.message_id and body["args"] == [42]


# -- reading, grouping, discard, retention ------------------------------------------------------


def _fails_in_charge() -> None:
    raise ConnectionResetError("payment provider hung up")


def _fails_in_render() -> None:
    raise KeyError("template")


def test_stats_group_a_thousand_failures_of_one_bug_into_one_row(broker, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    for n in range(5):
        try:
            _fails_in_charge()
        except ConnectionResetError as error:
            _capture(broker, actor_name=f"charge_{n % 2}", error=error)
    try:
        _fails_in_render()
    except KeyError as error:
        _capture(broker, actor_name="render", error=error)

    groups = store.stats()
    assert [(g.count, g.error_type, g.actors) for g in groups] == [(5, "ConnectionResetError", 2), (1, "KeyError", 1)]
    assert groups[0].culprit is not None and "in _fails_in_charge" in groups[0].culprit
    assert store.stats(where=DeadLetterFilter(fingerprint=groups[1].fingerprint))[0].actor_name == "render"
    counts = {(c.actor_name, c.error_type): c.count for c in store.counts()}
    assert counts == {
        ("charge_0", "ConnectionResetError"): 3,
        ("charge_1", "ConnectionResetError"): 2,
        ("render", "KeyError"): 1,
    }


def test_listing_filters_and_pages_without_gaps_or_repeats(broker, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    stored = [_capture(broker, actor_name=f"a{n % 3}", queue_name=f"q{n % 2}") for n in range(12)]
    db.execute(
        sql.SQL("UPDATE {}.dead_letters SET last_failed_at = last_failed_at - interval '2 days' WHERE id = %s").format(
            sql.Identifier(db_schema)
        ),
        (stored[0].id,),
    )

    seen: list[int] = []
    cursor = None
    while True:
        page = store.list(limit=5, cursor=cursor)
        seen += [item.id for item in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(seen) == sorted(item.id for item in stored) and len(seen) == 12
    assert seen[-1] == stored[0].id  # oldest last

    by_actor = store.list(where=DeadLetterFilter(actor_name="a1")).items
    assert {item.id for item in by_actor} == {item.id for item in stored if item.actor_name == "a1"}
    both = store.list(where=DeadLetterFilter(actor_name="a1", queue_name="q1")).items
    assert {item.id for item in both} == {i.id for i in stored if (i.actor_name, i.queue_name) == ("a1", "q1")}
    now = datetime.datetime.now(datetime.timezone.utc)
    recent = store.list(where=DeadLetterFilter(since=now - datetime.timedelta(days=1))).items
    assert stored[0].id not in {item.id for item in recent} and len(recent) == 11
    old = store.list(where=DeadLetterFilter(until=now - datetime.timedelta(days=1))).items
    assert [item.id for item in old] == [stored[0].id]
    assert store.list(where=DeadLetterFilter(error_type="KeyError")).items == ()
    assert store.get(stored[3].id).traceback.startswith("Traceback")  # type: ignore[union-attr]
    assert store.get(10**9) is None


def test_discard_keeps_an_audit_trail_and_purge_removes_handled_and_expired_rows(broker, db, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker)
    keep, drop, expired = _capture(broker), _capture(broker, actor_name="welcome_email"), _capture(broker)
    result = store.discard(where=DeadLetterFilter(actor_name="welcome_email"), note="sent by hand", by="ada")
    assert result.discarded == 1
    row = _dead(db, db_schema, where=f"id = {drop.id}")[0]
    assert (row["state"], row["note"], row["handled_by"]) == ("discarded", "sent by hand", "ada")
    assert store.replay(ids=[drop.id]).problems == {drop.id: "already discarded"}
    assert store.discard(ids=[drop.id, 10**9]).problems == {drop.id: "already discarded", 10**9: "not found"}

    db.execute(
        sql.SQL("UPDATE {}.dead_letters SET last_failed_at = now() - interval '40 days' WHERE id = %s").format(
            sql.Identifier(db_schema)
        ),
        (expired.id,),
    )
    purged = store.purge()
    assert (purged.dead, purged.handled) == (1, 1)
    assert [row["id"] for row in _dead(db, db_schema)] == [keep.id]


def test_bulk_replay_reports_progress_batch_by_batch(broker, db_schema):
    store = PostgresDeadLetterStore.from_broker(broker, batch_size=2)
    for _ in range(5):
        _capture(broker)
    progress: list[tuple[int, int]] = []
    assert (
        store.replay(where=DeadLetterFilter(), progress=lambda done, total: progress.append((done, total))).replayed
        == 5
    )
    assert progress == [(2, 5), (4, 5), (5, 5)]


def test_store_and_middleware_refuse_bad_arguments_with_the_fix(broker):
    from dramatiq_reliable import ConfigurationError

    with pytest.raises(TypeError, match="database"):
        PostgresDeadLetterStore()  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="where=DeadLetterFilter"):
        PostgresDeadLetterStore.from_broker(broker).replay()
    with pytest.raises(ConfigurationError, match="canonical"):
        PostgresDeadLetterStore.from_broker(broker).replay(ids=[1], queue_name="q.XQ")
    with pytest.raises(ConfigurationError, match="longer than 50 bytes"):
        DeadLetters(schema="s" * 52)
    with pytest.raises(ConfigurationError, match="callable"):
        DeadLetters(on_dead_letter="page me")  # type: ignore[arg-type]
