"""The pytest plugin (entry point ``pytest11``): fixtures for testing your own actors.

Installed with the package and loaded by pytest on its own (``-p no:dramatiq_reliable`` turns it
off).  Loading it imports the package, which its dotted path requires, and registers an option
and the fixtures; each fixture imports what it needs when a test asks for it.  Every fixture
name starts with ``reliable_`` so it cannot shadow a fixture of the project under test.

* ``reliable_broker``: an :class:`~dramatiq_reliable.testing.InMemoryBroker` as Dramatiq's global
  broker for the test: yours, emptied, if the global broker already is one; else a new one with
  ``Idempotency`` (record mode) and ``DeadLetters`` on the in-memory stores
  ``reliable_idempotency_store`` and ``reliable_dead_letter_store``.  No service.
* ``reliable_database_url``: ``--reliable-database-url``, else the ``reliable_database_url`` ini
  option, else ``DATABASE_URL``; the test fails naming all three when none is set.
* ``reliable_schema``: a schema of the test's own on that database, migrated, dropped after the
  test even when it failed.
* ``reliable_postgres_broker``: the in-memory broker with its transactions, ``Idempotency``
  (transactional) and ``DeadLetters`` on ``reliable_schema``, which is first on the connections'
  ``search_path``: ``job_connection()`` works, and tables the test creates are dropped with it.

See docs/testing-your-actors.md.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .broker import InMemoryBroker
    from .dead_letters import InMemoryDeadLetterStore
    from .idempotency import InMemoryIdempotencyStore

__all__ = [
    "reliable_broker",
    "reliable_database_url",
    "reliable_dead_letter_store",
    "reliable_idempotency_store",
    "reliable_postgres_broker",
    "reliable_schema",
]

_OPTION = "reliable_database_url"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dramatiq-reliable")
    group.addoption(
        "--reliable-database-url",
        dest=_OPTION,
        default=None,
        metavar="URL",
        help="the Postgres the reliable_schema fixture makes its schemas in (default: the ini option, then DATABASE_URL)",
    )
    parser.addini(_OPTION, "the Postgres the reliable_schema fixture makes its schemas in (default: DATABASE_URL)")


@pytest.fixture(scope="session")
def reliable_database_url(pytestconfig: pytest.Config) -> str:
    """The Postgres URL the schema fixtures use (see the module docstring for where it comes from)."""
    url = pytestconfig.getoption(_OPTION) or pytestconfig.getini(_OPTION) or os.environ.get("DATABASE_URL")
    if not url:
        pytest.fail(
            "the dramatiq-reliable fixtures need a Postgres to make a schema in and none was given; pass "
            "--reliable-database-url=postgresql://..., set reliable_database_url in the pytest ini file, or set "
            "DATABASE_URL (reliable_broker needs none)",
            pytrace=False,
        )
    return str(url)


@pytest.fixture
def reliable_schema(reliable_database_url: str) -> Iterator[str]:
    """A freshly migrated schema of the test's own, dropped after the test (even when it failed)."""
    import psycopg
    from psycopg import sql

    from .. import schema

    name = f"test_{uuid.uuid4().hex[:12]}"
    try:
        schema.migrate(reliable_database_url, schema=name)
        yield name
    finally:
        with psycopg.connect(reliable_database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def reliable_idempotency_store() -> InMemoryIdempotencyStore:
    """The keys ``reliable_broker``'s Idempotency recorded (``.keys()``)."""
    from .idempotency import InMemoryIdempotencyStore

    return InMemoryIdempotencyStore()


@pytest.fixture
def reliable_dead_letter_store() -> InMemoryDeadLetterStore:
    """The dead letters ``reliable_broker`` captured (``.list()``)."""
    from .dead_letters import InMemoryDeadLetterStore

    return InMemoryDeadLetterStore()


@pytest.fixture
def reliable_broker(request: pytest.FixtureRequest) -> Iterator[InMemoryBroker]:
    """The in-memory broker of the test, Dramatiq's global broker; no service needed.

    When the global broker already is an :class:`InMemoryBroker` (your conftest set it before
    importing the actors), it is that one, emptied before and after the test.  Else a new one
    with the middleware of :func:`~dramatiq_reliable.build_middleware`: ``DeadLetters`` and
    ``Idempotency`` on the in-memory stores ``reliable_dead_letter_store`` and
    ``reliable_idempotency_store``, Dramatiq's defaults, ``ClassifiedRetries`` last.
    """
    import dramatiq.broker

    from ..dead_letters import DeadLetters
    from ..idempotency import Idempotency
    from ..retries import build_middleware
    from .broker import InMemoryBroker

    current = dramatiq.broker.global_broker
    if isinstance(current, InMemoryBroker):
        current.reset()
        yield current
        current.reset()
        return
    stores = [
        DeadLetters(store=request.getfixturevalue("reliable_dead_letter_store")),
        Idempotency(store=request.getfixturevalue("reliable_idempotency_store")),
    ]
    broker = InMemoryBroker(middleware=build_middleware(middleware=stores))
    with _global(broker):
        yield broker


@pytest.fixture
def reliable_postgres_broker(reliable_database_url: str, reliable_schema: str) -> Iterator[InMemoryBroker]:
    """An in-memory broker whose transactions, idempotency keys and dead letters are in ``reliable_schema``."""
    import psycopg

    from ..database import Database
    from ..dead_letters import DeadLetters
    from ..idempotency import Idempotency
    from ..retries import build_middleware
    from .broker import InMemoryBroker

    # The test's schema first: the tables the test and its actors create land there, and go with it.
    options = psycopg.conninfo.conninfo_to_dict(reliable_database_url).get("options") or ""
    url = psycopg.conninfo.make_conninfo(
        reliable_database_url, options=f"{options} -c search_path={reliable_schema},public".strip()
    )
    database = Database.of(url)
    middleware = [
        DeadLetters(database=database, schema=reliable_schema),
        Idempotency(database=database, schema=reliable_schema),
    ]
    broker = InMemoryBroker(middleware=build_middleware(middleware=middleware), database=database)
    with _global(broker):
        yield broker


class _global:
    """Make ``broker`` Dramatiq's global broker; put the previous one back and close ``broker`` after."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker

    def __enter__(self) -> None:
        import dramatiq.broker

        self.previous = dramatiq.broker.global_broker
        dramatiq.set_broker(self.broker)

    def __exit__(self, *exc_info: object) -> None:
        import dramatiq.broker

        dramatiq.broker.global_broker = self.previous
        self.broker.close()
