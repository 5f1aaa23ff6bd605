"""'dramatiq-reliable migrate --sql' prints a script that is safe to run twice."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import schema

pytestmark = pytest.mark.integration


def _snapshot(conn: psycopg.Connection[Any], name: str) -> dict[str, Any]:
    """Everything a migration can create in schema ``name``, and the versions it recorded."""
    objects = conn.execute(
        "SELECT c.relname, c.relkind, pg_get_indexdef(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s ORDER BY 1",
        (name,),
    ).fetchall()
    functions = conn.execute(
        "SELECT p.proname, md5(p.prosrc) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = %s ORDER BY 1",
        (name,),
    ).fetchall()
    recorded = conn.execute(
        sql.SQL("SELECT version, name, applied_at FROM {}.migrations ORDER BY version").format(sql.Identifier(name))
    ).fetchall()
    return {"objects": objects, "functions": functions, "recorded": recorded}


def test_the_printed_sql_run_twice_changes_nothing_the_second_time(database_url, unmigrated_schema):
    script = schema.migration_sql(schema=unmigrated_schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(script)
        first = _snapshot(conn, unmigrated_schema)
        conn.execute(script)
        second = _snapshot(conn, unmigrated_schema)
        assert schema.current_version(conn, schema=unmigrated_schema) == schema.LATEST_VERSION
    assert [row[0] for row in first["recorded"]] == [m.version for m in schema.migrations()]
    assert second == first


def test_the_printed_sql_on_a_schema_the_command_migrated_is_a_no_op(database_url, unmigrated_schema):
    schema.migrate(database_url, schema=unmigrated_schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        before = _snapshot(conn, unmigrated_schema)
        conn.execute(schema.migration_sql(schema=unmigrated_schema))
        assert _snapshot(conn, unmigrated_schema) == before


def test_the_printed_sql_applies_only_what_a_half_migrated_schema_lacks(database_url, unmigrated_schema):
    first_two = schema.migration_sql(schema=unmigrated_schema).split("\n\n-- 0003_")[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(first_two)
        assert schema.current_version(conn, schema=unmigrated_schema) == 2
        conn.execute(schema.migration_sql(schema=unmigrated_schema))
        assert schema.current_version(conn, schema=unmigrated_schema) == schema.LATEST_VERSION
    assert schema.migrate(database_url, schema=unmigrated_schema) == []


def test_psql_runs_the_printed_sql_twice_without_an_error(database_url, unmigrated_schema, tmp_path):
    if shutil.which("psql") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("the psql client is not installed; install postgresql-client")
        pytest.skip("needs the psql client")
    path = tmp_path / "migrate.sql"
    path.write_text(schema.migration_sql(schema=unmigrated_schema))
    for _run in range(2):
        done = subprocess.run(
            ["psql", database_url, "-v", "ON_ERROR_STOP=1", "-q", "-f", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert schema.current_version(conn, schema=unmigrated_schema) == schema.LATEST_VERSION
