"""A FastAPI app whose order and its confirmation message commit together, on SQLAlchemy's AsyncSession.

``POST /orders`` inserts the order with the ORM and sends ``confirm_order`` inside the session's
own transaction: ``async with bind(session)`` makes ``await send_async(...)`` write the message
row on the session's connection, so an order that rolls back leaves no message and one that
commits has exactly one.  The actor is async (Dramatiq's ``AsyncIO`` middleware) and writes its
effect on the job's connection (``job_connection_async``), committed with its Idempotency key.

The lifespan opens the pools at startup and closes them at shutdown, on the app's own event loop:
the engine's and the broker's async pool (``await broker.aclose()``).

Run it (a migrated database, see ``dramatiq-reliable migrate``)::

    DATABASE_URL=postgresql://app@localhost/app python examples/fastapi_app
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import dramatiq
from dramatiq.middleware import AsyncIO
from fastapi import FastAPI, HTTPException
from psycopg import sql
from pydantic import BaseModel
from sqlalchemy import Column, ForeignKey, Integer, MetaData, Table, Text, insert
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from dramatiq_reliable import (
    Idempotency,
    OutboxBroker,
    PostgresBroker,
    WorkerRelay,
    bind,
    build_middleware,
    job_connection_async,
    send_async,
)

metadata = MetaData()
orders = Table("orders", metadata, Column("id", Integer, primary_key=True), Column("item", Text, nullable=False))
confirmations = Table(
    "order_confirmations", metadata, Column("order_id", Integer, ForeignKey("orders.id"), primary_key=True)
)


class OrderIn(BaseModel):
    item: str
    #: the demo's way to make the request fail after the send: the order and its message roll back
    refuse: bool = False


@dataclass
class Shop:
    app: FastAPI
    broker: OutboxBroker | PostgresBroker
    engine: AsyncEngine
    confirm_order: dramatiq.Actor[Any, Any]


def sqlalchemy_url(database_url: str) -> str:
    """The same database for SQLAlchemy, on the psycopg 3 driver (the one ``bind()`` accepts)."""
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1).replace(
        "postgres://", "postgresql+psycopg://", 1
    )


def build(
    database_url: str, *, rabbitmq_url: str | None = None, schema: str = "dramatiq_reliable", queue_name: str = "orders"
) -> Shop:
    """The app, its broker and its actor; an ``OutboxBroker`` with RabbitMQ, else a ``PostgresBroker``."""
    middleware = build_middleware(middleware=[Idempotency(), AsyncIO()])
    broker: OutboxBroker | PostgresBroker
    if rabbitmq_url:
        broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=schema, middleware=middleware)
        broker.add_middleware(WorkerRelay())  # the worker publishes committed rows itself
    else:
        broker = PostgresBroker(database=database_url, schema=schema, middleware=middleware)
    # The app's tables live next to the broker's, in its schema.
    engine = create_async_engine(
        sqlalchemy_url(database_url), execution_options={"schema_translate_map": {None: schema}}
    )
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    confirm = sql.SQL("INSERT INTO {} (order_id) VALUES (%s)").format(sql.Identifier(schema, confirmations.name))

    @dramatiq.actor(
        broker=broker,
        queue_name=queue_name,
        actor_name=f"{queue_name}_confirm",
        max_retries=3,
        min_backoff=10,
        max_backoff=100,
    )
    async def confirm_order(order_id: int) -> None:
        conn = job_connection_async()  # the job's transaction: committed with its Idempotency key
        await conn.execute(confirm, (order_id,))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)  # the example's own tables, if missing
        await broker.database.async_pool()  # open the broker's async pool on this loop now
        try:
            yield
        finally:
            await broker.aclose()
            await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def create_order(order: OrderIn) -> dict[str, int]:
        async with sessions() as session, session.begin():
            order_id = (
                await session.execute(insert(orders).values(item=order.item).returning(orders.c.id))
            ).scalar_one()
            async with bind(session):
                await send_async(confirm_order, order_id)
            if order.refuse:
                # Raising inside session.begin() rolls back the order and its message together.
                raise HTTPException(status_code=409, detail=f"order for {order.item!r} refused")
        return {"id": order_id}

    return Shop(app=app, broker=broker, engine=engine, confirm_order=confirm_order)
