"""Ticks written ahead (``lead_ms``) against real Postgres: due at the fire time, once across loops, taken back by pause, sync and removal."""

from __future__ import annotations

import datetime as dt
import math
import threading
import time

import dramatiq
import pytest
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import ConfigurationError, PostgresBroker
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.scheduler import Registry, Scheduler, schedule, tick_message_id
from dramatiq_reliable.scheduler.admin import pause_schedule, resume_schedule
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
INTERVAL_MS = 10_000


def _rows(db, schema_name: str, table: str, columns: str, where: str = "true") -> list[tuple]:
    query = sql.SQL(f"SELECT {columns} FROM {{}} WHERE {where} ORDER BY 1").format(sql.Identifier(schema_name, table))
    return db.execute(query).fetchall()


@pytest.fixture(params=["outbox", "queue"])
def target(request) -> str:
    """Where the ticks go, and the name of that table: an OutboxBroker's outbox or a PostgresBroker's queue."""
    return request.param


@pytest.fixture
def make_loop(database_url, target):
    made: list[Scheduler] = []

    def make(schema_name: str, registry: Registry, lead_ms: int = 5000) -> Scheduler:
        made.append(
            Scheduler(database=database_url, schema=schema_name, registry=registry, lead_ms=lead_ms, target=target)
        )
        return made[-1]

    yield make
    for loop in made:
        loop.close()


def _registry(overlap: str = "allow", args: tuple = ()) -> Registry:
    registry = Registry()
    schedule(
        "every-10s", actor="tick", queue_name="q", every_ms=INTERVAL_MS, overlap=overlap, args=args, registry=registry
    )
    return registry


def _due_in(db, schema_name: str, loop: Scheduler | None = None, seconds: float = 3.0) -> dt.datetime:
    """Move the next fire time to the first tick at least ``seconds`` from the database clock and return it.

    With ``loop``, its lead is set to cover that tick (2 s more) but not the one after it.
    """
    (now,) = db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    step = INTERVAL_MS / 1000
    fire_s = math.ceil((now + seconds) / step) * step
    fire_at = dt.datetime.fromtimestamp(fire_s, UTC)
    db.execute(sql.SQL("UPDATE {} SET next_fire_at = %s").format(sql.Identifier(schema_name, "schedules")), (fire_at,))
    if loop is not None:
        loop.lead_ms = math.ceil((fire_s - now) * 1000) + 2000
    return fire_at


def test_an_allow_tick_is_written_ahead_due_at_its_fire_time_and_once(make_loop, db_schema, db, target):
    loop = make_loop(db_schema, _registry())
    loop.sync()
    fire_at = _due_in(db, db_schema, loop)
    assert loop.tick_once().fired == 1
    assert loop.tick_once().fired == 0  # advanced to the next tick, beyond the lead
    message_id = tick_message_id(db_schema, "every-10s", fire_at)
    assert _rows(db, db_schema, target, "message_id, available_at") == [(message_id, fire_at)]
    assert _rows(db, db_schema, "schedule_ticks", "fire_at, state, reason") == [(fire_at, "enqueued", "ahead")]
    ((body,),) = _rows(db, db_schema, target, "body")
    assert Message.decode(bytes(body)).message_timestamp == int(fire_at.timestamp() * 1000)
    (next_fire_at,) = _rows(db, db_schema, "schedules", "next_fire_at")[0]
    assert next_fire_at == fire_at + dt.timedelta(milliseconds=INTERVAL_MS)


def test_a_skip_policy_tick_is_not_written_ahead(make_loop, db_schema, db, target):
    # Whether the last run still goes is known only at the fire time.
    loop = make_loop(db_schema, _registry(overlap="skip"))
    loop.sync()
    _due_in(db, db_schema, loop)
    assert loop.tick_once().claimed == 0
    assert _rows(db, db_schema, target, "message_id") == []


