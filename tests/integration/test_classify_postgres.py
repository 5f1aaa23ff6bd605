"""classify() on real Postgres errors: each SQLSTATE a real statement raises maps to the right decision.

Moved out of tests/unit (which runs with no services): every error here comes from real SQL
against the configured Postgres, in a schema of the test's own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable.classify import DB_CONFLICT_BACKOFF_MS, classify, sqlstate_of

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Pg:
    url: str
    schema: str


def caught(action: Callable[[], object]) -> BaseException:
    try:
        action()
    except BaseException as error:
        return error
    raise AssertionError(f"{action!r} did not raise")


@contextlib.contextmanager
def scratch_table(pg: Pg) -> Iterator[sql.Identifier]:
    """Two rows in a table of the test's schema, for the lock and snapshot conflicts."""
    table = sql.Identifier(pg.schema, "scratch")
    with psycopg.connect(pg.url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v int NOT NULL)").format(table))
        admin.execute(sql.SQL("INSERT INTO {} VALUES (1, 0), (2, 0)").format(table))
    try:
        yield table
    finally:
        with psycopg.connect(pg.url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


def pg_sql(statement: str) -> Callable[[Pg], BaseException]:
    def make(pg: Pg) -> BaseException:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            return caught(lambda: conn.execute(statement))

    return make


def pg_unique_violation(pg: Pg) -> BaseException:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE t (id int PRIMARY KEY)")
        conn.execute("INSERT INTO t VALUES (1)")
        return caught(lambda: conn.execute("INSERT INTO t VALUES (1)"))


def pg_not_null_violation(pg: Pg) -> BaseException:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE t (id int NOT NULL)")
        return caught(lambda: conn.execute("INSERT INTO t VALUES (NULL)"))


def pg_statement_timeout(pg: Pg) -> BaseException:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("SET statement_timeout = 1")
        return caught(lambda: conn.execute("SELECT pg_sleep(5)"))


def pg_serialization_failure(pg: Pg) -> BaseException:
    with scratch_table(pg) as table:
        with psycopg.connect(pg.url) as first:
            first.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            first.execute(sql.SQL("SELECT v FROM {} WHERE id = 1").format(table))  # takes the snapshot
            with psycopg.connect(pg.url, autocommit=True) as second:
                second.execute(sql.SQL("UPDATE {} SET v = v + 1 WHERE id = 1").format(table))
            error = caught(lambda: first.execute(sql.SQL("UPDATE {} SET v = v + 1 WHERE id = 1").format(table)))
            first.rollback()
        return error


def pg_lock_not_available(pg: Pg) -> BaseException:
    with scratch_table(pg) as table, psycopg.connect(pg.url) as holder, psycopg.connect(pg.url) as other:
        holder.execute(sql.SQL("SELECT * FROM {} WHERE id = 1 FOR UPDATE").format(table))
        error = caught(lambda: other.execute(sql.SQL("SELECT * FROM {} WHERE id = 1 FOR UPDATE NOWAIT").format(table)))
        other.rollback()
        holder.rollback()
        return error


def pg_deadlock(pg: Pg) -> BaseException:
    """Two transactions lock rows 1 and 2 in opposite orders; Postgres aborts one of them."""
    with scratch_table(pg) as table:
        first = psycopg.connect(pg.url)
        second = psycopg.connect(pg.url)
        errors: list[BaseException] = []
        try:
            for conn in (first, second):
                conn.execute("SET deadlock_timeout = '20ms'")
            first.execute(sql.SQL("UPDATE {} SET v = 1 WHERE id = 1").format(table))
            second.execute(sql.SQL("UPDATE {} SET v = 1 WHERE id = 2").format(table))

            def first_takes_row_2() -> None:
                try:
                    first.execute(sql.SQL("UPDATE {} SET v = 2 WHERE id = 2").format(table))
                except psycopg.Error as error:
                    errors.append(error)

            thread = threading.Thread(target=first_takes_row_2)
            thread.start()
            # Polls until the first transaction waits on the second's lock (not a sleep as a guess).
            with psycopg.connect(pg.url, autocommit=True) as observer:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    row = observer.execute(
                        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                        (first.info.backend_pid,),
                    ).fetchone()
                    if row is not None and row[0] == "Lock":
                        break
                    time.sleep(0.005)
            try:
                second.execute(sql.SQL("UPDATE {} SET v = 2 WHERE id = 1").format(table))
            except psycopg.Error as error:
                errors.append(error)
            thread.join(10)
        finally:
            first.close()
            second.close()
    assert len(errors) == 1, errors
    return errors[0]


class OperationalError(Exception):
    """A wrapper named like SQLAlchemy's (the driver error kept as ``.orig``)."""

    def __init__(self, orig: BaseException) -> None:
        super().__init__(str(orig))
        self.orig = orig


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Pg], BaseException]
    retry: bool = True
    category: str = "transient"
    reason: str = ""
    matched_type: str | None = None


CASES = [
    Case("pg_division_by_zero", pg_sql("SELECT 1/0"), retry=False, category="permanent", reason="data_error"),
    Case("pg_invalid_text", pg_sql("SELECT 'abc'::int"), retry=False, category="permanent", reason="data_error"),
    Case("pg_unique_violation", pg_unique_violation, retry=False, category="permanent", reason="integrity_error"),
    Case("pg_not_null_violation", pg_not_null_violation, retry=False, category="permanent", reason="integrity_error"),
    Case("pg_syntax_error", pg_sql("SELEC 1"), retry=False, category="permanent", reason="programming_error"),
    Case(
        "pg_undefined_table",
        pg_sql("SELECT * FROM no_such_table_here"),
        retry=False,
        category="permanent",
        reason="programming_error",
    ),
    Case("pg_deadlock", pg_deadlock, reason="deadlock"),
    Case("pg_serialization_failure", pg_serialization_failure, reason="serialization_failure"),
    Case("pg_lock_not_available", pg_lock_not_available, reason="lock_not_available"),
    Case("pg_statement_timeout", pg_statement_timeout, reason="timeout"),
    Case(
        "sqlalchemy_style_wrapper_of_deadlock",
        lambda pg: OperationalError(pg_deadlock(pg)),
        reason="deadlock",
        matched_type="psycopg.errors.DeadlockDetected",
    ),
]


@pytest.fixture
def pg(direct_database_url: str, unmigrated_schema: str) -> Pg:
    # Directly on Postgres: the errors are made with session state (a TEMP table, SET
    # statement_timeout) that behind a transaction pooler would stay on a shared server process.
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(unmigrated_schema)))
    return Pg(direct_database_url, unmigrated_schema)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_real_postgres_errors_are_classified_by_the_table(case: Case, pg: Pg) -> None:
    """Each real Postgres error gets the documented retry flag, category and reason."""
    exception = case.make(pg)
    decision = classify(exception)
    assert (decision.retry, decision.category, decision.reason) == (case.retry, case.category, case.reason), (
        f"{type(exception)!r}: {exception!r}"
    )
    if case.matched_type is not None:
        assert decision.matched_type == case.matched_type
    assert decision.error_type is not None
    assert decision.error_type.endswith(type(exception).__qualname__)


def test_deadlocks_start_from_a_short_backoff(pg: Pg) -> None:
    """A deadlock asks for a backoff of a few hundred ms, not the actor's 15 s, and keeps its SQLSTATE."""
    deadlock = pg_deadlock(pg)
    assert sqlstate_of(deadlock) == "40P01"
    assert classify(deadlock).min_backoff_ms == DB_CONFLICT_BACKOFF_MS
