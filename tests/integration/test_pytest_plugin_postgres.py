"""The pytest plugin's Postgres side, as a user's test suite sees it (``pytester`` runs a test file of a
user's own): the schema fixture, sends that wait for a real transaction, and ``job_connection()``
under the real Idempotency middleware.  Real Postgres (``database_url``)."""

from __future__ import annotations

import dramatiq
import psycopg
import pytest

from dramatiq_reliable import NotBound, bind
from dramatiq_reliable.testing import InMemoryBroker, assert_enqueued, assert_not_enqueued

pytest_plugins = ["pytester"]


def _schemas(conn: psycopg.Connection[object], prefix: str) -> list[str]:
    rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", (prefix + "%",)).fetchall()
    return [str(row[0]) for row in rows]


def test_the_schema_fixture_migrates_a_schema_and_drops_it_after_a_failed_test(
    pytester: pytest.Pytester, database_url: str, db: psycopg.Connection[object]
) -> None:
    seen = pytester.path / "seen.txt"
    pytester.makepyfile(
        f"""
        import pathlib

        import psycopg

        def test_fails_after_looking(reliable_schema, reliable_database_url):
            with psycopg.connect(reliable_database_url) as conn:
                tables = conn.execute(
                    "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s AND table_name = 'processed_jobs'",
                    (reliable_schema,),
                ).fetchone()[0]
            pathlib.Path({str(seen)!r}).write_text(f"{{reliable_schema}} {{tables}}")
            assert False, "the test fails; its schema must go all the same"
        """
    )
    result = pytester.runpytest(f"--reliable-database-url={database_url}")
    result.assert_outcomes(failed=1)
    name, tables = seen.read_text().split()
    assert tables == "1"  # migrated
    assert _schemas(db, name) == []  # and dropped


def test_the_ini_option_gives_the_database(
    pytester: pytest.Pytester, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    pytester.makeini(f"[pytest]\nreliable_database_url = {database_url}\n")
    pytester.makepyfile("def test_has_a_schema(reliable_schema):\n    assert reliable_schema.startswith('test_')\n")
    pytester.runpytest().assert_outcomes(passed=1)


def test_a_send_bound_to_a_real_transaction_waits_for_it(reliable_broker: InMemoryBroker, database_url: str) -> None:
    """bind(conn): the send is delivered once the transaction commits, never if it rolls back."""

    @dramatiq.actor
    def ship(order_id: int) -> None: ...

    with psycopg.connect(database_url) as conn:
        with bind(conn):
            ship.send(1)
        assert reliable_broker.drain() == 0  # still open: a relay would not see the row either
        assert [m.args for m in reliable_broker.held] == [(1,)]
        conn.rollback()
        with bind(conn):
            ship.send(2)
        conn.commit()
    assert_not_enqueued(ship, 1)
    assert_enqueued(ship, 2)
    assert reliable_broker.held == []
    assert reliable_broker.drain() == 1


def test_a_bound_autocommit_connection_is_refused_as_the_postgres_brokers_refuse_it(
    reliable_broker: InMemoryBroker, database_url: str
) -> None:
    @dramatiq.actor
    def ship(order_id: int) -> None: ...

    with psycopg.connect(database_url, autocommit=True) as conn, bind(conn):
        with pytest.raises(NotBound, match="autocommit"):
            ship.send(3)
        with conn.transaction():
            ship.send(4)
    assert_not_enqueued(ship, 3)
    assert_enqueued(ship, 4)


@pytest.mark.needs_session(
    "the plugin puts the test's schema on search_path with libpq options, which PgBouncer refuses or drops"
)
def test_job_connection_runs_under_the_real_idempotency_middleware(
    pytester: pytest.Pytester, database_url: str
) -> None:
    """An actor writing through job_connection(): its writes and its sends commit with the job, or neither does."""
    pytester.makepyfile(
        """
        import dramatiq
        import pytest
        from dramatiq_reliable import job_connection
        from dramatiq_reliable.testing import assert_enqueued, assert_not_enqueued

        def test_the_job_commits_or_rolls_back_as_one(reliable_postgres_broker, reliable_schema):
            broker = reliable_postgres_broker
            with broker.transaction() as conn:
                conn.execute("CREATE TABLE invoices (order_id int PRIMARY KEY)")  # in the test's schema

            @dramatiq.actor
            def email_invoice(order_id):
                pass

            @dramatiq.actor(idempotency_key=lambda order_id: f"invoice-{order_id}")
            def issue_invoice(order_id):
                job_connection().execute("INSERT INTO invoices VALUES (%s)", (order_id,))
                email_invoice.send(order_id)
                if order_id == 2:
                    raise RuntimeError("the printer is on fire")

            issue_invoice.send(1)
            issue_invoice.send(1)  # a duplicate: skipped, its key is committed
            assert broker.drain() == 3
            issue_invoice.send(2)
            with pytest.raises(RuntimeError, match="on fire"):
                broker.drain()
            with broker.transaction() as conn:
                assert conn.execute("SELECT order_id FROM invoices").fetchall() == [(1,)]
                keys = conn.execute("SELECT job_key FROM processed_jobs WHERE actor_name = %s", ("issue_invoice",)).fetchall()
            assert keys == [("invoice-1",)]
            assert_enqueued(email_invoice, 1)
            assert_not_enqueued(email_invoice, 2)  # sent inside the job that rolled back
        """
    )
    result = pytester.runpytest(f"--reliable-database-url={database_url}")
    result.assert_outcomes(passed=1)
