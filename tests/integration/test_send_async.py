"""``await send_async(...)`` and ``async with broker.transaction()`` on both Postgres-backed brokers.

The async send shares everything with ``send()`` but the statement's run: these tests check the
transaction it lands in (commit, rollback, autocommit, refused), the dedupe, the input refused
before any SQL, the pools' lifecycle, and async actors under Dramatiq's ``AsyncIO`` middleware
whose job connection, writes and sends are one transaction with their Idempotency key.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import AsyncIO, Middleware
from psycopg import sql
from psycopg_pool.sched_async import AsyncScheduler

from dramatiq_reliable import (
    ClassifiedRetries,
    ConfigurationError,
    Idempotency,
    NotBound,
    OutboxBroker,
    PayloadError,
    PostgresBroker,
    WorkerRelay,
    bind,
    build_middleware,
    job_connection_async,
    send_async,
    send_async_with_options,
)
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _make(kind: str, database_url: str, rabbitmq_url: str, schema: str, **options: Any) -> Any:
    if kind == "outbox":
        return OutboxBroker(url=rabbitmq_url, database=database_url, schema=schema, **options)
    return PostgresBroker(database=database_url, schema=schema, **options)


@pytest.fixture(params=["outbox", "queue"])
def row_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str) -> Iterator[Any]:
    broker = _make(request.param, database_url, rabbitmq_url, db_schema, pool_max_size=12)
    yield broker
    broker.close()


def _actor(broker: Any, fn: Any = None, name: str | None = None, **options: Any) -> dramatiq.Actor[Any, Any]:
    """An actor (and queue) of its own name: a queue_name fixture's (or derived) if it reaches RabbitMQ."""
    name = name or f"sa_{uuid.uuid4().hex[:8]}"
    return dramatiq.actor(fn or (lambda *args: None), actor_name=name, queue_name=name, broker=broker, **options)


def _ids(db: psycopg.Connection[Any], broker: Any, actor: dramatiq.Actor[Any, Any] | None = None) -> list[str]:
    query = sql.SQL("SELECT message_id FROM {} WHERE actor_name = coalesce(%s, actor_name) ORDER BY message_id")
    table = sql.Identifier(broker.schema, broker.table)
    name = actor.actor_name if actor is not None else None
    return [row[0] for row in db.execute(query.format(table), (name,)).fetchall()]


# -- which transaction -------------------------------------------------------------------------


def test_a_send_in_an_async_transaction_exists_once_it_commits(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)

    async def main() -> tuple[str, list[str]]:
        async with row_broker.transaction() as conn:
            assert isinstance(conn, psycopg.AsyncConnection)
            message = await send_async(task, 1, note="x")
            during = _ids(db, row_broker)  # another connection: the row is not committed yet
        return message.message_id, during

    message_id, during = asyncio.run(main())
    assert during == []
    assert _ids(db, row_broker) == [message_id]


def test_a_send_in_an_async_transaction_that_rolls_back_leaves_nothing(
    row_broker: Any, db: psycopg.Connection[Any]
) -> None:
    task = _actor(row_broker)

    async def main() -> None:
        async with row_broker.transaction():
            await send_async(task, 1)
            raise LookupError("the order was refused")

    with pytest.raises(LookupError):
        asyncio.run(main())
    assert _ids(db, row_broker) == []


def test_a_bound_async_connection_carries_the_row_and_the_callers_own_write(
    row_broker: Any, db: psycopg.Connection[Any], database_url: str, db_schema: str
) -> None:
    task = _actor(row_broker)
    orders = sql.Identifier(db_schema, "orders")
    db.execute(sql.SQL("CREATE TABLE {} (id int)").format(orders))

    async def attempt(commit: bool) -> str:
        conn = await psycopg.AsyncConnection.connect(database_url)
        async with conn, conn.transaction(force_rollback=not commit):
            await conn.execute(sql.SQL("INSERT INTO {} VALUES (42)").format(orders))
            async with bind(conn):
                return (await send_async_with_options(task, args=(42,), delay=60_000)).message_id

    asyncio.run(attempt(commit=False))
    assert _ids(db, row_broker) == []
    kept = asyncio.run(attempt(commit=True))
    assert _ids(db, row_broker) == [kept]
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(orders)).fetchone() == (1,)


def test_a_sync_transaction_still_works_unchanged(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)
    with row_broker.transaction() as conn:
        assert isinstance(conn, psycopg.Connection)
        message = task.send(1)
    assert _ids(db, row_broker) == [message.message_id]


