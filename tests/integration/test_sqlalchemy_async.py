"""``async with bind(session)`` on SQLAlchemy's ``AsyncSession``: its psycopg ``AsyncConnection`` is bound.

The async send (``send_async``) writes on the bound async connection; these tests check the
binding itself with plain psycopg statements on it: they commit and roll back with the session,
savepoints included, and a plain ``send()`` inside the async binding is refused.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker, create_async_engine
from test_sqlalchemy import Base, Order, orders, row_broker_of, sa_url

from dramatiq_reliable import ConfigurationError, NotBound, PostgresBroker, bind, send_async
from dramatiq_reliable.binding import bound_async_connection, bound_connection, check_joinable
from dramatiq_reliable.sqlalchemy import bind_sessions

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(database_url: str, db_schema: str) -> str:
    engine = sa.create_engine(sa_url(database_url)).execution_options(schema_translate_map={None: db_schema})
    Base.metadata.create_all(engine)
    engine.dispose()
    return db_schema


def run(database_url: str, schema: str, body: Any) -> Any:
    """Run ``body(maker)`` on an event loop with an async engine on the test's schema."""

    async def main() -> Any:
        # The schema per statement, not search_path: a connection's setting does not follow it through a pooler.
        engine = create_async_engine(sa_url(database_url)).execution_options(schema_translate_map={None: schema})
        try:
            return await body(async_sessionmaker(engine))
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def insert(conn: psycopg.AsyncConnection[Any], order_id: int, schema: str) -> None:
    """What an async send does on the bound connection: one statement, no commit."""
    orders_table = psycopg.sql.Identifier(schema, "orders")
    await conn.execute(psycopg.sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders_table), (order_id,))


def test_an_async_session_binds_its_psycopg_async_connection_and_commits_with_it(database_url, tables, db):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session:
            async with bind(session) as conn:
                assert bound_async_connection() is conn
                assert bound_connection() is None
                raw = await (await session.connection()).get_raw_connection()
                assert conn is raw.driver_connection
                await insert(conn, 1, tables)
            assert bound_async_connection() is None
            await session.commit()
            async with bind(session) as conn:
                await insert(conn, 2, tables)
            await session.rollback()

    run(database_url, tables, body)
    assert orders(db, tables) == [1]


def test_an_async_session_closed_without_commit_keeps_nothing(database_url, tables, db):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        session = maker()
        async with bind(session) as conn:
            await insert(conn, 1, tables)
        await session.close()

    run(database_url, tables, body)
    assert orders(db, tables) == []


def test_an_async_savepoint_rolled_back_removes_only_what_was_written_inside_it(database_url, tables, db):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session, bind(session) as conn:
            await insert(conn, 1, tables)
            nested = await session.begin_nested()
            await insert(conn, 2, tables)
            await nested.rollback()
            async with session.begin_nested():
                await insert(conn, 3, tables)
            await session.commit()

    run(database_url, tables, body)
    assert orders(db, tables) == [1, 3]


def test_an_async_connection_and_an_async_scoped_session_bind_too(database_url, tables, db):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        engine = maker.kw["bind"]
        async with engine.connect() as connection, connection.begin(), bind(connection) as conn:
            await insert(conn, 1, tables)
        scoped = async_scoped_session(maker, scopefunc=asyncio.current_task)
        async with bind(scoped) as conn:
            await insert(conn, 2, tables)
        await scoped.commit()
        await scoped.remove()

    run(database_url, tables, body)
    assert orders(db, tables) == [1, 2]


def test_a_plain_send_inside_an_async_binding_is_refused(database_url, tables, db):
    broker = PostgresBroker(database=database_url, schema=tables)

    @dramatiq.actor(broker=broker, queue_name=f"q{uuid.uuid4().hex[:8]}")
    def send_receipt(order_id: int) -> None:
        pass

    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session, bind(session):
            with pytest.raises(NotBound, match="send_async"):
                send_receipt.send(1)

    try:
        run(database_url, tables, body)
    finally:
        broker.close()
    assert db.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {}.queue").format(psycopg.sql.Identifier(tables))
    ).fetchone() == (0,)


