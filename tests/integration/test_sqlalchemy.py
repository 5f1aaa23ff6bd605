"""SQLAlchemy sessions as the send's transaction: the row commits or rolls back with the session.

Real sessions on the real Postgres (psycopg 3 driver), with both row brokers: ``bind(session)``,
``bind(connection)``, a ``scoped_session``, and ``bind_sessions()`` (no bind at all), savepoints
included; and the refusals (psycopg2, a failed transaction, several engines) before any write.
"""

from __future__ import annotations

import gc
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker

from dramatiq_reliable import ConfigurationError, NotBound, OutboxBroker, PostgresBroker, bind
from dramatiq_reliable.binding import bound_connection
from dramatiq_reliable.sqlalchemy import bind_sessions

pytestmark = pytest.mark.integration


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)


def sa_url(database_url: str, driver: str = "psycopg") -> str:
    """``DATABASE_URL`` with SQLAlchemy's driver named in its scheme."""
    return f"postgresql+{driver}://" + database_url.split("://", 1)[1]


def row_broker_of(kind: str, database_url: str, rabbitmq_url: str, schema: str) -> Any:
    """A broker whose sends are rows, refusing a send outside a transaction (so a missed join shows)."""
    if kind == "outbox":
        return OutboxBroker(url=rabbitmq_url, database=database_url, schema=schema, on_unbound="error")
    return PostgresBroker(database=database_url, schema=schema, on_unbound="error")


@pytest.fixture(params=["outbox", "queue"])
def row_broker(request: pytest.FixtureRequest, database_url: str, rabbitmq_url: str, db_schema: str) -> Iterator[Any]:
    broker = row_broker_of(request.param, database_url, rabbitmq_url, db_schema)
    yield broker
    broker.close()


@pytest.fixture
def engine(database_url: str, db_schema: str) -> Iterator[sa.Engine]:
    """An engine whose tables live in the test's schema (the orders table lives there).

    Mapped there per statement (``schema_translate_map``), not with ``search_path``: a setting of
    the connection does not follow it through a transaction pooler."""
    engine = sa.create_engine(sa_url(database_url), pool_size=2).execution_options(
        schema_translate_map={None: db_schema}
    )
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def maker(engine: sa.Engine) -> sessionmaker[Session]:
    return sessionmaker(engine)


@pytest.fixture
def actor(row_broker: Any) -> dramatiq.Actor[Any, Any]:
    @dramatiq.actor(broker=row_broker, queue_name=f"q{uuid.uuid4().hex[:8]}")
    def send_receipt(order_id: int) -> None:
        pass

    return send_receipt


@pytest.fixture
def auto(maker: sessionmaker[Session]) -> Iterator[sessionmaker[Session]]:
    """``maker`` with bind_sessions() on, undone after the test even when it failed."""
    undo = bind_sessions(maker)
    yield maker
    undo()


def rows(db: psycopg.Connection[Any], schema: str, broker: Any) -> list[int]:
    """The order ids of the messages stored for ``broker``, in the order they were written."""
    query = psycopg.sql.SQL("SELECT body FROM {} ORDER BY id").format(psycopg.sql.Identifier(schema, broker.table))
    return [dramatiq.Message.decode(bytes(body)).args[0] for (body,) in db.execute(query).fetchall()]


def orders(db: psycopg.Connection[Any], schema: str) -> list[int]:
    query = psycopg.sql.SQL("SELECT id FROM {} ORDER BY id").format(psycopg.sql.Identifier(schema, "orders"))
    return [order_id for (order_id,) in db.execute(query).fetchall()]


# -- bind(session), bind(connection) ----------------------------------------------------------------


def test_a_bound_session_commits_the_row_with_the_order(maker, actor, row_broker, db, db_schema):
    with maker() as session, bind(session):
        session.add(Order(id=1))
        actor.send(1)
        assert rows(db, db_schema, row_broker) == [], "visible before the session committed"
        session.commit()
    assert rows(db, db_schema, row_broker) == [1]
    assert orders(db, db_schema) == [1]


