"""Order per key against real Postgres (and RabbitMQ): one job of a key at a time, in send order."""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Callbacks, SkipMessage
from psycopg import sql

from dramatiq_reliable import (
    ActorOptionError,
    DatabaseUnavailable,
    DeadLetterFilter,
    DeadLetters,
    OutboxBroker,
    PostgresBroker,
    WorkerRelay,
)
from dramatiq_reliable.cli import main
from dramatiq_reliable.dead_letters import PostgresDeadLetterStore
from dramatiq_reliable.flow import OrderedKeys, order_waiting
from dramatiq_reliable.flow import order as order_module
from dramatiq_reliable.jobs import cancel_job, show_job
from dramatiq_reliable.schema import ORDER_CONCURRENCY_VERSION
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(params=["postgres", "outbox"])
def ordered(request: pytest.FixtureRequest, database_url: str, db_schema: str) -> Iterator[Any]:
    """A broker of each kind with OrderedKeys (lease 1 s) and DeadLetters; the global broker."""
    if request.param == "postgres":
        broker: Any = PostgresBroker(database=database_url, schema=db_schema, lease_ms=2000)
    else:
        broker = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
        broker.add_middleware(WorkerRelay(poll_interval_ms=20))
    broker.add_middleware(OrderedKeys(lease_ms=1000), before=Callbacks)
    broker.add_middleware(DeadLetters())
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


@pytest.fixture
def queue(ordered: Any, request: pytest.FixtureRequest) -> str:
    if isinstance(ordered, OutboxBroker):
        return str(request.getfixturevalue("queue_name"))
    return "ordered"


@pytest.fixture
def worker(ordered: Any) -> Iterator[dramatiq.Worker]:
    instance = dramatiq.Worker(ordered, worker_timeout=50, worker_threads=4)
    yield instance
    instance.stop()


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT key, seq, state FROM {} ORDER BY key, seq").format(sql.Identifier(schema, "order_jobs"))
    return db.execute(query).fetchall()