def test_with_nothing_bound_the_send_commits_on_its_own(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)

    async def main() -> str:
        return (await send_async(task, 1)).message_id

    sent = asyncio.run(main())
    assert _ids(db, row_broker) == [sent]


@pytest.mark.parametrize("kind", ["outbox", "queue"])
def test_on_unbound_error_refuses_an_unbound_async_send(
    kind: str, database_url: str, rabbitmq_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    broker = _make(kind, database_url, rabbitmq_url, db_schema, on_unbound="error")
    try:
        task = _actor(broker)
        with pytest.raises(NotBound, match="outside a transaction"):
            asyncio.run(send_async(task, 1))
        assert _ids(db, broker) == []
    finally:
        broker.close()


def test_a_plain_send_inside_an_async_transaction_is_refused(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)

    async def main() -> None:
        async with row_broker.transaction():
            task.send(1)

    with pytest.raises(NotBound, match="send_async"):
        asyncio.run(main())
    assert _ids(db, row_broker) == []


# -- a bound connection in the wrong state -----------------------------------------------------


def test_an_async_connection_in_autocommit_with_no_transaction_is_refused(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any]
) -> None:
    task = _actor(row_broker)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn, bind(conn):
            await send_async(task, 1)

    with pytest.raises(NotBound, match="autocommit with no transaction open"):
        asyncio.run(main())
    assert _ids(db, row_broker) == []


def test_an_async_connection_whose_transaction_failed_is_refused(
    row_broker: Any, database_url: str, db: psycopg.Connection[Any]
) -> None:
    task = _actor(row_broker)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(database_url) as conn, bind(conn):
            with pytest.raises(psycopg.errors.DivisionByZero):
                await conn.execute("SELECT 1 / 0")
            await send_async(task, 1)

    with pytest.raises(NotBound, match="failed transaction"):
        asyncio.run(main())
    assert _ids(db, row_broker) == []


def test_an_async_connection_to_another_database_is_refused(
    row_broker: Any, direct_database_url: str, db: psycopg.Connection[Any]
) -> None:
    task = _actor(row_broker)
    # Directly: a pooler would keep a server connection to template1, and CREATE DATABASE copies it.
    other = psycopg.conninfo.make_conninfo(direct_database_url, dbname="template1")

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(other) as conn, bind(conn):
            await send_async(task, 1)

    with pytest.raises(NotBound, match="template1"):
        asyncio.run(main())
    assert _ids(db, row_broker) == []


# -- input refused before any SQL ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"delay": -1}, PayloadError, "delay=-1"),
        ({"delay": "soon"}, PayloadError, "delay='soon'"),
        ({"broker_priority": 300}, PayloadError, "broker_priority=300"),
        ({"dedupe_key": ""}, PayloadError, "dedupe_key"),
        ({"args": [1]}, ConfigurationError, "args= as a tuple"),
        ({"args": (object(),)}, PayloadError, "cannot be encoded"),
    ],
)
def test_bad_input_is_refused_and_the_transaction_can_still_commit(
    row_broker: Any, db: psycopg.Connection[Any], options: dict[str, Any], error: type[Exception], match: str
) -> None:
    task = _actor(row_broker)

    async def main() -> str:
        async with row_broker.transaction() as conn:
            with pytest.raises(error, match=match):
                await send_async_with_options(task, **options)
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # not failed
            return (await send_async(task, 2)).message_id

    kept = asyncio.run(main())
    assert _ids(db, row_broker) == [kept]


def test_send_async_needs_an_actor(row_broker: Any) -> None:
    with pytest.raises(ConfigurationError, match="needs a Dramatiq actor"):
        asyncio.run(send_async(lambda: None))  # type: ignore[arg-type]


# -- dedupe ---------------------------------------------------------------------------------------


def test_a_second_async_send_with_the_same_key_returns_the_first(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)

    async def main() -> tuple[str, str]:
        first = await send_async_with_options(task, args=(1,), dedupe_key="order-7")
        async with row_broker.transaction():
            second = await send_async_with_options(task, args=(2,), dedupe_key="order-7")
        return first.message_id, second.message_id

    first, second = asyncio.run(main())
    assert first == second
    assert _ids(db, row_broker) == [first]


def test_fifty_concurrent_tasks_sending_one_key_write_one_row(row_broker: Any, db: psycopg.Connection[Any]) -> None:
    task = _actor(row_broker)

    async def send(index: int) -> str:
        if index % 2:  # half in a transaction of their own, half autocommit: both paths
            async with row_broker.transaction():
                return (await send_async_with_options(task, args=(index,), dedupe_key="order-42")).message_id
        return (await send_async_with_options(task, args=(index,), dedupe_key="order-42")).message_id

    async def main() -> list[str]:
        return await asyncio.gather(*(send(index) for index in range(50)))

    returned = asyncio.run(main())
    written = _ids(db, row_broker)
    assert len(written) == 1, "one row for fifty sends of one key"
    assert set(returned) == set(written)