def test_a_bound_session_rolled_back_leaves_no_row(maker, actor, row_broker, db, db_schema):
    with maker() as session, bind(session):
        session.add(Order(id=1))
        session.flush()
        actor.send(1)
        session.rollback()
    assert rows(db, db_schema, row_broker) == []
    assert orders(db, db_schema) == []


def test_a_bound_session_closed_without_commit_leaves_no_row(maker, actor, row_broker, db, db_schema):
    session = maker()
    with bind(session):
        session.add(Order(id=1))
        actor.send(1)
    session.close()
    assert rows(db, db_schema, row_broker) == []


def test_a_savepoint_rolled_back_removes_the_row_sent_inside_it_and_keeps_the_one_outside(
    maker, actor, row_broker, db, db_schema
):
    with maker() as session, bind(session):
        actor.send(1)
        nested = session.begin_nested()
        actor.send(2)
        nested.rollback()
        with session.begin_nested():
            actor.send(3)
        session.commit()
    assert rows(db, db_schema, row_broker) == [1, 3]


def test_a_bound_sqlalchemy_connection_commits_with_its_transaction(engine, actor, row_broker, db, db_schema):
    with engine.connect() as connection:
        with connection.begin(), bind(connection):
            actor.send(1)
        with connection.begin() as transaction, bind(connection):
            actor.send(2)
            transaction.rollback()
    assert rows(db, db_schema, row_broker) == [1]


def test_a_scoped_session_binds_the_session_of_its_thread(maker, actor, row_broker, db, db_schema):
    scoped = scoped_session(maker)
    try:
        with bind(scoped) as conn:
            assert conn is scoped().connection().connection.driver_connection
            actor.send(1)
        scoped.rollback()
        with bind(scoped):
            actor.send(2)
        scoped.commit()
    finally:
        scoped.remove()
    assert rows(db, db_schema, row_broker) == [2]


# -- refusals -----------------------------------------------------------------------------------------


def test_binding_a_session_in_a_failed_transaction_is_refused(maker, engine):
    with maker() as session:
        session.add(Order(id=1))
        session.flush()
        session.add(Order(id=1))  # a duplicate key: the flush fails and the transaction with it
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        with pytest.raises(ConfigurationError, match=r"transaction failed .* session\.rollback\(\) first"):
            bind(session).__enter__()
    assert bound_connection() is None


def test_binding_a_session_whose_statement_failed_is_refused(maker):
    with maker() as session:
        with pytest.raises(sa.exc.DataError):
            session.execute(sa.text("SELECT 1/0::int"))
        with pytest.raises(ConfigurationError, match="transaction failed .* roll it back first"):
            bind(session).__enter__()


def test_a_session_on_psycopg2_is_refused_before_its_transaction_begins(database_url):
    engine = sa.create_engine(sa_url(database_url, "psycopg2"))
    try:
        with Session(engine) as session:
            with pytest.raises(ConfigurationError, match=r"'psycopg2' driver; .*postgresql\+psycopg://"):
                bind(session).__enter__()
            assert not session.in_transaction(), "the refusal began the session's transaction"
        with engine.connect() as connection, pytest.raises(ConfigurationError, match="'psycopg2' driver"):
            bind(connection).__enter__()
        with pytest.raises(ConfigurationError, match="'psycopg2' driver"):
            bind_sessions(sessionmaker(engine))
        with engine.connect() as connection, pytest.raises(ConfigurationError, match="psycopg2 connections"):
            bind(connection.connection.driver_connection).__enter__()
    finally:
        engine.dispose()


def test_a_session_bound_to_several_engines_is_refused_with_the_fix(engine, database_url):
    other = sa.create_engine(sa_url(database_url))
    try:
        with Session(binds={Order: engine, sa.table("other"): other}) as session:
            with pytest.raises(ConfigurationError, match=r"bound to 2 engines.*bind_arguments"):
                bind(session).__enter__()
            assert not session.in_transaction()
    finally:
        other.dispose()


