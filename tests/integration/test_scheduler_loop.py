"""The scheduler against real Postgres: one outbox row per tick whatever the number of loops, pause, sync."""

from __future__ import annotations

import datetime as dt
import threading
from zoneinfo import ZoneInfo

import pytest
from psycopg import sql

from dramatiq_reliable.scheduler import Registry, Scheduler, schedule, tick_message_id

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc


def _count(db, schema_name: str, table: str, where: str = "true") -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE " + where).format(sql.Identifier(schema_name, table))
    row = db.execute(query).fetchone()
    return int(row[0])


@pytest.fixture
def make_loop(database_url):
    """``make_loop(schema, registry)``: a Scheduler whose pool is closed after the test."""
    made: list[Scheduler] = []

    def make(schema_name: str, registry: Registry) -> Scheduler:
        made.append(Scheduler(database=database_url, schema=schema_name, registry=registry))
        return made[-1]

    yield make
    for loop in made:
        loop.close()


def _registry(**fields) -> Registry:
    registry = Registry()
    schedule("every-second", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry, **fields)
    return registry


@pytest.mark.pooler
def test_three_loops_write_exactly_one_outbox_row_per_tick(make_loop, db_schema, db):
    registry = _registry()
    loops = [make_loop(db_schema, registry) for _ in range(3)]
    loops[0].sync()
    start = loops[0].tick_once().claimed  # nothing due yet, or the first tick
    base = dt.datetime.now(UTC).replace(microsecond=0) + dt.timedelta(seconds=2)
    # Each loop drives the database clock forward by hand: 30 simulated seconds, raced by 3 threads.
    moments = [base + dt.timedelta(milliseconds=250 * i) for i in range(120)]

    def drive(loop: Scheduler) -> None:
        for moment in moments:
            loop.tick_once(now=moment)

    threads = [threading.Thread(target=drive, args=(loop,)) for loop in loops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    ticks = _count(db, db_schema, "schedule_ticks")
    outbox = _count(db, db_schema, "outbox")
    distinct = db.execute(
        sql.SQL("SELECT count(DISTINCT message_id) FROM {}").format(sql.Identifier(db_schema, "outbox"))
    ).fetchone()[0]
    assert ticks >= 30 + 0 * start
    assert outbox == ticks == distinct
    expected = tick_message_id(db_schema, "every-second", base + dt.timedelta(seconds=10))
    assert _count(db, db_schema, "outbox", f"message_id = '{expected}'") == 1


def test_a_paused_schedule_fires_nothing_and_resumes_from_now(make_loop, db_schema, db):
    loop = make_loop(db_schema, _registry())
    loop.sync()
    db.execute(sql.SQL("UPDATE {} SET paused = true").format(sql.Identifier(db_schema, "schedules")))
    later = dt.datetime.now(UTC) + dt.timedelta(seconds=30)
    assert loop.tick_once(now=later).fired == 0
    assert _count(db, db_schema, "outbox") == 0


def test_a_schedule_removed_from_code_is_disabled_by_the_next_sync(make_loop, db_schema, db):
    registry = _registry()
    schedule("other", actor="tick", queue_name="q", every_ms=1000, registry=registry)
    make_loop(db_schema, registry).sync()
    registry.remove("other")
    _changed, disabled = make_loop(db_schema, registry).sync()
    assert disabled == ["other"]
    assert _count(db, db_schema, "schedules", "enabled") == 1


def test_after_downtime_the_skip_policy_fires_nothing_missed(make_loop, db_schema, db):
    loop = make_loop(db_schema, _registry(misfire_grace_ms=5000))
    loop.sync()
    after_downtime = dt.datetime.now(UTC) + dt.timedelta(minutes=10)
    result = loop.tick_once(now=after_downtime)
    # Only the ticks of the last 5 s (the grace) fire; ten minutes of missed ticks do not.
    assert 5 <= result.fired <= 6
    assert _count(db, db_schema, "outbox") == result.fired


def test_the_scheduler_refuses_an_unmigrated_schema(make_loop, unmigrated_schema):
    from dramatiq_reliable import SchemaNotReady

    loop = make_loop(unmigrated_schema, _registry())
    with pytest.raises(SchemaNotReady, match="dramatiq-reliable migrate"):
        loop.tick_once()


# -- the real loop across a DST night, on a simulated clock --------------------------------------

BERLIN = ZoneInfo("Europe/Berlin")


class NightClock:
    """A SchedulerClock that jumps over every wait: a night passes in a fraction of a second.

    Its times are in Europe/Berlin, as a database session with ``TimeZone = 'Europe/Berlin'``
    returns them.  ``waits`` records the loop's pauses (one per pass that found nothing more
    due); the loop is stopped after ``end``, or after ``limit`` waits so a spinning loop fails
    the test instead of hanging it.
    """

    def __init__(self, start: dt.datetime, end: dt.datetime, limit: int) -> None:
        self.moment, self.end, self.limit = start, end, limit
        self.waits: list[float] = []
        self.scheduler: Scheduler | None = None

    def now(self) -> dt.datetime:
        return self.moment

    def wait(self, seconds: float, stop: threading.Event) -> None:
        self.waits.append(seconds)
        # Elapsed time is added in UTC (in Berlin, + on an aware datetime would add wall-clock time).
        self.moment = (self.moment.astimezone(UTC) + dt.timedelta(seconds=seconds)).astimezone(BERLIN)
        if self.moment > self.end or len(self.waits) >= self.limit:
            assert self.scheduler is not None
            self.scheduler.stop()


def _night_registry() -> Registry:
    registry = Registry()
    # overlap="allow": the simulated night is in the past of the real clock, so every tick's
    # updated_at is "recent" and would count as a run still going.
    schedule(
        "nightly",
        actor="sync",
        queue_name="q",
        cron="30 2 * * *",
        tz="Europe/Berlin",
        overlap="allow",
        registry=registry,
    )
    schedule(
        "half-hourly",
        actor="sync",
        queue_name="q",
        cron="*/30 * * * *",
        tz="Europe/Berlin",
        overlap="allow",
        registry=registry,
    )
    return registry


def _fired(db, schema_name: str, name: str) -> list[dt.datetime]:
    query = sql.SQL("SELECT fire_at FROM {} WHERE schedule_name = %s ORDER BY fire_at").format(
        sql.Identifier(schema_name, "schedule_ticks")
    )
    return [row[0] for row in db.execute(query, (name,)).fetchall()]


def _run_night(database_url: str, schema_name: str, clock: NightClock) -> Scheduler:
    scheduler = Scheduler(
        database=database_url, schema=schema_name, registry=_night_registry(), poll_interval_ms=60_000, clock=clock
    )
    clock.scheduler = scheduler
    thread = threading.Thread(target=scheduler.run)
    thread.start()
    thread.join(timeout=120)
    scheduler.close()
    assert not thread.is_alive(), "the loop did not stop"
    return scheduler


def test_a_scheduler_started_in_the_second_pass_of_the_repeated_hour_does_not_spin(database_url, db_schema, db):
    """Started at 02:05 CET (second pass), the loop fires nothing late, and passes stay one a minute or fewer.

    Before the fix the sync stored 02:30 CEST (00:30Z, already past) as the next fire time: the
    loop fired that tick 35 minutes late despite missed="skip" and then claimed the schedule on
    every pass without sleeping, until the wall clock reached 02:30 again.
    """
    start = dt.datetime(2026, 10, 25, 2, 5, tzinfo=BERLIN).replace(fold=1)  # 01:05Z
    assert start.utcoffset() == dt.timedelta(hours=1)
    end = dt.datetime(2026, 10, 25, 4, 0, tzinfo=BERLIN)  # 03:00Z: 115 minutes later
    clock = NightClock(start, end, limit=10_000)
    _run_night(database_url, db_schema, clock)
    # One wait a pass, each at most the poll interval and never zero: 115 minutes is >= 115 waits
    # and few more (one per tick fired).
    assert len(clock.waits) <= 115 + 10, f"the loop spun: {len(clock.waits)} passes"
    assert all(0 < seconds <= 60 for seconds in clock.waits[:-1])
    assert _fired(db, db_schema, "nightly") == []  # 02:30 CEST was before the start; 02:30 CET is the second pass
    assert _fired(db, db_schema, "half-hourly") == [
        dt.datetime(2026, 10, 25, 1, 30, tzinfo=UTC),  # 02:30 CET
        dt.datetime(2026, 10, 25, 2, 0, tzinfo=UTC),  # 03:00 CET
        dt.datetime(2026, 10, 25, 2, 30, tzinfo=UTC),  # 03:30 CET
        dt.datetime(2026, 10, 25, 3, 0, tzinfo=UTC),  # 04:00 CET
    ]
    stored = db.execute(
        sql.SQL("SELECT next_fire_at FROM {} WHERE name = 'nightly'").format(sql.Identifier(db_schema, "schedules"))
    ).fetchone()[0]
    assert stored == dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC)  # tomorrow 02:30 CET


