"""The shop: ``POST /orders`` writes an order, takes its stock and sends ``send_receipt``, in one session transaction.

There is no ``bind()`` in the view: ``bind_sessions(Session)`` makes a send inside a session
transaction join it, so the message commits with the order and the stock, or not at all.  An
order larger than the stock fails the stock's ``CHECK`` *after* the send: the transaction rolls
back, and so does the message (a ``409``, and no receipt ever).

The receipt is the effect: one row per order.  Delivery is at least once, so the actor writes
it with ``ON CONFLICT DO NOTHING`` on the order's id; a second delivery changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dramatiq
import sqlalchemy as sa
from flask import Flask, jsonify, request
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, scoped_session, sessionmaker

from dramatiq_reliable import PostgresBroker, migrate
from dramatiq_reliable.sqlalchemy import bind_sessions


class Base(DeclarativeBase):
    pass


class Stock(Base):
    __tablename__ = "stock"
    __table_args__ = (sa.CheckConstraint("left_count >= 0", name="stock_not_negative"),)
    item: Mapped[str] = mapped_column(primary_key=True)
    left_count: Mapped[int]


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(sa.ForeignKey("stock.item"))
    quantity: Mapped[int]


class Receipt(Base):
    __tablename__ = "receipts"
    order_id: Mapped[int] = mapped_column(sa.ForeignKey("orders.id"), primary_key=True)


@dataclass
class Shop:
    """What the app is made of; ``close()`` releases the pools and undoes the auto-binding."""

    app: Flask
    broker: PostgresBroker
    engine: sa.Engine
    Session: scoped_session[Any]
    send_receipt: dramatiq.Actor[Any, Any]
    unbind: Callable[[], None]

    def close(self) -> None:
        self.unbind()
        self.Session.remove()
        self.broker.close()
        self.engine.dispose()


def sqlalchemy_url(database_url: str) -> str:
    """``postgresql://...`` as SQLAlchemy's psycopg 3 URL (the driver dramatiq-reliable can join)."""
    return "postgresql+psycopg://" + database_url.split("://", 1)[1]


def create_shop(database_url: str, *, schema: str = "shop", stock: dict[str, int] | None = None) -> Shop:
    """Build the app on ``schema`` (our tables and the shop's, created if missing), with its stock."""
    migrate(database_url, schema=schema)
    # The shop's tables live in ``schema``, named in every statement (schema_translate_map): a
    # search_path in libpq options would be refused or dropped by PgBouncer in front of Postgres.
    engine = sa.create_engine(sqlalchemy_url(database_url)).execution_options(schema_translate_map={None: schema})
    Base.metadata.create_all(engine)
    # on_unbound="error": a send outside a session transaction is a bug here, not an autocommit.
    broker = PostgresBroker(database=database_url, schema=schema, on_unbound="error")
    Session = scoped_session(sessionmaker(engine))
    unbind = bind_sessions(Session)
    session = Session()
    with session.begin():
        for item, count in (stock or {}).items():
            session.execute(insert(Stock).values(item=item, left_count=count).on_conflict_do_nothing())
    Session.remove()

    @dramatiq.actor(broker=broker, queue_name=f"{schema}_receipts", max_retries=3)
    def send_receipt(order_id: int) -> None:
        session = Session()  # the worker thread's session
        with session.begin():
            session.execute(insert(Receipt).values(order_id=order_id).on_conflict_do_nothing())
        Session.remove()

    app = Flask(__name__)

    @app.post("/orders")
    def place_order() -> Any:
        body = request.get_json(force=True)
        item, quantity = body.get("item"), body.get("quantity")
        if not isinstance(item, str) or not isinstance(quantity, int) or quantity < 1:
            return jsonify(error="send {'item': str, 'quantity': int >= 1}"), 400
        session = Session()  # the request's session (removed at teardown)
        try:
            with session.begin():
                order = Order(item=item, quantity=quantity)
                session.add(order)
                session.flush()  # the order's id, for the message
                send_receipt.send(order.id)  # joins this transaction: no bind()
                session.execute(
                    sa.update(Stock).where(Stock.item == item).values(left_count=Stock.left_count - quantity)
                )
        except sa.exc.IntegrityError:
            return jsonify(error=f"not enough {item!r} left, or no such item"), 409
        return jsonify(order_id=order.id), 201

    @app.teardown_appcontext
    def end_session(error: BaseException | None) -> None:
        Session.remove()  # the request's session: closed, its transaction (if any) rolled back

    return Shop(app, broker, engine, Session, send_receipt, unbind)
