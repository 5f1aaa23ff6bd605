"""Scheduler processes against real Postgres: several at once, SIGKILLed, after downtime, paused.

Each test runs ``dramatiq-reliable scheduler`` as real subprocesses on a module written for it,
and compares the ticks in ``schedule_ticks`` and the rows in the outbox with the tick list the
schedule implies: no gap, no double.
"""

from __future__ import annotations

import collections
import datetime as dt
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable.scheduler import tick_message_id
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance]

SECOND = dt.timedelta(seconds=1)


def _module(tmp_path: Path, body: str) -> str:
    name = f"sched_acc_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("from dramatiq_reliable import schedule\n" + textwrap.dedent(body))
    return name


def _command(tmp_path: Path, module: str, database_url: str, schema: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dramatiq_reliable",
        "scheduler",
        module,
        "--path",
        str(tmp_path),
        "--poll-interval",
        "200ms",
        "--database-url",
        database_url,
        "--schema",
        schema,
        *extra,
    ]


def _start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()


def _ticks(db: psycopg.Connection[Any], schema: str, name: str) -> list[tuple[dt.datetime, str]]:
    query = sql.SQL("SELECT fire_at, message_id FROM {} WHERE schedule_name = %s ORDER BY fire_at").format(
        sql.Identifier(schema, "schedule_ticks")
    )
    return [(row[0], row[1]) for row in db.execute(query, (name,)).fetchall()]


def _outbox_ids(db: psycopg.Connection[Any], schema: str) -> list[str]:
    query = sql.SQL("SELECT message_id FROM {}").format(sql.Identifier(schema, "outbox"))
    return [row[0] for row in db.execute(query).fetchall()]


def _assert_every_second_once(db: psycopg.Connection[Any], schema: str, name: str, *, at_least: int) -> None:
    """One tick per second from the first to the last, each with exactly one outbox row."""
    ticks = _ticks(db, schema, name)
    assert len(ticks) >= at_least
    fire_ats = [fire_at for fire_at, _ in ticks]
    expected = [fire_ats[0] + i * SECOND for i in range(len(fire_ats))]
    assert fire_ats == expected, "a gap or a double in the ticks"
    outbox = collections.Counter(_outbox_ids(db, schema))
    assert [outbox[tick_message_id(schema, name, fire_at)] for fire_at in fire_ats] == [1] * len(fire_ats)
    assert [message_id for _, message_id in ticks] == [tick_message_id(schema, name, t) for t in fire_ats]


EVERY_SECOND = """
schedule("every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow")
"""


def test_three_scheduler_processes_write_exactly_one_outbox_row_per_tick(
    tmp_path: Path, database_url: str, db_schema: str, db: Any
) -> None:
    module = _module(tmp_path, EVERY_SECOND)
    processes = [_start(_command(tmp_path, module, database_url, db_schema)) for _ in range(3)]
    try:
        wait_for(lambda: len(_ticks(db, db_schema, "every-second")) >= 20, timeout_ms=50_000, message="20 ticks")
    finally:
        _stop(processes)
    _assert_every_second_once(db, db_schema, "every-second", at_least=20)
    assert len(_outbox_ids(db, db_schema)) == len(_ticks(db, db_schema, "every-second"))


def test_a_scheduler_sigkilled_repeatedly_loses_and_doubles_nothing(
    tmp_path: Path, database_url: str, db_schema: str, db: Any
) -> None:
    module = _module(tmp_path, EVERY_SECOND)
    command = _command(tmp_path, module, database_url, db_schema)
    for _ in range(5):
        seen = len(_ticks(db, db_schema, "every-second"))
        process = _start(command)
        try:
            # Killed as soon as it fired something: wherever its loop happens to be.
            wait_for(lambda seen=seen: len(_ticks(db, db_schema, "every-second")) > seen, timeout_ms=20_000)
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
    # A last one catches up the ticks of the downtime (they are within the misfire grace).
    last = _start(command)
    try:
        now = db.execute("SELECT now()").fetchone()[0]
        wait_for(lambda: _ticks(db, db_schema, "every-second")[-1][0] >= now, timeout_ms=20_000)
    finally:
        _stop([last])
    _assert_every_second_once(db, db_schema, "every-second", at_least=6)
    assert len(_outbox_ids(db, db_schema)) == len(_ticks(db, db_schema, "every-second"))


def test_after_downtime_each_missed_policy_is_followed(
    tmp_path: Path, database_url: str, db_schema: str, db: Any
) -> None:
    module = _module(
        tmp_path,
        """
        for policy in ("skip", "once", "backfill"):
            schedule(f"minutely-{policy}", actor="tick", queue_name="q", every_ms=60_000, missed=policy,
                     misfire_grace_ms=1000, overlap="allow")
        """,
    )
    sync = subprocess.run(
        _command(tmp_path, module, database_url, db_schema, "--once"), capture_output=True, timeout=60
    )
    assert sync.returncode == 0, sync.stderr
    # Away from a minute boundary, so the pass below sees the same minute as the update.
    wait_for(lambda: 2 <= db.execute("SELECT extract(second FROM now())").fetchone()[0] < 45, timeout_ms=30_000)
    # Down since three minutes before the last minute mark: four minute ticks missed.
    minute = db.execute(
        sql.SQL(
            "UPDATE {} SET next_fire_at = date_trunc('minute', now()) - interval '3 minutes' "
            "RETURNING date_trunc('minute', now())"
        ).format(sql.Identifier(db_schema, "schedules"))
    ).fetchone()[0]
    restart = subprocess.run(
        _command(tmp_path, module, database_url, db_schema, "--once"), capture_output=True, timeout=60
    )
    assert restart.returncode == 0, restart.stderr
    minutes = [minute - dt.timedelta(minutes=n) for n in (3, 2, 1, 0)]
    assert [t for t, _ in _ticks(db, db_schema, "minutely-skip")] == []
    assert [t for t, _ in _ticks(db, db_schema, "minutely-once")] == [minute]
    assert [t for t, _ in _ticks(db, db_schema, "minutely-backfill")] == minutes
    assert len(_outbox_ids(db, db_schema)) == 5


def test_a_paused_schedule_fires_nothing(tmp_path: Path, database_url: str, db_schema: str, db: Any) -> None:
    module = _module(
        tmp_path,
        """
        schedule("paused-one", actor="tick", queue_name="q", every_ms=1000, overlap="allow")
        schedule("live-one", actor="tick", queue_name="q", every_ms=1000, overlap="allow")
        """,
    )
    sync = subprocess.run(
        _command(tmp_path, module, database_url, db_schema, "--once"), capture_output=True, timeout=60
    )
    assert sync.returncode == 0, sync.stderr
    db.execute(
        sql.SQL("UPDATE {} SET paused = true WHERE name = 'paused-one'").format(sql.Identifier(db_schema, "schedules"))
    )
    # The syncing pass may have fired a first tick of both, if a second began during it.
    before = _ticks(db, db_schema, "paused-one")
    process = _start(_command(tmp_path, module, database_url, db_schema))
    try:
        wait_for(lambda: len(_ticks(db, db_schema, "live-one")) >= 3, timeout_ms=20_000, message="live ticks")
    finally:
        _stop([process])
    assert len(before) <= 1
    assert _ticks(db, db_schema, "paused-one") == before
    _assert_every_second_once(db, db_schema, "live-one", at_least=3)
    assert len(_outbox_ids(db, db_schema)) == len(_ticks(db, db_schema, "live-one")) + len(before)