def test_across_the_whole_fall_back_night_each_tick_fires_once_in_a_bounded_number_of_passes(
    database_url, db_schema, db
):
    """From 01:00 CEST to 04:00 CET (four hours): 02:30 fires once (summer time), */30 fires on both passes."""
    start = dt.datetime(2026, 10, 25, 1, 0, tzinfo=BERLIN)  # 23:00Z the day before
    end = dt.datetime(2026, 10, 25, 4, 0, tzinfo=BERLIN)  # 03:00Z
    clock = NightClock(start, end, limit=10_000)
    _run_night(database_url, db_schema, clock)
    assert len(clock.waits) <= 4 * 60 + 20, f"the loop spun: {len(clock.waits)} passes"
    assert _fired(db, db_schema, "nightly") == [dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)]  # 02:30 CEST
    half_hours = _fired(db, db_schema, "half-hourly")
    assert half_hours == [start.astimezone(UTC) + dt.timedelta(minutes=30 * i) for i in range(1, 9)]
    shown = [moment.astimezone(BERLIN).strftime("%H:%M %Z") for moment in half_hours]
    assert shown == [
        "01:30 CEST", "02:00 CEST", "02:30 CEST", "02:00 CET", "02:30 CET", "03:00 CET", "03:30 CET", "04:00 CET",
    ]  # fmt: skip


