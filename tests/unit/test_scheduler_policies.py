"""Fire times (cron in a zone, DST, intervals) and the missed-tick and overlap policies, without a database."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.scheduler import Registry, Schedule, plan, schedule
from dramatiq_reliable.scheduler.spec import MAX_EVERY_MS, check_schedule_name

UTC = dt.timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


def _item(**fields: object) -> Schedule:
    base: dict[str, object] = {"name": "s", "actor_name": "a", "queue_name": "q"}
    if "cron" not in fields:
        base["every_ms"] = 1000
    return Schedule(**{**base, **fields})  # type: ignore[arg-type]


def _at(*parts: int, tz: dt.tzinfo = UTC) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=tz)


def test_spring_forward_a_missing_time_fires_once_at_the_end_of_the_gap():
    nightly = _item(cron="30 2 * * *", tz="Europe/Berlin")
    it = nightly.times_after(_at(2026, 3, 28, 12, tz=BERLIN))
    ticks = [next(it).astimezone(BERLIN) for _ in range(3)]
    assert [t.isoformat() for t in ticks] == [
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00",
    ]


def test_fall_back_a_fixed_time_fires_once_and_a_wildcard_hour_fires_on_both_passes():
    nightly = _item(cron="30 2 * * *", tz="Europe/Berlin")
    it = nightly.times_after(_at(2026, 10, 24, 12, tz=BERLIN))
    assert [next(it).isoformat() for _ in range(2)] == ["2026-10-25T00:30:00+00:00", "2026-10-26T01:30:00+00:00"]
    half_hourly = _item(cron="*/30 * * * *", tz="Europe/Berlin")
    it = half_hourly.times_after(_at(2026, 10, 25, 1, 45, tz=BERLIN))
    utc = [next(it) for _ in range(4)]
    assert [t.isoformat() for t in utc] == [
        "2026-10-25T00:00:00+00:00",  # 02:00 CEST
        "2026-10-25T00:30:00+00:00",  # 02:30 CEST
        "2026-10-25T01:00:00+00:00",  # 02:00 CET, the second pass
        "2026-10-25T01:30:00+00:00",  # 02:30 CET
    ]


def test_intervals_are_aligned_to_the_epoch_and_ignore_dst():
    every = _item(every_ms=3_600_000, tz="Europe/Berlin")
    it = every.times_after(_at(2026, 10, 25, 0, 10))
    assert [next(it).isoformat() for _ in range(2)] == ["2026-10-25T01:00:00+00:00", "2026-10-25T02:00:00+00:00"]


def test_on_time_ticks_all_fire_and_the_next_fire_time_is_after_now():
    now = _at(2026, 1, 1, 0, 0, 5)
    result = plan(
        _item(overlap="allow"), next_fire_at=_at(2026, 1, 1, 0, 0, 2), buffered_fire_at=None, busy=False, now=now
    )
    assert [t.second for t in result.fire] == [2, 3, 4, 5]
    assert result.next_fire_at == _at(2026, 1, 1, 0, 0, 6)


@pytest.mark.parametrize(
    ("missed", "fired"),
    [
        ("skip", []),
        ("once", ["2026-01-01T02:00:00+00:00"]),
        ("backfill", ["2026-01-01T01:00:00+00:00", "2026-01-01T02:00:00+00:00"]),
    ],
)
def test_missed_ticks_follow_the_policy(missed, fired):
    hourly = _item(every_ms=3_600_000, missed=missed, overlap="allow", backfill_window_ms=3 * 3_600_000)
    # Down since 00:30; the 00:00 tick had fired.  Now 03:30: 01:00, 02:00 and 03:00 were missed.
    now = _at(2026, 1, 1, 3, 30)
    result = plan(hourly, next_fire_at=_at(2026, 1, 1, 1), buffered_fire_at=None, busy=False, now=now)
    expected = fired + (["2026-01-01T03:00:00+00:00"] if missed == "backfill" else [])
    if missed == "once":
        expected = ["2026-01-01T03:00:00+00:00"]
    assert [t.isoformat() for t in result.fire] == expected
    assert result.next_fire_at == _at(2026, 1, 1, 4)


def test_backfill_stops_at_its_window():
    hourly = _item(every_ms=3_600_000, missed="backfill", overlap="allow", backfill_window_ms=90 * 60_000)
    result = plan(
        hourly, next_fire_at=_at(2026, 1, 1, 1), buffered_fire_at=None, busy=False, now=_at(2026, 1, 1, 3, 30)
    )
    assert [t.hour for t in result.fire] == [2, 3]
    assert result.missed_first == _at(2026, 1, 1, 1)


def test_overlap_skip_records_a_tick_skipped_while_the_previous_run_goes_on():
    result = plan(_item(), next_fire_at=_at(2026, 1, 1), buffered_fire_at=None, busy=True, now=_at(2026, 1, 1))
    assert result.fire == ()
    assert result.skipped == ((_at(2026, 1, 1), "overlap"),)


def test_overlap_buffer_keeps_one_tick_and_fires_it_when_the_run_ended():
    busy = plan(
        _item(overlap="buffer"),
        next_fire_at=_at(2026, 1, 1),
        buffered_fire_at=None,
        busy=True,
        now=_at(2026, 1, 1, 0, 0, 1),
    )
    assert busy.fire == () and busy.buffered_fire_at == _at(2026, 1, 1)
    assert busy.skipped == ((_at(2026, 1, 1, 0, 0, 1), "overlap"),)
    free = plan(
        _item(overlap="buffer"),
        next_fire_at=busy.next_fire_at,
        buffered_fire_at=busy.buffered_fire_at,
        busy=False,
        now=_at(2026, 1, 1, 0, 0, 1, 500),
    )
    assert free.fire == (_at(2026, 1, 1),) and free.buffered_fire_at is None


def test_bad_declarations_are_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match="exactly one of cron= and every_ms="):
        _item(cron="0 3 * * *", every_ms=1000)
    with pytest.raises(ConfigurationError, match="cron expression '61 3 \\* \\* \\*' is invalid"):
        _item(cron="61 3 * * *")
    with pytest.raises(ConfigurationError, match="not an IANA time zone"):
        _item(cron="0 3 * * *", tz="Mars/Olympus")
    with pytest.raises(ConfigurationError, match="JSON-serialisable"):
        _item(args=(object(),))
    registry = Registry()
    schedule("n", actor="a", queue_name="q", every_ms=1000, registry=registry)
    with pytest.raises(ConfigurationError, match="declared twice"):
        schedule("n", actor="a", queue_name="q", every_ms=2000, registry=registry)


def test_plan_takes_times_in_the_database_sessions_zone_as_instants():
    """A session with TimeZone 'Europe/Berlin' returns 02:00:30 CET; the grace is 60 s before it, not an hour more.

    Aware arithmetic in a zone with DST is wall-clock arithmetic: 02:00:30 CET minus 60 s gave
    01:59:30 CEST, 61 minutes earlier, and ten minutes of missed ticks fired as if on time.
    """
    every_minute = _item(cron="* * * * *", overlap="allow")
    now = _at(2026, 10, 25, 1, 0, 30)  # 02:00:30 CET, 30 s after the clocks went back
    stored = _at(2026, 10, 25, 0, 50)  # missed: every scheduler was down for ten minutes
    in_utc = plan(every_minute, next_fire_at=stored, buffered_fire_at=None, busy=False, now=now)
    in_berlin = plan(
        every_minute,
        next_fire_at=stored.astimezone(BERLIN),
        buffered_fire_at=None,
        busy=False,
        now=now.astimezone(BERLIN),
    )
    assert in_berlin == in_utc
    assert in_utc.fire == (_at(2026, 10, 25, 1, 0),)  # only the on-time tick; missed="skip" drops the rest
    assert in_utc.missed_first == stored


@pytest.mark.parametrize("name", ["nightly\n", "nightly\r\n", "\nnightly", "night ly", "nightly\x00", "", "x" * 201])
def test_a_schedule_name_with_a_newline_or_outside_the_pattern_is_refused(name: str) -> None:
    """The pattern is matched whole: "nightly\\n" used to pass, as $ also matches before a final newline."""
    with pytest.raises(ConfigurationError, match="must be 1-200 characters of letters, digits and ._:/-"):
        _item(name=name)
    with pytest.raises(ConfigurationError, match="must be 1-200 characters"):
        schedule(name, actor="a", queue_name="q", every_ms=1000, registry=Registry())
    with pytest.raises(ConfigurationError, match="must be 1-200 characters"):
        check_schedule_name(name)


def test_a_valid_name_is_accepted_up_to_200_characters() -> None:
    assert check_schedule_name("reports/nightly:eu-1.v2") == "reports/nightly:eu-1.v2"
    assert _item(name="x" * 200).name == "x" * 200


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("every_ms", 10**30, r"every_ms must be at most 3153600000000 milliseconds, got 10{30}.*100 years"),
        ("every_ms", MAX_EVERY_MS + 1, "every_ms must be at most 3153600000000 milliseconds"),
        ("every_ms", 999, r"every_ms must be an int >= 1000 \(milliseconds\), got 999"),
        ("every_ms", True, "every_ms must be an int >= 1000 .* got True"),
        ("every_ms", 1500.0, "got 1500.0"),
        ("misfire_grace_ms", 10**30, "misfire_grace_ms must be at most"),
        ("backfill_window_ms", -1, "backfill_window_ms must be an int >= 0"),
        ("stale_after_ms", 10**20, "stale_after_ms must be at most"),
        ("missed", "never", "missed must be one of 'skip', 'once', 'backfill', got 'never'"),
        ("overlap", True, "overlap must be one of"),
    ],
)
def test_durations_and_choices_are_checked_at_declaration(field: str, value: object, message: str) -> None:
    """Every duration has a bound (100 years): 10**30 once made Scheduler.sync() fail for every schedule."""
    with pytest.raises(ConfigurationError, match=message):
        _item(**{field: value})


def test_the_longest_interval_is_accepted_and_its_next_fire_time_computes() -> None:
    item = _item(every_ms=MAX_EVERY_MS)
    now = _at(2026, 1, 1)
    assert now < item.next_after(now) <= now + dt.timedelta(milliseconds=MAX_EVERY_MS)


@pytest.mark.parametrize(
    "fields",
    [
        {"args": ("a\x00b",)},
        {"kwargs": {"k": ["\ud800"]}},
        {"options": {"\x00": 1}},
        {"queue_name": "q\x00"},
        {"actor_name": ""},
    ],
)
def test_values_postgres_cannot_store_are_refused_at_declaration(fields: dict[str, object]) -> None:
    """A NUL or a lone surrogate would make the sync fail for this schedule; it is refused when declared."""
    with pytest.raises(ConfigurationError, match="NUL"):
        _item(**fields)