def test_jobs_of_a_key_run_one_at_a_time_in_send_order_and_other_keys_run_alongside(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[tuple[str, int, str]] = []
    running: dict[str, int] = {}
    overlap: list[str] = []
    lock = threading.Lock()

    @dramatiq.actor(queue_name=queue, broker=ordered, order_key=lambda account, n: f"acct-{account}")
    def sync(account: str, n: int) -> None:
        with lock:
            running[account] = running.get(account, 0) + 1
            if running[account] > 1:
                overlap.append(account)
            others = [k for k, v in running.items() if v and k != account]
            runs.append((account, n, ",".join(others)))
        time.sleep(0.01)
        with lock:
            running[account] -= 1

    with ordered.transaction():
        for n in range(8):
            for account in ("a", "b", "c"):
                sync.send(account, n)
    worker.start()
    wait_for(lambda: len(runs) == 24, timeout_ms=30_000, message=lambda: f"not every job ran: {runs}")
    assert not overlap, f"two jobs of one key ran at once: {overlap}"
    for account in ("a", "b", "c"):
        assert [n for a, n, _ in runs if a == account] == list(range(8))
    assert any(others for *_, others in runs), "the keys never ran alongside each other"
    wait_for(lambda: not _rows(db, db_schema), message="the finished jobs left their places behind")


def test_a_retrying_head_keeps_its_place_and_a_dead_one_parks_its_key_until_replayed(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[tuple[str, int]] = []
    failures = {("a", 1): 1, ("a", 2): 99}  # a1 fails once (retried), a2 fails for good

    @dramatiq.actor(
        queue_name=queue,
        broker=ordered,
        order_key=lambda account, n: account,
        max_retries=1,
        min_backoff=50,
        max_backoff=100,
    )
    def step(account: str, n: int) -> None:
        runs.append((account, n))
        if failures.get((account, n), 0) > 0:
            failures[(account, n)] -= 1
            raise RuntimeError(f"step {account}{n} failed")

    with ordered.transaction():
        for n in range(4):
            step.send("a", n)
        step.send("b", 0)
    worker.start()
    wait_for(lambda: ("b", 0) in runs and runs.count(("a", 2)) == 2, timeout_ms=30_000, message=lambda: f"runs: {runs}")
    wait_for(
        lambda: _rows(db, db_schema)[:1] == [("a", 3, "dead")], message=lambda: f"a2 not dead: {_rows(db, db_schema)}"
    )
    assert [r for r in runs if r[0] == "a"] == [("a", 0), ("a", 1), ("a", 1), ("a", 2), ("a", 2)]
    assert [(row["key"], row["head_state"], row["waiting"]) for row in order_waiting(db, schema=db_schema)] == [
        ("a", "dead", 2)
    ]
    failures[("a", 2)] = 0
    PostgresDeadLetterStore.from_broker(ordered).replay(where=DeadLetterFilter(), force=True)
    wait_for(lambda: ("a", 3) in runs, timeout_ms=15_000, message=lambda: f"the replay did not release the key: {runs}")
    assert [r for r in runs if r[0] == "a"][-3:] == [("a", 2), ("a", 2), ("a", 3)]
    wait_for(lambda: not _rows(db, db_schema), message="places left behind")


def test_a_discarded_dead_head_releases_its_key_and_a_send_outside_a_transaction_keeps_its_place(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue, broker=ordered, order_key=lambda n: "k", max_retries=0)
    def step(n: int) -> None:
        runs.append(n)
        if n == 1:
            raise RuntimeError("step 1 failed")

    for n in range(3):
        step.send(n)  # nothing bound: each send commits its place and its message together
    worker.start()
    wait_for(
        lambda: _rows(db, db_schema) == [("k", 2, "dead"), ("k", 3, "parked")],
        message=lambda: f"step 1 not dead: {_rows(db, db_schema)}",
    )
    assert runs == [0, 1]
    PostgresDeadLetterStore.from_broker(ordered).discard(where=DeadLetterFilter(), note="not needed")
    wait_for(lambda: runs == [0, 1, 2], message=lambda: f"the discard did not release the key: {runs}")
    wait_for(lambda: not _rows(db, db_schema), message="places left behind")


def test_a_head_whose_nack_is_written_before_its_release_still_parks_its_key(
    ordered: Any,
    queue: str,
    worker: dramatiq.Worker,
    db: psycopg.Connection[Any],
    db_schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release is written by a thread of its own and the nack by the consumer's: either may come
    first.  A nack written first once found its head still running and left it alone; the release
    then put it back to waiting, a head whose message was gone, and its key was held for ever (failed
    once in CI)."""
    middleware = next(m for m in ordered.middleware if isinstance(m, OrderedKeys))
    nacked = threading.Event()
    flush, after_nack = middleware._flush_releases, middleware.after_nack

    def release_after_the_nack(broker: Any) -> None:
        with middleware._releasing:
            failed = any(not done for _, done in middleware._pending)
        if failed:
            nacked.wait(10)
        flush(broker)

    def nack(broker: Any, message: MessageProxy) -> None:
        after_nack(broker, message)
        nacked.set()

    monkeypatch.setattr(middleware, "_flush_releases", release_after_the_nack)
    monkeypatch.setattr(middleware, "after_nack", nack)
    runs: list[int] = []

    @dramatiq.actor(queue_name=queue, broker=ordered, order_key=lambda n: "k", max_retries=0)
    def step(n: int) -> None:
        runs.append(n)
        if n == 0:
            raise RuntimeError("step 0 failed")

    with ordered.transaction():
        step.send(0)
        step.send(1)
    worker.start()
    wait_for(
        lambda: _rows(db, db_schema) == [("k", 1, "dead"), ("k", 2, "parked")],
        message=lambda: f"step 0 not dead: {_rows(db, db_schema)}",
    )
    PostgresDeadLetterStore.from_broker(ordered).discard(where=DeadLetterFilter(), note="not needed")
    wait_for(lambda: runs == [0, 1], message=lambda: f"the discard did not release the key: {runs}")
    wait_for(lambda: not _rows(db, db_schema), message="places left behind")


def test_a_key_function_that_raises_refuses_the_send_and_writes_nothing(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=queue, broker=ordered, order_key=lambda account: account["id"])
    def sync(account: Any) -> None:
        raise AssertionError("never runs")

    raised = r"of actor 'sync': order_key raised TypeError: .*the job was not run"
    with pytest.raises(ActorOptionError, match=raised), ordered.transaction():
        sync.send("acct-1")
    with pytest.raises(ActorOptionError, match=r"of actor 'sync': order_key gave 7, not a non-empty string"):
        sync.send({"id": 7})
    table = "queue" if isinstance(ordered, PostgresBroker) else "outbox"
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(db_schema, table))).fetchone() == (0,)
    assert _rows(db, db_schema) == []


def test_a_message_sent_without_a_place_is_not_run_but_dead_lettered(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    plain = PostgresBroker(database=database_url, schema=db_schema)
    worker_broker = PostgresBroker(database=database_url, schema=db_schema, lease_ms=2000)
    worker_broker.add_middleware(OrderedKeys(lease_ms=1000), before=Callbacks)
    worker_broker.add_middleware(DeadLetters())
    runs: list[int] = []
    dramatiq.actor(lambda n: None, actor_name="step", queue_name="ordered", broker=plain).send(1)
    dramatiq.actor(runs.append, actor_name="step", queue_name="ordered", broker=worker_broker, order_key=str)
    worker = dramatiq.Worker(worker_broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        store = PostgresDeadLetterStore.from_broker(worker_broker)
        wait_for(lambda: store.count(where=DeadLetterFilter()) == 1, message="the message was not dead-lettered")
    finally:
        worker.stop()
        plain.close()
        worker_broker.close()
    assert runs == []


def test_a_schema_without_the_order_tables_refuses_the_send_naming_the_command(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    db.execute(sql.SQL("DROP TABLE {} CASCADE").format(sql.Identifier(db_schema, "order_jobs")))
    broker = PostgresBroker(database=database_url, schema=db_schema)
    broker.add_middleware(OrderedKeys())
    try:
        sync = dramatiq.actor(lambda n: None, actor_name="sync", broker=broker, order_key=str)
        with pytest.raises(
            DatabaseUnavailable,
            match=rf"needs schema '{db_schema}' at version {ORDER_CONCURRENCY_VERSION} .*run 'dramatiq-reliable",
        ):
            sync.send(1)
    finally:
        broker.close()


def test_status_names_the_keys_that_wait_and_what_frees_a_dead_head(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    broker.add_middleware(OrderedKeys())
    try:
        sync = dramatiq.actor(lambda n: None, actor_name="sync", queue_name="ordered", broker=broker, order_key=str)
        first = sync.send(7)
        sync.send(7)
    finally:
        broker.close()
    jobs = sql.Identifier(db_schema, "order_jobs")
    db.execute(sql.SQL("UPDATE {} SET state = 'dead' WHERE message_id = %s").format(jobs), (first.message_id,))
    base = ["status", "--database-url", database_url, "--schema", db_schema, "--skip-rabbitmq"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert f"order key '7': 2 waiting, dead head {first.message_id}: replay or discard its dead letter" in out
    assert main([*base, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["keys_waiting"]["order"]
    assert (row["key"], row["waiting"], row["head_state"], row["head_message_id"]) == ("7", 2, "dead", first.message_id)


def test_the_flow_control_page_shows_a_parked_key_and_links_its_dead_head(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    from starlette.testclient import TestClient

    from dramatiq_reliable.web import create_app

    app = create_app(database_url, schema=db_schema)
    with TestClient(app, client=("127.0.0.1", 50000), base_url="http://localhost") as client:
        assert "No ordered job waits now." in client.get("/rate-limits").text
        broker = PostgresBroker(database=database_url, schema=db_schema)
        broker.add_middleware(OrderedKeys())
        try:
            sync = dramatiq.actor(lambda n: None, actor_name="sync", queue_name="ordered", broker=broker, order_key=str)
            first = sync.send(7)
            sync.send(7)
        finally:
            broker.close()
        jobs = sql.Identifier(db_schema, "order_jobs")
        db.execute(sql.SQL("UPDATE {} SET state = 'dead' WHERE message_id = %s").format(jobs), (first.message_id,))
        page = client.get("/rate-limits")
    assert page.status_code == 200
    assert 'data-testid="order-key-row" data-key="7"' in page.text
    assert f"/jobs/show?id={first.message_id}" in page.text, "the dead head links to its job page"
    assert "No job is parked on a full key now." in page.text


def test_a_head_whose_worker_died_before_its_release_is_sent_again_once_its_lease_lapses(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    middleware = OrderedKeys(lease_ms=300)
    broker.add_middleware(middleware)
    try:
        sync = dramatiq.actor(lambda n: None, actor_name="sync", queue_name="ordered", broker=broker, order_key=str)
        sent = sync.send(1)
        queue = sql.Identifier(db_schema, "queue")
        (body,) = db.execute(sql.SQL("SELECT body FROM {}").format(queue)).fetchone() or (None,)
        # A worker took the head and acked its delivery, then died before the release.
        take = sql.SQL("SELECT outcome FROM {}.order_take('lock:', %s, 'gone', 300, 'ordered', %s, NULL, false, true)")
        assert db.execute(take.format(sql.Identifier(db_schema)), (sent.message_id, body)).fetchone() == ("run",)
        db.execute(sql.SQL("DELETE FROM {}").format(queue))
        assert middleware.sweep(broker) == 0  # the lease still holds
        wait_for(lambda: middleware.sweep(broker) == 1, message="the lapsed head was not sent again")
        resent = db.execute(sql.SQL("SELECT message_id, queue_name FROM {}").format(queue)).fetchall()
        assert resent == [(sent.message_id, "ordered")]
        assert [(key, state) for key, _, state in _rows(db, db_schema)] == [("1", "waiting")]
    finally:
        broker.close()


def test_a_cancelled_job_gives_up_its_place_so_its_successors_run(
    ordered: Any, queue: str, worker: dramatiq.Worker, db: psycopg.Connection[Any], db_schema: str
) -> None:
    runs: list[int] = []
    step = dramatiq.actor(runs.append, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction():
        first = step.send_with_options(args=(0,), delay=60_000)  # waits in Postgres: cancel deletes it there
        for n in range(1, 3):
            step.send(n)
    cancel_job(ordered.database, db_schema, first.message_id, by="test")
    worker.start()
    wait_for(lambda: runs == [1, 2], message=lambda: f"the cancelled head held its key: {runs}")
    wait_for(lambda: not _rows(db, db_schema), message="places left behind")


def test_a_woken_job_keeps_its_priority_and_place_and_a_finished_key_leaves_no_row(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    middleware = next(m for m in ordered.middleware if isinstance(m, OrderedKeys))
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction():
        first = step.send(0)
        second = step.send_with_options(args=(1,), broker_priority=7)
    table = sql.Identifier(db_schema, "queue" if isinstance(ordered, PostgresBroker) else "outbox")
    db.execute(sql.SQL("DELETE FROM {}").format(table))  # both delivered (and acked): the rows are gone
    head, early = MessageProxy(first), MessageProxy(second)
    middleware.before_process_message(ordered, head)
    with pytest.raises(SkipMessage, match="not its turn"):  # on another worker thread: a context of its own
        contextvars.copy_context().run(middleware.before_process_message, ordered, early)
    (parked_by,) = db.execute("SELECT clock_timestamp()").fetchone() or (None,)
    middleware.after_process_message(ordered, head, result=None)  # wakes the parked job
    woken = db.execute(sql.SQL("SELECT message_id, priority FROM {}").format(table)).fetchall()
    assert woken == [(second.message_id, 7)], "the woken job lost its priority"
    if isinstance(ordered, PostgresBroker):  # and its place: ahead of what was sent after it
        (since,) = db.execute(sql.SQL("SELECT available_at FROM {}").format(table)).fetchone() or (None,)
        assert since < parked_by, "the woken job went to the back of the queue"
    middleware.before_process_message(ordered, MessageProxy(second))
    middleware.after_process_message(ordered, MessageProxy(second), result=None)
    assert _rows(db, db_schema) == []
    leftovers = db.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s AND table_name LIKE 'order%%'",
        (db_schema,),
    ).fetchall()
    assert leftovers == [("order_jobs",)], "a per-key table that nothing purges"


def test_a_retry_delivered_before_its_failed_run_is_released_is_sent_again_not_lost(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    middleware = next(m for m in ordered.middleware if isinstance(m, OrderedKeys))
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    sent = step.send(0)
    table = sql.Identifier(db_schema, "queue" if isinstance(ordered, PostgresBroker) else "outbox")
    db.execute(sql.SQL("DELETE FROM {}").format(table))
    running = MessageProxy(sent)
    middleware.before_process_message(ordered, running)
    # The run failed and its retry was delivered (on another thread) before the release.
    with pytest.raises(SkipMessage, match="the message was parked"):
        contextvars.copy_context().run(middleware.before_process_message, ordered, MessageProxy(sent))
    middleware.after_process_message(ordered, running, exception=RuntimeError("boom"))
    resent = db.execute(sql.SQL("SELECT message_id FROM {}").format(table)).fetchall()
    assert resent == [(sent.message_id,)], "the retry was acked while parked and never sent again"
    assert [state for *_, state in _rows(db, db_schema)] == ["waiting"]


def test_takes_written_in_one_group_never_wait_for_a_key_locked_elsewhere(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    broker = PostgresBroker(database=database_url, schema=db_schema)
    middleware = OrderedKeys()
    broker.add_middleware(middleware)
    try:
        step = dramatiq.actor(lambda key: None, actor_name="step", queue_name="ordered", broker=broker, order_key=str)
        free, locked = step.send("free"), step.send("locked")
        takes = [
            {
                "lock_prefix": order_module._lock_prefix(db_schema),
                "message_id": sent.message_id,
                "owner": "test",
                "lease_ms": 30_000,
                "queue_name": "ordered",
                "body": sent.encode(),
                "priority": None,
                "async": False,
            }
            for sent in (free, locked)
        ]
        with psycopg.connect(database_url) as holder:  # a transaction elsewhere holds the key "locked"
            holder.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{takes[1]['lock_prefix']}locked",)
            )
            rows = order_module._take_many(broker.database, db_schema, takes)
            assert [row["outcome"] for row in rows] == ["run", "busy"]  # returned at once, not waited for
        assert [state for *_, state in _rows(db, db_schema)] == ["running", "waiting"]  # "locked" was left as it was
    finally:
        broker.close()


def test_jobs_show_says_a_parked_job_waits_for_its_turn_and_which_job_holds_its_key(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    middleware = next(m for m in ordered.middleware if isinstance(m, OrderedKeys))
    step = dramatiq.actor(lambda n: None, actor_name="step", queue_name=queue, broker=ordered, order_key=lambda n: "k")
    with ordered.transaction():
        head, _, third = (step.send(n) for n in range(3))
    table = sql.Identifier(db_schema, "queue" if isinstance(ordered, PostgresBroker) else "outbox")
    db.execute(sql.SQL("DELETE FROM {}").format(table))  # delivered (and acked): the broker's rows are gone
    middleware.before_process_message(ordered, MessageProxy(head))
    with pytest.raises(SkipMessage, match="not its turn"):  # delivered early, on another worker thread
        contextvars.copy_context().run(middleware.before_process_message, ordered, MessageProxy(third))
    status = show_job(ordered.database, db_schema, third.message_id)
    assert status.state == "waiting"
    assert status.actor_name == "step"
    assert "order key 'k': 2 job(s) ahead" in status.detail
    assert f"its head {head.message_id} is running" in status.detail
    middleware.after_process_message(ordered, MessageProxy(head), result=None)


@pytest.mark.parametrize("ordered", ["postgres"], indirect=True)
def test_two_transactions_sending_keys_in_opposite_orders_get_an_error_that_names_the_send_order(
    ordered: Any, queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    """Postgres breaks the deadlock by rolling one transaction back; its sender is told why and
    how to avoid it (not to check its connection), and the other transaction commits both jobs."""
    task = dramatiq.actor(lambda key: None, actor_name="opposite", queue_name=queue, order_key=lambda key: key)
    both_hold_one = threading.Barrier(2, timeout=10)
    errors: dict[str, BaseException] = {}

    def send(first: str, second: str) -> None:
        try:
            with ordered.transaction():
                task.send(first)
                both_hold_one.wait()
                task.send(second)
        except DatabaseUnavailable as error:
            errors[first] = error

    threads = [threading.Thread(target=send, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    ((loser, error),) = errors.items()  # exactly one of the two was rolled back
    assert "opposite orders" in str(error) and "sorted by key" in str(error)
    assert "check the database connection" not in str(error)
    assert isinstance(error.__cause__, psycopg.errors.DeadlockDetected)
    # The winner's two places are there; nothing of the loser's transaction is.
    assert [key for key, _, _ in _rows(db, db_schema)] == ["a", "b"]
    assert loser in ("a", "b")
