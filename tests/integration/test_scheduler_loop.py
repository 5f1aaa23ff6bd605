"""The scheduler against real Postgres: one outbox row per tick whatever the number of loops, pause, sync."""

from __future__ import annotations

import datetime as dt
import threading

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
