"""Operating schedules against real Postgres: list with the last run, pause, resume, trigger."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from psycopg import sql

from dramatiq_reliable import ConfigurationError, Database, ScheduleDisabled, ScheduleNotFound
from dramatiq_reliable.scheduler import Registry, Scheduler, schedule
from dramatiq_reliable.scheduler.admin import (
    ScheduleStatus,
    list_schedules,
    pause_schedule,
    resume_schedule,
    trigger_schedule,
)

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc


def _count(db, schema_name: str, table: str, where: str = "true", params: tuple = ()) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE " + where).format(sql.Identifier(schema_name, table))
    return int(db.execute(query, params).fetchone()[0])


@pytest.fixture
def database(database_url):
    """A shared Database, as the web page passes (the tests with database_url pass a URL)."""
    shared = Database(url=database_url, max_size=2)
    yield shared
    shared.close()


@pytest.fixture
def loop(database_url, db_schema):
    """A synced Scheduler with a cron schedule in Berlin and a fixed-interval one."""
    registry = Registry()
    schedule("nightly", actor="sync", queue_name="q", cron="0 3 * * *", tz="Europe/Berlin", registry=registry)
    schedule("every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    scheduler = Scheduler(database=database_url, schema=db_schema, registry=registry)
    scheduler.sync()
    yield scheduler
    scheduler.close()


def test_list_shows_every_schedule_with_explain_zone_and_next_run(loop, database_url, db_schema):
    rows = list_schedules(database_url, schema=db_schema)
    assert [row.name for row in rows] == ["every-second", "nightly"]
    nightly = rows[1]
    assert nightly.tz == "Europe/Berlin" and nightly.cron == "0 3 * * *" and nightly.every_ms is None
    assert "Europe/Berlin" in nightly.explain
    assert nightly.next_fire_at is not None and nightly.next_fire_at.utcoffset() == dt.timedelta(0)
    assert nightly.local(nightly.next_fire_at).hour == 3  # type: ignore[union-attr]
    assert nightly.last_fire_at is None and nightly.last_state is None
    assert rows[0].explain == "every 1 s" and rows[0].enabled and not rows[0].paused


def test_list_shows_the_last_run_and_its_outcome(loop, database, db, db_schema):
    later = dt.datetime.now(UTC) + dt.timedelta(seconds=5)
    assert loop.tick_once(now=later).fired >= 1  # every on-time tick up to then
    db.execute(
        sql.SQL("UPDATE {} SET state = 'succeeded', finished_at = now()").format(
            sql.Identifier(db_schema, "schedule_ticks")
        )
    )
    (row,) = list_schedules(database, schema=db_schema, name="every-second")
    assert row.last_state == "succeeded"
    assert row.last_fire_at is not None and row.last_fire_at <= later
    assert row.last_finished_at is not None and row.last_message_id
    assert row.next_fire_at is not None and row.next_fire_at > later


def test_pause_makes_tick_once_fire_nothing(loop, database, db, db_schema):
    status = pause_schedule(database, "every-second", schema=db_schema)
    assert status.paused
    assert loop.tick_once(now=dt.datetime.now(UTC) + dt.timedelta(seconds=30)).fired == 0
    assert _count(db, db_schema, "outbox") == 0
    assert pause_schedule(database, "every-second", schema=db_schema).paused  # idempotent


def test_resume_recomputes_next_run_from_now_and_skips_the_paused_ticks(loop, database, db, db_schema):
    pause_schedule(database, "every-second", schema=db_schema)
    # The stored next run lies far in the past, as after a long pause.
    db.execute(
        sql.SQL("UPDATE {} SET next_fire_at = now() - interval '1 hour' WHERE name = 'every-second'").format(
            sql.Identifier(db_schema, "schedules")
        )
    )
    before = db.execute("SELECT clock_timestamp()").fetchone()[0]
    status = resume_schedule(database, "every-second", schema=db_schema)
    assert not status.paused
    assert status.next_fire_at is not None and status.next_fire_at > before
    assert status.next_fire_at - before <= dt.timedelta(seconds=2)
    # The next pass fires at most the tick after now: none of the hour paused.
    fired = loop.tick_once(now=status.next_fire_at).fired
    assert fired == 1
    assert _count(db, db_schema, "schedule_ticks", "fire_at < %s", (before,)) == 0


def test_trigger_writes_exactly_one_outbox_row_and_one_manual_tick(loop, database, db, db_schema):
    message_id = trigger_schedule(database, "nightly", schema=db_schema, target="outbox")
    assert _count(db, db_schema, "outbox") == 1
    assert _count(db, db_schema, "outbox", "message_id = %s", (message_id,)) == 1
    ticks = db.execute(
        sql.SQL("SELECT schedule_name, state, reason, message_id FROM {}").format(
            sql.Identifier(db_schema, "schedule_ticks")
        )
    ).fetchall()
    assert ticks == [("nightly", "enqueued", "manual", message_id)]
    body = db.execute(
        sql.SQL("SELECT body FROM {} WHERE message_id = %s").format(sql.Identifier(db_schema, "outbox")),
        (message_id,),
    ).fetchone()[0]
    message = json.loads(bytes(body))
    assert message["actor_name"] == "sync" and message["options"]["schedule"] == "nightly"
    (row,) = list_schedules(database, schema=db_schema, name="nightly")
    assert row.last_reason == "manual" and row.last_message_id == message_id


def test_two_deliberate_triggers_are_two_runs(loop, database, db, db_schema):
    first = trigger_schedule(database, "nightly", schema=db_schema, target="outbox")
    db.execute("SELECT pg_sleep(0.002)")  # the next trigger falls in another millisecond
    second = trigger_schedule(database, "nightly", schema=db_schema, target="outbox")
    assert first != second
    assert _count(db, db_schema, "outbox") == 2
    assert _count(db, db_schema, "schedule_ticks", "reason = 'manual'") == 2


def test_a_paused_schedule_may_be_triggered(loop, database, db, db_schema):
    pause_schedule(database, "nightly", schema=db_schema)
    trigger_schedule(database, "nightly", schema=db_schema, target="outbox")
    assert _count(db, db_schema, "outbox") == 1
    assert list_schedules(database, schema=db_schema, name="nightly")[0].paused


def test_a_disabled_schedule_is_not_triggered(loop, database, db, db_schema):
    db.execute(
        sql.SQL("UPDATE {} SET enabled = false WHERE name = 'nightly'").format(sql.Identifier(db_schema, "schedules"))
    )
    with pytest.raises(ScheduleDisabled, match=r"'nightly' is disabled.*declare it again"):
        trigger_schedule(database, "nightly", schema=db_schema, target="outbox")
    assert _count(db, db_schema, "outbox") == 0 and _count(db, db_schema, "schedule_ticks") == 0


@pytest.mark.parametrize("action", [pause_schedule, resume_schedule, trigger_schedule])
def test_an_unknown_name_says_how_to_see_the_names(loop, database, db_schema, action):
    with pytest.raises(ScheduleNotFound, match=r"no schedule named 'nope'.*schedules list --schema"):
        action(database, "nope", schema=db_schema)
    with pytest.raises(ScheduleNotFound):
        list_schedules(database, schema=db_schema, name="nope")


def test_to_json_gives_each_time_in_utc_and_in_the_schedules_zone(loop, database, db_schema):
    (row,) = list_schedules(database, schema=db_schema, name="nightly")
    data = row.to_json()
    assert set(data) >= {field.name for field in dataclasses.fields(ScheduleStatus)}
    assert data["next_fire_at"].endswith("+00:00")
    local = dt.datetime.fromisoformat(data["next_fire_at_local"])
    assert local.hour == 3 and local == dt.datetime.fromisoformat(data["next_fire_at"])
    assert data["last_fire_at"] is None and data["last_fire_at_local"] is None
    json.dumps(data)  # every value is a JSON value


def test_a_trigger_in_a_millisecond_that_has_a_tick_returns_that_run_and_writes_nothing(loop, database, db, db_schema):
    # A tick already recorded for every millisecond of the next 5 seconds: as a first click would leave.
    db.execute(
        sql.SQL(
            "INSERT INTO {} (schedule_name, fire_at, message_id, state, reason) "
            "SELECT 'nightly', ms, 'first-click', 'enqueued', 'manual' FROM generate_series("
            "date_trunc('milliseconds', clock_timestamp()), clock_timestamp() + interval '5 seconds', "
            "interval '1 millisecond') AS ms"
        ).format(sql.Identifier(db_schema, "schedule_ticks"))
    )
    assert trigger_schedule(database, "nightly", schema=db_schema, target="outbox") == "first-click"
    assert _count(db, db_schema, "outbox") == 0


def test_a_trigger_to_the_queue_writes_a_postgres_queue_row_and_no_outbox_row(loop, database, db, db_schema):
    message_id = trigger_schedule(database, "nightly", schema=db_schema, target="queue")
    assert _count(db, db_schema, "outbox") == 0
    assert _count(db, db_schema, "queue", "message_id = %s AND queue_name = %s", (message_id, "q")) == 1
    (row,) = list_schedules(database, schema=db_schema, name="nightly")
    assert row.last_reason == "manual" and row.last_message_id == message_id


def test_a_trigger_to_an_unknown_target_is_refused_and_writes_nothing(loop, database, db, db_schema):
    with pytest.raises(ValueError, match="'outbox'.*'queue'"):
        trigger_schedule(database, "nightly", schema=db_schema, target="rabbitmq")  # type: ignore[arg-type]
    assert _count(db, db_schema, "schedule_ticks") == 0


# -- names no schedule can have --------------------------------------------------------------------

HOSTILE_NAMES = {
    "nul": "night\x00ly",
    "lone-surrogate": "night\ud800ly",
    "very-long": "n" * 100_000,
    "empty": "",
    "not-a-string": 42,
    "none": None,
}


@pytest.mark.parametrize("action", [pause_schedule, resume_schedule, trigger_schedule, list_schedules])
@pytest.mark.parametrize("name", HOSTILE_NAMES.values(), ids=HOSTILE_NAMES.keys())
def test_a_name_no_schedule_can_have_is_refused_with_our_error_not_the_drivers(
    loop, database, db, db_schema, action, name
):
    if action is list_schedules and name is None:
        pytest.skip("list_schedules(name=None) lists every schedule")
    with pytest.raises(ConfigurationError, match=r"schedule name .*; pass e\.g\. 'nightly-sync'") as raised:
        if action is list_schedules:
            action(database, schema=db_schema, name=name)
        else:
            action(database, name, schema=db_schema)
    assert len(str(raised.value)) < 300  # the value is shown shortened
    assert _count(db, db_schema, "schedule_ticks") == 0 and _count(db, db_schema, "outbox") == 0


def test_a_name_ending_in_a_newline_is_simply_not_found(loop, database, db_schema):
    with pytest.raises(ScheduleNotFound, match=r"no schedule named 'nightly\\n'"):
        pause_schedule(database, "nightly\n", schema=db_schema)


def test_trigger_without_a_target_goes_where_the_schema_sends_or_refuses_to_guess(
    loop, database, database_url, db, db_schema
):
    """A manual run on a PostgresBroker deployment goes into its queue table; once, with the
    library's default target, it went into the outbox, where no relay would publish it."""
    from support import deployed_as

    from dramatiq_reliable import TargetUnknown

    with pytest.raises(TargetUnknown, match="cannot tell where manual runs go.*target='outbox'"):
        trigger_schedule(database, "nightly", schema=db_schema)  # nothing sent yet: no guess
    with pytest.raises(ScheduleNotFound):
        trigger_schedule(database, "nope", schema=db_schema)  # an unknown name is said first
    deployed_as(database_url, db_schema, "queue")
    message_id = trigger_schedule(database, "nightly", schema=db_schema)
    assert _count(db, db_schema, "queue", "message_id = %s", (message_id,)) == 1
    assert _count(db, db_schema, "outbox") == 0