def test_a_loop_that_ends_without_aclose_is_not_held_by_a_pool_task_that_missed_its_cancellation(
    row_broker: Any, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.wait_for`` can swallow a cancellation (CPython gh-86296), and
    psycopg_pool's scheduler waits in it: asyncio.run()'s end then waited for that task for up to
    ten minutes (a CI run hung here once).  The scheduler below misses every cancellation, as the
    race leaves it; the loop must still end, because the pool is closed at the loop's end."""
    run = AsyncScheduler.run

    async def deaf(self: AsyncScheduler) -> None:
        while True:
            try:
                return await run(self)
            except asyncio.CancelledError:
                continue  # a cancellation swallowed: only the pool's close stops it

    monkeypatch.setattr(AsyncScheduler, "run", deaf)
    task = _actor(row_broker)

    async def main() -> str:
        return (await send_async(task, 1)).message_id

    sent: list[str] = []
    ended = threading.Thread(target=lambda: sent.append(asyncio.run(main())), daemon=True)
    ended.start()
    ended.join(timeout=30)
    assert not ended.is_alive(), "asyncio.run() did not end: a pool task that missed its cancellation held it"
    assert _ids(db, row_broker) == sent
    (entry,) = row_broker.database._async_pools.values()
    assert entry.pool.closed, "the pool was closed when its loop ended"


def test_a_loop_whose_tasks_were_all_cancelled_gets_a_new_pool_on_its_next_send(
    row_broker: Any, db: psycopg.Connection[Any]
) -> None:
    """Cancelling every other task closes the pool (its guard cannot tell that from the loop's
    end); the loop goes on, and the next send opens a new pool instead of failing on the closed one."""
    task = _actor(row_broker)

    async def main() -> tuple[list[str], bool]:
        first = await send_async(task, 1)
        before = await row_broker.database.async_pool()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for other in others:
            other.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        assert before.closed, "the guard closed the pool when it was cancelled"
        second = await send_async(task, 2)
        after = await row_broker.database.async_pool()
        await row_broker.database.aclose()
        return [first.message_id, second.message_id], after is not before

    sent, renewed = asyncio.run(main())
    assert renewed
    assert sorted(_ids(db, row_broker)) == sorted(sent)


# -- middleware ----------------------------------------------------------------------------------


class _Hooks(Middleware):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("before", message.message_id))

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.seen.append(("after", message.message_id))

    def after_enqueue_failed(self, broker: Any, message: Any, delay: Any, *, exception: BaseException) -> None:
        self.seen.append(("failed", type(exception).__name__))


def test_the_enqueue_hooks_run_around_an_async_write_and_on_its_failure(row_broker: Any) -> None:
    hooks = _Hooks()
    row_broker.add_middleware(hooks)
    task = _actor(row_broker)

    async def main() -> str:
        sent = await send_async(task, 1)
        with pytest.raises(RuntimeError):
            async with row_broker.transaction() as conn:
                with pytest.raises(psycopg.errors.DivisionByZero):
                    await conn.execute("SELECT 1 / 0")
                with pytest.raises(NotBound, match="failed transaction"):
                    await send_async(task, 2)
                raise RuntimeError("roll back")
        return sent.message_id

    sent = asyncio.run(main())
    assert hooks.seen[:2] == [("before", sent), ("after", sent)]
    assert hooks.seen[2][0] == "before" and hooks.seen[3] == ("failed", "NotBound")


# -- the pools' lifecycle ------------------------------------------------------------------------


def _backends(db: psycopg.Connection[Any], application_name: str) -> int:
    row = db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (application_name,))
    return int(row.fetchone()[0])  # type: ignore[index]


@pytest.mark.needs_session(
    "counts the pool's server processes in pg_stat_activity; PgBouncer keeps them after the client closes"
)
@pytest.mark.parametrize("closing", ["aclose", "close_after_the_loop_ended"])
def test_the_async_pool_is_closed_by_aclose_and_by_close(
    closing: str, database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    name = f"sa_pool_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(
        database=psycopg.conninfo.make_conninfo(database_url, application_name=name), schema=db_schema
    )
    task = _actor(broker)

    async def main() -> None:
        await send_async(task, 1)
        assert _backends(db, name) >= 1
        if closing == "aclose":
            await broker.aclose()

    try:
        asyncio.run(main())
    finally:
        broker.close()
    wait_for(lambda: _backends(db, name) == 0, message="the async pool's connections were left open")