def test_a_buffered_tick_is_fired_but_the_buffer_policys_next_tick_is_not_written_ahead(make_loop, db_schema, db):
    loop = make_loop(db_schema, _registry(overlap="buffer"))
    loop.sync()
    fire_at = _due_in(db, db_schema, loop)
    buffered_at = fire_at - dt.timedelta(milliseconds=INTERVAL_MS)
    db.execute(
        sql.SQL("UPDATE {} SET buffered_fire_at = %s").format(sql.Identifier(db_schema, "schedules")), (buffered_at,)
    )
    result = loop.tick_once()
    assert (result.claimed, result.fired) == (1, 1)
    assert _rows(db, db_schema, "schedule_ticks", "fire_at, reason") == [(buffered_at, None)]
    assert _rows(db, db_schema, "schedules", "next_fire_at") == [(fire_at,)]


def test_pause_takes_back_a_tick_written_ahead_and_resume_writes_it_again_once(
    make_loop, database_url, db_schema, db, target
):
    loop = make_loop(db_schema, _registry())
    loop.sync()
    fire_at = _due_in(db, db_schema, loop, seconds=20)
    assert loop.tick_once().fired == 1
    pause_schedule(database_url, "every-10s", schema=db_schema)
    assert _rows(db, db_schema, target, "message_id") == []
    assert _rows(db, db_schema, "schedule_ticks", "fire_at") == []
    assert loop.tick_once().claimed == 0
    resume_schedule(database_url, "every-10s", schema=db_schema)
    # Resumed before its fire time: from the next tick after now, so that one is written again
    # (same message id) once, with any tick before it, each once.
    while loop.tick_once().fired:
        pass
    ids = [message_id for (message_id,) in _rows(db, db_schema, target, "message_id")]
    assert ids.count(tick_message_id(db_schema, "every-10s", fire_at)) == 1
    assert len(set(ids)) == len(ids)


def test_a_tick_already_due_is_not_taken_back_by_a_pause(make_loop, database_url, db_schema, db, target):
    # Due before the pause: it would have been written without a lead too, so it stays.
    loop = make_loop(db_schema, _registry())
    loop.sync()
    _due_in(db, db_schema, seconds=-2 * INTERVAL_MS / 1000)
    fired = loop.tick_once().fired
    assert fired >= 1
    pause_schedule(database_url, "every-10s", schema=db_schema)
    assert len(_rows(db, db_schema, target, "message_id")) == fired


def test_a_redefined_schedule_fires_its_tick_written_ahead_with_the_new_arguments(make_loop, db_schema, db, target):
    loop = make_loop(db_schema, _registry(args=(1,)))
    loop.sync()
    fire_at = _due_in(db, db_schema, loop, seconds=20)
    assert loop.tick_once().fired == 1
    changed, _ = make_loop(db_schema, _registry(args=(2,))).sync()
    assert changed == ["every-10s"]
    assert _rows(db, db_schema, target, "message_id") == []
    # Same timing: rewound to the retracted tick, which now carries the new arguments.
    assert loop.tick_once().fired == 1
    ((body,),) = _rows(db, db_schema, target, "body")
    assert b'"args":[2]' in bytes(body)
    assert _rows(db, db_schema, "schedule_ticks", "fire_at") == [(fire_at,)]


def test_a_schedule_removed_from_code_takes_back_its_tick_written_ahead(make_loop, db_schema, db, target):
    registry = _registry()
    schedule("other", actor="tick", queue_name="q", every_ms=INTERVAL_MS, registry=registry)
    loop = make_loop(db_schema, registry)
    loop.sync()
    _due_in(db, db_schema, loop, seconds=20)
    assert loop.tick_once().fired == 1  # "every-10s" (allow); "other" (skip) waits for its fire time
    registry.remove("every-10s")
    _, disabled = make_loop(db_schema, registry).sync()
    assert disabled == ["every-10s"]
    assert _rows(db, db_schema, target, "message_id") == []


