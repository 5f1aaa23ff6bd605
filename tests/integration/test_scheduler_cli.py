"""``dramatiq-reliable scheduler`` as a process: imports the user's module, syncs, fires, stops on SIGTERM, exit codes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.testing import wait_for
from tests.support import closed_port

pytestmark = pytest.mark.integration


def _app(tmp_path: Path, *, broker: str = "") -> str:
    """A module declaring one every-second schedule; its name is unique to the test."""
    name = f"sched_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from dramatiq_reliable import schedule
            {broker}
            schedule("cli-every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow")
            """
        )
    )
    return name


def _command(*args: str, database: str, schema: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dramatiq_reliable",
        "scheduler",
        *args,
        "--database-url",
        database,
        "--schema",
        schema,
    ]


def _count(db: psycopg.Connection[Any], schema_name: str, table: str) -> int:
    row = db.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {}").format(psycopg.sql.Identifier(schema_name, table))
    ).fetchone()
    return int(row[0]) if row else 0


def _run(*args: str, database: str, schema: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args, database=database, schema=schema), capture_output=True, text=True, timeout=60)


def test_the_scheduler_fires_into_the_outbox_logs_passes_and_exits_0_on_sigterm(
    tmp_path: Path, database_url: str, db_schema: str, db: Any
) -> None:
    module = _app(tmp_path)
    process = subprocess.Popen(
        _command("--path", str(tmp_path), "--poll-interval", "200ms", module, database=database_url, schema=db_schema),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _count(db, db_schema, "outbox") >= 2, timeout_ms=20_000, message="two ticks in the outbox")
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == ExitCode.OK, err
    assert "1 schedule declared" in err
    assert "ticks into the outbox" in err
    assert "fired 1 tick" in err
    assert "received SIGTERM" in err
    assert _count(db, db_schema, "queue") == 0
    assert _count(db, db_schema, "outbox") == _count(db, db_schema, "schedule_ticks")


def test_a_module_that_sets_a_postgres_broker_sends_ticks_into_the_queue(
    tmp_path: Path, database_url: str, db_schema: str, db: Any
) -> None:
    broker = (
        "import dramatiq, os; from dramatiq_reliable import PostgresBroker; "
        f"dramatiq.set_broker(PostgresBroker(database={database_url!r}, schema={db_schema!r}))"
    )
    module = _app(tmp_path, broker=broker)
    done = _run("--path", str(tmp_path), "--once", module, database=database_url, schema=db_schema)
    assert done.returncode == ExitCode.OK, done.stderr
    assert "ticks into the queue" in done.stderr
    assert done.stdout.startswith("fired ")
    # The next pass (a second process) fires the first tick once it is due.
    wait_for(
        lambda: (
            _run("--path", str(tmp_path), "--once", module, database=database_url, schema=db_schema).returncode == 0
            and _count(db, db_schema, "queue") >= 1
        ),
        timeout_ms=20_000,
        message="a tick in the queue table",
    )
    assert _count(db, db_schema, "outbox") == 0


def test_exit_codes_name_what_is_wrong(tmp_path: Path, database_url: str, unmigrated_schema: str) -> None:
    missing = _run("--path", str(tmp_path), "dr_no_such_module_here", database=database_url, schema=unmigrated_schema)
    assert missing.returncode == ExitCode.USAGE
    assert "cannot import module 'dr_no_such_module_here'" in missing.stderr
    empty = tmp_path / "dr_empty_module.py"
    empty.write_text("X = 1\n")
    none = _run("--path", str(tmp_path), "dr_empty_module", database=database_url, schema=unmigrated_schema)
    assert none.returncode == ExitCode.USAGE
    assert "no schedules are declared in 'dr_empty_module'" in none.stderr
    module = _app(tmp_path)
    unmigrated = _run("--path", str(tmp_path), module, database=database_url, schema=unmigrated_schema)
    assert unmigrated.returncode == ExitCode.SCHEMA, unmigrated.stderr
    closed = f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres"
    unreachable = _run("--path", str(tmp_path), module, database=closed, schema=unmigrated_schema)
    assert unreachable.returncode == ExitCode.UNAVAILABLE, unreachable.stderr
    assert "not a module name" in _run("1abc", database=database_url, schema=unmigrated_schema).stderr


def test_help_describes_the_command_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scheduler", "--help"]) == ExitCode.OK
    text = " ".join(capsys.readouterr().out.split())
    assert "Fire the ticks of the schedules declared in MODULE" in text
    for shown in ("(default: 500)", "(default: 1s)", "(default: auto)", "(default: .)"):
        assert shown in text
