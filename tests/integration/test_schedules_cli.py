"""``dramatiq-reliable schedules`` against real Postgres, run in-process on the test's schema."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from psycopg import sql
from support import deployed_as

from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.scheduler import Registry, Scheduler, schedule

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc


@pytest.fixture
def run(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run a command on the test's schema in-process; return (exit code, stdout, stderr)."""
    deployed_as(database_url, db_schema, "outbox")  # an OutboxBroker deployment: replays and runs go there

    def invoke(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", database_url, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


@pytest.fixture
def loop(database_url: str, db_schema: str) -> Any:
    registry = Registry()
    schedule("nightly", actor="sync", queue_name="q", cron="0 3 * * *", tz="Europe/Berlin", registry=registry)
    schedule("every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    scheduler = Scheduler(database=database_url, schema=db_schema, registry=registry)
    scheduler.sync()
    yield scheduler
    scheduler.close()


def _count(db: Any, schema_name: str, table: str) -> int:
    return int(db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema_name, table))).fetchone()[0])


def test_list_shows_timing_zone_next_runs_last_run_and_outcome(run, loop, db, db_schema):
    loop.tick_once(now=dt.datetime.now(UTC) + dt.timedelta(seconds=3))
    db.execute(sql.SQL("UPDATE {} SET state = 'failed'").format(sql.Identifier(db_schema, "schedule_ticks")))
    code, out, err = run("schedules", "list")
    assert (code, err) == (ExitCode.OK, "")
    header, *lines = out.splitlines()
    assert header.split()[:3] == ["NAME", "SCHEDULE", "TZ"] and "NEXT RUN (UTC)" in header and "OUTCOME" in header
    every, nightly = lines
    assert every.startswith("every-second") and "every 1 s" in every and "failed" in every and "active" in every
    assert nightly.startswith("nightly") and "Europe/Berlin" in nightly and "03:00:00 CE" in nightly
    assert nightly.rstrip().endswith("active") and " - " in nightly  # never ran


def test_list_json_has_every_field_with_utc_and_local_times(run, loop):
    code, out, _ = run("schedules", "list", "--name", "nightly", "--json")
    assert code == ExitCode.OK
    (row,) = json.loads(out)
    assert row["name"] == "nightly" and row["tz"] == "Europe/Berlin" and row["paused"] is False
    assert row["next_fire_at"].endswith("+00:00")
    assert dt.datetime.fromisoformat(row["next_fire_at_local"]).hour == 3
    assert {"explain", "last_state", "last_fire_at", "last_fire_at_local", "enabled"} <= set(row)


def test_pause_then_resume(run, loop, db, db_schema):
    code, out, _ = run("schedules", "pause", "every-second")
    assert code == ExitCode.OK and "paused 'every-second'" in out
    assert loop.tick_once(now=dt.datetime.now(UTC) + dt.timedelta(seconds=30)).fired == 0
    code, out, _ = run("schedules", "list", "--name", "every-second")
    assert out.splitlines()[1].rstrip().endswith("paused")
    code, out, _ = run("schedules", "resume", "every-second", "--json")
    assert code == ExitCode.OK and json.loads(out)["paused"] is False
    assert _count(db, db_schema, "outbox") == 0


def test_trigger_prints_the_message_id_of_the_one_outbox_row(run, loop, db, db_schema):
    code, out, err = run("schedules", "trigger", "nightly")
    assert (code, err) == (ExitCode.OK, "")
    message_id = out.strip()
    rows = db.execute(sql.SQL("SELECT message_id FROM {}").format(sql.Identifier(db_schema, "outbox"))).fetchall()
    assert rows == [(message_id,)]
    code, out, _ = run("schedules", "trigger", "nightly", "--json")
    assert code == ExitCode.OK and json.loads(out)["name"] == "nightly"
    assert _count(db, db_schema, "outbox") == 2


@pytest.mark.parametrize("action", ["pause", "resume", "trigger"])
def test_an_unknown_name_is_one_line_with_the_fix(run, loop, action):
    code, out, err = run("schedules", action, "nope")
    assert code == ExitCode.NOT_FOUND and out == ""
    assert err.count("\n") == 1 and "no schedule named 'nope'" in err and "schedules list --schema" in err


def test_list_of_an_unknown_name_is_not_found(run, loop):
    code, _, err = run("schedules", "list", "--name", "nope")
    assert code == ExitCode.NOT_FOUND and "no schedule named 'nope'" in err


def test_trigger_of_a_disabled_schedule_is_refused_with_the_fix(run, loop, db, db_schema):
    db.execute(sql.SQL("UPDATE {} SET enabled = false").format(sql.Identifier(db_schema, "schedules")))
    code, out, err = run("schedules", "trigger", "nightly")
    assert code == ExitCode.REFUSED and out == "" and "declare it again" in err
    assert _count(db, db_schema, "outbox") == 0


def test_list_with_no_schedule_says_how_they_get_there(run):
    code, out, _ = run("schedules", "list")
    assert code == ExitCode.OK and "no schedule is stored" in out
    code, out, _ = run("schedules", "list", "--json")
    assert json.loads(out) == []