def test_three_loops_writing_ahead_write_each_tick_once_due_at_its_fire_time(make_loop, db_schema, db, target):
    registry = Registry()
    for n in range(20):
        schedule(f"s{n}", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    loops = [make_loop(db_schema, registry, lead_ms=2000) for _ in range(3)]
    loops[0].sync()
    base = dt.datetime.now(UTC).replace(microsecond=0) + dt.timedelta(seconds=2)
    moments = [base + dt.timedelta(milliseconds=250 * i) for i in range(40)]  # 10 simulated seconds

    def drive(loop: Scheduler) -> None:
        for moment in moments:
            loop.tick_once(now=moment)

    threads = [threading.Thread(target=drive, args=(loop,)) for loop in loops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    ticks = _rows(db, db_schema, "schedule_ticks", "message_id, fire_at, reason")
    outbox = dict(_rows(db, db_schema, target, "message_id, available_at"))
    assert len(ticks) >= 20 * 10
    assert len(outbox) == len(ticks) == len({message_id for message_id, _, _ in ticks})  # one row per tick
    ahead = [(message_id, fire_at) for message_id, fire_at, reason in ticks if reason == "ahead"]
    assert len(ahead) >= 20 * 9
    assert all(outbox[message_id] == fire_at for message_id, fire_at in ahead)  # due at its own fire time


def test_a_negative_lead_ms_is_refused(database_url):
    with pytest.raises(ConfigurationError, match="lead_ms must be an int >= 0"):
        Scheduler(database=database_url, lead_ms=-1)
    with pytest.raises(ConfigurationError, match="lead_ms must be an int >= 0"):
        Scheduler(database=database_url, target="queue", lead_ms=-1)


def test_a_postgres_broker_worker_runs_a_tick_written_ahead_at_its_fire_time_not_before(database_url, db_schema, db):
    """The queue row written ahead is invisible to the consumers' claim until its fire time."""
    broker = PostgresBroker(database=database_url, schema=db_schema)
    ran: list[float] = []
    dramatiq.actor(lambda: ran.append(time.time()), actor_name="tick", queue_name="q", broker=broker)
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    registry = Registry()
    schedule("every-1s", actor="tick", queue_name="q", every_ms=1000, overlap="allow", registry=registry)
    loop = Scheduler.from_broker(broker, registry=registry, lead_ms=3000)
    try:
        loop.sync()
        before = time.time()
        (now,) = db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        skew = now - (before + time.time()) / 2  # the database's clock against this process's
        fire_at = dt.datetime.fromtimestamp(math.ceil(now + 1.5), UTC)  # on the schedule's one-second grid
        db.execute(
            sql.SQL("UPDATE {} SET next_fire_at = %s").format(sql.Identifier(db_schema, "schedules")), (fire_at,)
        )
        assert loop.tick_once().fired >= 1  # that tick, and the next ones within the lead
        worker.start()
        wait_for(lambda: ran, timeout_ms=15_000, message=lambda: f"the tick never ran; fire time {fire_at}")
        early_s = fire_at.timestamp() - (ran[0] + skew)
        assert early_s < 0.005, f"the tick ran {early_s:.3f} s before its fire time"  # 5 ms: the clocks' comparison
    finally:
        worker.stop()
        loop.close()
        broker.close()


def test_schedules_list_shows_a_tick_written_ahead_as_a_run_to_come(make_loop, database_url, db_schema, db, capsys):
    loop = make_loop(db_schema, _registry())
    loop.sync()
    _due_in(db, db_schema, loop, seconds=20)
    assert loop.tick_once().fired == 1
    assert main(["schedules", "list", "--database-url", database_url, "--schema", db_schema]) == ExitCode.OK
    (line,) = capsys.readouterr().out.splitlines()[1:]
    assert " in " in line and "ago" not in line and "enqueued (ahead)" in line