def test_a_closed_sqlalchemy_connection_is_refused(engine):
    connection = engine.connect()
    connection.close()
    with pytest.raises(ConfigurationError, match="closed SQLAlchemy Connection"):
        bind(connection).__enter__()


def test_a_connection_in_autocommit_is_refused_at_send_and_writes_nothing(engine, actor, row_broker, db, db_schema):
    with (
        engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection,
        bind(connection),
        pytest.raises(NotBound, match="autocommit with no transaction open"),
    ):
        actor.send(1)
    assert rows(db, db_schema, row_broker) == []


# -- bind_sessions(): no bind() -------------------------------------------------------------------------


def test_an_auto_bound_session_commits_the_row_with_the_order(auto, actor, row_broker, db, db_schema):
    with auto.begin() as session:
        session.add(Order(id=1))
        actor.send(1)
        assert bound_connection() is None, "the session joined through a binding, not the ambient source"
    assert rows(db, db_schema, row_broker) == [1]
    assert orders(db, db_schema) == [1]


def test_an_auto_bound_session_rolled_back_leaves_no_row(auto, actor, row_broker, db, db_schema):
    with auto() as session:
        session.add(Order(id=1))
        actor.send(1)
        session.rollback()
    assert rows(db, db_schema, row_broker) == []
    assert orders(db, db_schema) == []


def test_an_auto_bound_session_closed_without_commit_leaves_no_row(auto, actor, row_broker, db, db_schema):
    session = auto()
    session.add(Order(id=1))
    actor.send(1)
    session.close()
    with pytest.raises(NotBound, match="outside a transaction"):
        actor.send(2)  # the closed session's transaction is not joined (on_unbound="error" applies)
    assert rows(db, db_schema, row_broker) == []


def test_a_session_dropped_without_close_is_never_joined_again(auto, actor, row_broker, db, db_schema):
    session = auto()
    session.execute(sa.text("SELECT 1"))
    del session  # garbage: no end event ran (collected: a session and its transaction hold each other)
    gc.collect()
    with pytest.raises(NotBound, match="outside a transaction"):
        actor.send(1)
    assert rows(db, db_schema, row_broker) == []


def test_no_send_joins_a_session_whose_transaction_ended(auto, actor, row_broker, db, db_schema):
    with auto() as session:
        session.execute(sa.text("SELECT 1"))
        session.commit()
        with pytest.raises(NotBound, match="outside a transaction"):
            actor.send(1)
        session.execute(sa.text("SELECT 1"))  # the session's next transaction is joined again
        actor.send(2)
        session.commit()
    assert rows(db, db_schema, row_broker) == [2]


def test_an_auto_bound_savepoint_rolled_back_removes_only_its_row(auto, actor, row_broker, db, db_schema):
    with auto.begin() as session:
        actor.send(1)
        with pytest.raises(RuntimeError), session.begin_nested():
            actor.send(2)
            raise RuntimeError("the inner step failed")
        actor.send(3)
    assert rows(db, db_schema, row_broker) == [1, 3]


def test_an_auto_bound_session_of_another_thread_is_not_joined(auto, actor, row_broker, db, db_schema):
    scoped = scoped_session(auto)
    opened, done = threading.Event(), threading.Event()

    def other_thread() -> None:
        scoped().execute(sa.text("SELECT 1"))  # this thread's session begins its transaction
        opened.set()
        done.wait(10)
        scoped.remove()

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert opened.wait(10)
        with pytest.raises(NotBound, match="outside a transaction"):
            actor.send(1)
    finally:
        done.set()
        thread.join()
    assert rows(db, db_schema, row_broker) == []


def test_an_auto_bound_session_in_a_failed_transaction_refuses_the_send(auto, actor, row_broker, db, db_schema):
    with auto() as session:
        session.add(Order(id=1))
        session.flush()
        session.add(Order(id=1))
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        with pytest.raises(NotBound, match=r"transaction failed .*session\.rollback\(\)"):
            actor.send(1)
    assert rows(db, db_schema, row_broker) == []