def test_binding_an_async_session_in_a_failed_transaction_is_refused(database_url, tables):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session:
            session.add(Order(id=1))
            await session.flush()
            session.add(Order(id=1))
            with pytest.raises(sa.exc.IntegrityError):
                await session.flush()
            with pytest.raises(ConfigurationError, match=r"transaction failed .*await session\.rollback\(\)"):
                await bind(session).__aenter__()
            assert bound_async_connection() is None

    run(database_url, tables, body)


def test_a_sync_bind_of_an_async_session_names_async_with(database_url, tables):
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session:
            with pytest.raises(ConfigurationError, match="async with bind"):
                bind(session).__enter__()
            with pytest.raises(ConfigurationError, match="async sessions are not auto-bound"):
                bind_sessions(maker)

    run(database_url, tables, body)


def test_an_async_session_on_psycopg2_is_refused(database_url, tables):
    # psycopg2 has no asyncio dialect: the refusal is the same check as for a sync session's engine
    engine = sa.create_engine(sa_url(database_url, "psycopg2"))
    try:

        async def body() -> None:
            session = AsyncSession(sync_session_class=sa.orm.Session)
            session.sync_session.bind = engine
            with pytest.raises(ConfigurationError, match="'psycopg2' driver"):
                await bind(session).__aenter__()

        asyncio.run(body())
    finally:
        engine.dispose()


def test_an_async_binding_outlived_by_its_session_transaction_is_not_joined(database_url, tables, db):
    # What send_async asks before it writes on the bound connection.
    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session, bind(session) as conn:
            check_joinable(conn, None, actor_name="send_receipt")
            await session.commit()  # the connection goes back to the engine's pool
            with pytest.raises(NotBound, match="session's transaction ended"):
                check_joinable(conn, None, actor_name="send_receipt")
        async with maker.kw["bind"].connect() as connection, bind(connection) as conn:
            await connection.close()
            with pytest.raises(NotBound, match="SQLAlchemy Connection that was closed"):
                check_joinable(conn, None, actor_name="send_receipt")

    run(database_url, tables, body)


@pytest.fixture(params=["outbox", "queue"])
def row_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, tables: str) -> Iterator[Any]:
    broker = row_broker_of(request.param, database_url, rabbitmq_url, tables)
    yield broker
    broker.close()


def test_send_async_inside_an_async_session_commits_and_rolls_back_with_it(database_url, tables, row_broker, db):
    @dramatiq.actor(broker=row_broker, queue_name=f"q{uuid.uuid4().hex[:8]}")
    def send_receipt(order_id: int) -> None:
        pass

    async def body(maker: async_sessionmaker[AsyncSession]) -> None:
        async with maker() as session, bind(session):
            session.add(Order(id=1))
            await send_async(send_receipt, 1)
            await session.commit()
            with pytest.raises(NotBound, match="session's transaction ended"):
                await send_async(send_receipt, 9)  # after the commit: its connection is back in the pool
        async with maker() as session, bind(session):
            session.add(Order(id=2))
            await send_async(send_receipt, 2)
            nested = await session.begin_nested()
            await send_async(send_receipt, 3)
            await nested.rollback()
            await session.rollback()
        async with maker() as session, bind(session):
            await send_async(send_receipt, 4)
            async with session.begin_nested():
                await send_async(send_receipt, 5)
            nested = await session.begin_nested()
            await send_async(send_receipt, 6)
            await nested.rollback()
            await session.commit()

    run(database_url, tables, body)
    query = psycopg.sql.SQL("SELECT body FROM {} ORDER BY id").format(psycopg.sql.Identifier(tables, row_broker.table))
    sent = [dramatiq.Message.decode(bytes(body)).args[0] for (body,) in db.execute(query).fetchall()]
    assert sent == [1, 4, 5]
    assert orders(db, tables) == [1]


@pytest.fixture(autouse=True)
def _no_binding_left() -> Iterator[None]:
    yield
    assert bound_async_connection() is None
