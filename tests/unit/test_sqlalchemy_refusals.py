"""SQLAlchemy refusals that need no server: the engine's driver and binds are read, nothing connects.

A refused ``bind()`` leaves the session as it was (no transaction begun) and binds nothing.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from dramatiq_reliable import ConfigurationError, bind
from dramatiq_reliable.binding import bound_connection
from dramatiq_reliable.sqlalchemy import bind_sessions

# Port 1: nothing answers there, so a test that connected by mistake fails loudly.
PSYCOPG = "postgresql+psycopg://app@127.0.0.1:1/app"
PSYCOPG2 = "postgresql+psycopg2://app@127.0.0.1:1/app"


@pytest.mark.parametrize("kind", ["session", "scoped_session", "sessionmaker"])
def test_a_psycopg2_engine_is_refused_with_the_url_to_use(kind):
    engine = sa.create_engine(PSYCOPG2)
    maker = sessionmaker(engine)
    target = {"session": maker, "scoped_session": scoped_session(maker), "sessionmaker": maker}[kind]
    with pytest.raises(ConfigurationError, match=r"'psycopg2' driver; .*'postgresql\+psycopg://' URL"):
        if kind == "sessionmaker":
            bind_sessions(target)
        else:
            session = target()
            bind(session).__enter__()
    assert bound_connection() is None


def test_a_refused_session_has_no_transaction_begun():
    with Session(sa.create_engine(PSYCOPG2)) as session:
        with pytest.raises(ConfigurationError):
            bind(session).__enter__()
        assert not session.in_transaction()


def test_a_session_bound_to_several_engines_is_refused_before_it_connects():
    one, two = sa.create_engine(PSYCOPG), sa.create_engine(PSYCOPG.replace("/app", "/other"))
    with Session(binds={sa.table("a"): one, sa.table("b"): two}) as session:
        with pytest.raises(ConfigurationError, match=r"bound to 2 engines, .*bind_arguments=\{'bind': engine\}"):
            bind(session).__enter__()
        assert not session.in_transaction()


def test_a_session_with_no_engine_is_refused_with_the_fix():
    with Session() as session, pytest.raises(ConfigurationError, match="with no engine; create it with bind=engine"):
        bind(session).__enter__()


def test_bind_refuses_an_async_session_outside_async_with():
    session = AsyncSession(create_async_engine(PSYCOPG))
    with pytest.raises(ConfigurationError, match="use 'async with bind"):
        bind(session).__enter__()


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(lambda: async_sessionmaker(create_async_engine(PSYCOPG)), id="async_sessionmaker"),
        pytest.param(lambda: AsyncSession(create_async_engine(PSYCOPG)), id="AsyncSession"),
    ],
)
def test_bind_sessions_refuses_async_sessions_and_names_async_with(target):
    with pytest.raises(ConfigurationError, match=r"async sessions are not auto-bound.*async with bind\(session\)"):
        bind_sessions(target())


@pytest.mark.parametrize("target", [object(), "Session", sa.create_engine(PSYCOPG)], ids=["object", "str", "engine"])
def test_bind_sessions_refuses_what_is_not_a_session_factory(target):
    with pytest.raises(ConfigurationError, match="pass the sessionmaker your app creates sessions with"):
        bind_sessions(target)