def test_an_explicit_binding_wins_over_an_auto_bound_session(auto, actor, row_broker, db, db_schema, database_url):
    with auto() as session, psycopg.connect(database_url) as conn:
        session.execute(sa.text("SELECT 1"))
        with bind(conn):
            actor.send(1)
        conn.commit()
        session.rollback()
    assert rows(db, db_schema, row_broker) == [1]


def test_undo_stops_the_auto_binding(maker, actor, row_broker, db, db_schema):
    undo = bind_sessions(maker)
    undo()
    undo()  # a second undo is a no-op
    with maker() as session:
        session.execute(sa.text("SELECT 1"))
        with pytest.raises(NotBound, match="outside a transaction"):
            actor.send(1)


def test_a_session_on_several_engines_joins_the_one_of_the_brokers_database(
    engine, actor, row_broker, db, db_schema, direct_database_url
):
    # Directly: a pooler would keep a server connection to template1, and CREATE DATABASE copies it.
    elsewhere = sa.create_engine(sa_url(direct_database_url).rsplit("/", 1)[0] + "/template1")
    with Session(binds={Order: engine, sa.table("other"): elsewhere}) as session:
        undo = bind_sessions(session)
        try:
            session.add(Order(id=1))
            actor.send(1)
            session.commit()
        finally:
            undo()
            elsewhere.dispose()
    assert rows(db, db_schema, row_broker) == [1]
    assert orders(db, db_schema) == [1]


def test_bind_sessions_refuses_what_it_cannot_serve():
    with pytest.raises(ConfigurationError, match="needs a SQLAlchemy Session class, sessionmaker"):
        bind_sessions(object())


# -- a binding outlived by its transaction -------------------------------------------------------------


def test_a_send_after_the_bound_session_committed_is_refused_and_writes_nothing(
    maker, actor, row_broker, db, db_schema
):
    with maker() as session, bind(session):
        actor.send(1)
        session.commit()  # the session's connection goes back to the pool: another session may take it
        with pytest.raises(NotBound, match=r"session's transaction ended.*bind again"):
            actor.send(2)
        with maker() as other:  # takes the pooled connection the binding pointed at
            other.execute(sa.text("SELECT 1"))
            with pytest.raises(NotBound, match="ended"):
                actor.send(3)
            other.rollback()
    assert rows(db, db_schema, row_broker) == [1]


def test_a_send_after_the_bound_connection_closed_is_refused(engine, actor, row_broker, db, db_schema):
    connection = engine.connect()
    with bind(connection):
        connection.close()
        with pytest.raises(NotBound, match="SQLAlchemy Connection .* closed"):
            actor.send(1)
    assert rows(db, db_schema, row_broker) == []


# -- in a worker ----------------------------------------------------------------------------------------


def test_a_retry_never_joins_a_session_the_failed_actor_left_open(auto, database_url, db_schema):
    # The actor leaves its session open and raises: the traceback keeps the session, and its
    # transaction, alive while Dramatiq's Retries sends the retry from an after-hook.  Joined,
    # the retry would vanish with that transaction; it must be written on its own.
    broker = PostgresBroker(database=database_url, schema=db_schema)
    runs: list[int] = []
    leaked: list[Session] = []
    done = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=f"q{uuid.uuid4().hex[:8]}", max_retries=1, min_backoff=10, max_backoff=10)
    def leaky(order_id: int) -> None:
        runs.append(order_id)
        if len(runs) == 1:
            session = auto()
            leaked.append(session)  # (closed by the test at the end, whatever happens)
            session.execute(sa.text("SELECT 1"))  # a transaction, never ended
            raise ValueError("the first run fails")
        done.set()

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    try:
        leaky.send(1)
        worker.start()
        assert done.wait(30), f"the retry never ran (runs: {runs}): it joined the failed actor's session"
    finally:
        worker.stop()
        for session in leaked:
            session.close()
        broker.close()
    assert runs == [1, 1]