# -- async actors --------------------------------------------------------------------------------


@pytest.fixture(params=["outbox", "queue"])
def async_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str) -> Iterator[Any]:
    middleware = build_middleware(
        retries=ClassifiedRetries(max_retries=3, min_backoff=10, max_backoff=50),
        middleware=[Idempotency(), AsyncIO()],
    )
    broker = _make(request.param, database_url, rabbitmq_url, db_schema, middleware=middleware, pool_max_size=12)
    if request.param == "outbox":
        broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    yield broker
    broker.close()


def test_an_async_actor_writes_and_sends_in_its_jobs_transaction_once(
    async_broker: Any, db: psycopg.Connection[Any], db_schema: str, queue_name: str
) -> None:
    effects = sql.Identifier(db_schema, "effects")
    followed = sql.Identifier(db_schema, "followed")
    db.execute(sql.SQL("CREATE TABLE {} (n int); CREATE TABLE {} (n int)").format(effects, followed))
    attempts: list[int] = []

    def follow(n: int) -> None:
        db.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(followed), (n,))

    follow_up = _actor(async_broker, follow, name=f"{queue_name}_follow")

    async def work(n: int) -> None:
        conn = job_connection_async()
        assert await conn.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(effects), (n,)) == 1
        # The job's own transaction sees its write; no other attempt's is there.
        assert await conn.fetchall(sql.SQL("SELECT n FROM {}").format(effects)) == [(n,)]
        await send_async(follow_up, n)
        attempts.append(n)
        if len(attempts) == 1:
            raise TimeoutError("the first attempt fails after its write and its send")

    task = _actor(async_broker, work, name=queue_name)
    worker = dramatiq.Worker(async_broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        task.send(7)
        wait_for(lambda: len(attempts) == 2, message="the async actor did not run twice")
        async_broker.join(task.queue_name, timeout=20_000)
        async_broker.join(follow_up.queue_name, timeout=20_000)
    finally:
        worker.stop()
    count = sql.SQL("SELECT count(*) FROM {}")
    assert db.execute(count.format(effects)).fetchone() == (1,), "the failed attempt's write was rolled back"
    assert db.execute(count.format(followed)).fetchone() == (1,), "the failed attempt's message was never sent"
    keys = sql.SQL("SELECT count(*) FROM {} WHERE actor_name = %s").format(sql.Identifier(db_schema, "processed_jobs"))
    assert db.execute(keys, (task.actor_name,)).fetchone() == (1,), "one key, committed by the second attempt"


@pytest.mark.needs_session(
    "counts the pool's server processes in pg_stat_activity; PgBouncer keeps them after the client closes"
)
def test_an_async_actor_with_nothing_bound_sends_on_the_workers_sync_pool(
    database_url: str, db_schema: str, db: psycopg.Connection[Any], queue_name: str
) -> None:
    name = f"sa_worker_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(
        database=psycopg.conninfo.make_conninfo(database_url, application_name=name),
        schema=db_schema,
        middleware=build_middleware(middleware=[AsyncIO()]),
    )
    received: list[int] = []
    try:
        follow_up = _actor(broker, received.append, name=f"{queue_name}_follow")

        async def relay(n: int) -> None:
            await send_async(follow_up, n + 1)  # nothing bound: autocommit, as a worker's send

        task = _actor(broker, relay, name=queue_name)
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
        worker.start()
        try:
            task.send(1)
            wait_for(lambda: received == [2], message="the async actor's send never ran")
            assert broker.database._async_pools == {}, "no async pool on Dramatiq's loop, which cannot close one"
        finally:
            worker.stop()
    finally:
        broker.close()
    wait_for(lambda: _backends(db, name) == 0, message="a connection was left open")


def test_an_autocommit_send_on_a_pooled_connection_that_died_is_tried_again(
    database_url: str, db_schema: str, db: psycopg.Connection[Any]
) -> None:
    name = f"sa_retry_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(
        database=psycopg.conninfo.make_conninfo(database_url, application_name=name), schema=db_schema
    )
    task = _actor(broker)

    async def main() -> list[str]:
        first = await send_async(task, 1)
        killed = db.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
        assert killed is not None and killed[0] >= 1  # the async pool's idle connection, and the sync one
        second = await send_async(task, 2)  # its first attempt meets the dead connection
        await broker.aclose()
        return [first.message_id, second.message_id]

    try:
        sent = asyncio.run(main())
    finally:
        broker.close()
    assert _ids(db, broker) == sorted(sent)