def test_schedules_that_cannot_be_stored_do_not_keep_the_others_out(make_loop, db_schema, db, caplog):
    """One schedule whose timing overflows and one that Postgres refuses (validation bypassed) are logged and
    skipped; the others sync and fire.  Before, every_ms=10**30 made sync() fail and store none."""
    registry = _registry()
    overflowing = schedule("overflowing", actor="tick", queue_name="q", every_ms=60_000, registry=registry)
    object.__setattr__(overflowing, "every_ms", 10**30)  # what every_ms=10**30 was before it was refused
    refused = schedule("refused", actor="tick", queue_name="q", every_ms=60_000, registry=registry)
    object.__setattr__(refused, "kwargs", {"note": "\x00"})  # jsonb refuses NUL: the upsert fails
    schedule("nightly", actor="tick", queue_name="q", cron="0 3 * * *", registry=registry)
    loop = make_loop(db_schema, registry)
    with caplog.at_level("ERROR", logger="dramatiq_reliable.scheduler"):
        changed, disabled = loop.sync()
    assert sorted(changed) == ["every-second", "nightly"]
    assert disabled == []
    assert "schedule 'overflowing' was not synced" in caplog.text
    assert "schedule 'refused' was not synced" in caplog.text
    assert _count(db, db_schema, "schedules") == 2
    assert loop.tick_once(now=dt.datetime.now(UTC) + dt.timedelta(seconds=5)).fired >= 1


def test_a_schedule_that_fails_to_sync_keeps_its_stored_row_and_is_not_disabled(make_loop, db_schema, db):
    """A deploy that breaks one schedule leaves its last good row (enabled) rather than disabling it."""
    registry = _registry()
    make_loop(db_schema, registry).sync()
    broken = registry.get("every-second")
    assert broken is not None
    object.__setattr__(broken, "kwargs", {"note": "\x00"})
    changed, disabled = make_loop(db_schema, registry).sync()
    assert changed == [] and disabled == []
    assert _count(db, db_schema, "schedules", "enabled AND kwargs = jsonb_build_object()") == 1
