"""Fire times across daylight-saving changes: never at or before the time they are computed from, and DST as documented.

The expected times come from an oracle that knows nothing of cronsim: it walks the UTC minutes
one by one, reads the zone's wall clock and applies the documented rule (a fixed-time job
fires when the wall clock first reaches or jumps over its time; any other job fires whenever
the wall clock shows a matching time).
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import sys
from collections.abc import Iterator
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.scheduler import Schedule, plan
from dramatiq_reliable.scheduler.fire_times import is_fixed_time

UTC = dt.timezone.utc
MINUTE = dt.timedelta(minutes=1)
#: Northern and southern hemisphere, a 30-minute DST shift (Lord Howe), a 45-minute offset
#: (Chatham) and a zone that changes at midnight (Santiago: the skipped or repeated hour is 00:00 or 23:00).
ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",
    "Australia/Sydney",
    "America/Santiago",
    "Pacific/Chatham",
    "UTC",
]
#: Five-field expressions of both DST kinds: fixed-time (no leading * in minute and hour) and wildcard.
CRONS = [
    "30 2 * * *",  # fixed: in Berlin's and New York's skipped and repeated hour
    "0 2 * * *",  # fixed: the first minute of the repeated hour
    "15,45 1-3 * * *",  # fixed: several times a night, some in Lord Howe's half-hour shift
    "0 0 * * *",  # fixed: midnight, which Santiago skips or repeats
    "59 23 * * *",  # fixed: the minute before Santiago's change
    "*/15 * * * *",  # wildcard minute: both passes fire, skipped times do not
    "30 * * * *",  # wildcard hour
    "* 2 * * *",  # every minute of the hour that is skipped or repeated
]


# -- the oracle -------------------------------------------------------------------------------


def _field(text: str, low: int, high: int) -> frozenset[int]:
    """The values of one cron field, for the forms CRONS uses (*, */n, a-b, a,b, n)."""
    values: set[int] = set()
    for part in text.split(","):
        if part == "*":
            values.update(range(low, high + 1))
        elif part.startswith("*/"):
            values.update(range(low, high + 1, int(part[2:])))
        elif "-" in part:
            first, last = part.split("-")
            values.update(range(int(first), int(last) + 1))
        else:
            values.add(int(part))
    return frozenset(values)


@functools.cache
def _matcher(expression: str) -> tuple[frozenset[int], frozenset[int]]:
    minute, hour, *days = expression.split()
    assert days == ["*", "*", "*"], "the oracle reads minute and hour fields only"
    return _field(minute, 0, 59), _field(hour, 0, 23)


def _matches(expression: str, wall: dt.datetime) -> bool:
    minutes, hours = _matcher(expression)
    return wall.second == 0 and wall.minute in minutes and wall.hour in hours


def _wall(instant: dt.datetime, zone: ZoneInfo) -> dt.datetime:
    return instant.astimezone(zone).replace(tzinfo=None)


def _oracle_fires(expression: str, zone: ZoneInfo, start: dt.datetime, end: dt.datetime) -> Iterator[dt.datetime]:
    """Fire instants in ``(start, end]`` by walking UTC minutes (every zone here has whole-minute offsets)."""
    fixed = is_fixed_time(expression)
    # The wall clock's high-water mark: a fixed-time job fires when the clock first passes its time.
    first = start.replace(second=0, microsecond=0) - dt.timedelta(hours=3)
    highest = _wall(first, zone)
    moment = first + MINUTE
    while moment <= end:
        wall = _wall(moment, zone)
        if fixed:
            fires = False
            probe = highest + MINUTE
            while probe <= wall:  # every wall minute reached or jumped over for the first time
                fires = fires or _matches(expression, probe)
                probe += MINUTE
        else:
            fires = _matches(expression, wall)
        highest = max(highest, wall)
        if fires and moment > start:
            yield moment
        moment += MINUTE


def _oracle_next(expression: str, zone: ZoneInfo, moment: dt.datetime) -> dt.datetime:
    return next(_oracle_fires(expression, zone, moment, moment + dt.timedelta(days=3)))


def _oracle_last(expression: str, zone: ZoneInfo, moment: dt.datetime) -> dt.datetime:
    fires = list(_oracle_fires(expression, zone, moment - dt.timedelta(days=2), moment))
    return fires[-1]


def _cron(expression: str, zone: str) -> Schedule:
    return Schedule(name="s", actor_name="a", queue_name="q", cron=expression, tz=zone)


# -- instants that hypothesis draws -----------------------------------------------------------


@functools.cache
def _transitions(zone: ZoneInfo, year: int) -> list[dt.datetime]:
    """The instants in ``year`` at which ``zone``'s UTC offset changes (found hour by hour, then to the minute)."""
    found = []
    moment = dt.datetime(year, 1, 1, tzinfo=UTC)
    end = dt.datetime(year + 1, 1, 1, tzinfo=UTC)
    while moment < end:
        following = moment + dt.timedelta(hours=1)
        if moment.astimezone(zone).utcoffset() != following.astimezone(zone).utcoffset():
            probe = moment
            while probe.astimezone(zone).utcoffset() == moment.astimezone(zone).utcoffset():
                probe += MINUTE
            found.append(probe)
        moment = following
    return found


@st.composite
def instants_near_a_change(draw: st.DrawFn, zone: str) -> dt.datetime:
    """An instant within four hours of one of ``zone``'s DST changes (or any instant, for UTC)."""
    year = draw(st.integers(min_value=2000, max_value=2037))
    changes = _transitions(ZoneInfo(zone), year)
    if not changes:
        return draw(st.datetimes(dt.datetime(year, 1, 1), dt.datetime(year, 12, 31), timezones=st.just(UTC)))
    change = draw(st.sampled_from(changes))
    offset = draw(st.integers(min_value=-4 * 3600 * 10**6, max_value=4 * 3600 * 10**6))
    return change + dt.timedelta(microseconds=offset)


any_instant = st.datetimes(dt.datetime(2000, 1, 1), dt.datetime(2037, 12, 31), timezones=st.just(UTC))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, dt.datetime]:
    zone = draw(st.sampled_from(ZONES))
    expression = draw(st.sampled_from(CRONS))
    moment = draw(st.one_of(instants_near_a_change(zone), any_instant))
    return zone, expression, moment


# -- properties -------------------------------------------------------------------------------

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(cases())
def test_the_next_fire_time_is_after_the_moment_and_is_the_one_the_documented_rule_gives(
    case: tuple[str, str, dt.datetime],
) -> None:
    """For every instant, zone and kind of expression: next_after(t) > t, and it is the oracle's next fire."""
    zone, expression, moment = case
    following = _cron(expression, zone).next_after(moment)
    assert following > moment
    assert following == _oracle_next(expression, ZoneInfo(zone), moment)


@_SETTINGS
@given(cases())
def test_the_last_fire_time_is_at_or_before_the_moment_and_is_the_one_the_documented_rule_gives(
    case: tuple[str, str, dt.datetime],
) -> None:
    """last_at_or_before(t) <= t, and it is the oracle's last fire: the missed-tick policies count from it."""
    zone, expression, moment = case
    last = _cron(expression, zone).last_at_or_before(moment)
    assert last is not None and last <= moment
    assert last == _oracle_last(expression, ZoneInfo(zone), moment)


@_SETTINGS
@given(cases(), st.integers(min_value=1, max_value=5))
def test_fire_times_strictly_increase_from_any_instant(case: tuple[str, str, dt.datetime], count: int) -> None:
    """times_after(t) is strictly increasing and each of its times is next_after the one before."""
    zone, expression, moment = case
    item = _cron(expression, zone)
    times = item.times_after(moment)
    previous = moment
    for _ in range(count):
        current = next(times)
        assert current > previous
        assert current == item.next_after(previous)
        previous = current


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["*/20 * * * * *", "0 30 2 * * *", "0 */7 * * * *"]),
    st.sampled_from(ZONES),
    st.one_of(any_instant, instants_near_a_change("Europe/Berlin"), instants_near_a_change("Australia/Lord_Howe")),
)
def test_six_field_expressions_also_never_go_back(expression: str, zone: str, moment: dt.datetime) -> None:
    """Expressions with seconds: the next fire time is after the moment, the last at or before it."""
    item = _cron(expression, zone)
    assert item.next_after(moment) > moment
    last = item.last_at_or_before(moment)
    assert last is not None and last <= moment < item.next_after(last)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1000, 60_000, 90 * 60_000, 86_400_000, 7 * 86_400_000]), any_instant)
def test_intervals_are_after_the_moment_and_aligned_to_the_epoch(every_ms: int, moment: dt.datetime) -> None:
    """Intervals ignore DST: each fire time is a multiple of every_ms since the epoch, next > t >= last."""
    item = Schedule(name="s", actor_name="a", queue_name="q", every_ms=every_ms, tz="Europe/Berlin")
    following = item.next_after(moment)
    last = item.last_at_or_before(moment)
    assert last is not None and last <= moment < following
    assert following - last == dt.timedelta(milliseconds=every_ms)
    epoch = dt.datetime(1970, 1, 1, tzinfo=UTC)
    assert (following - epoch) % dt.timedelta(milliseconds=every_ms) == dt.timedelta(0)


# -- the nights themselves, minute by minute ---------------------------------------------------

# (zone, the local date of the fall-back night, the date of the spring-forward night, the wall
# times of quarter hours the clock shows twice on the fall-back night) in 2026.
NIGHTS = [
    ("Europe/Berlin", dt.date(2026, 10, 25), dt.date(2026, 3, 29), [(2, 0), (2, 15), (2, 30), (2, 45)]),
    ("America/New_York", dt.date(2026, 11, 1), dt.date(2026, 3, 8), [(1, 0), (1, 15), (1, 30), (1, 45)]),
    ("Australia/Lord_Howe", dt.date(2026, 4, 5), dt.date(2026, 10, 4), [(1, 30), (1, 45)]),
    ("Australia/Sydney", dt.date(2026, 4, 5), dt.date(2026, 10, 4), [(2, 0), (2, 15), (2, 30), (2, 45)]),
]


def _night(zone: str, day: dt.date) -> list[dt.datetime]:
    """Every UTC minute from 22:00 the evening before to 06:00 local on ``day``."""
    start = dt.datetime.combine(day, dt.time(), tzinfo=ZoneInfo(zone)) - dt.timedelta(hours=2)
    first = start.astimezone(UTC)
    return [first + MINUTE * i for i in range(9 * 60)]


@pytest.mark.parametrize(("zone", "fall_back", "spring_forward", "repeated"), NIGHTS)
def test_a_fixed_time_in_the_repeated_hour_fires_once_on_its_first_pass(
    zone: str, fall_back: dt.date, spring_forward: dt.date, repeated: list[tuple[int, int]]
) -> None:
    """From every minute of the fall-back night, a time the clock shows twice fires once, on its first pass."""
    hour, minute = repeated[-1]
    item = _cron(f"{minute} {hour} * * *", zone)
    minutes = _night(zone, fall_back)
    fires = {item.next_after(moment) for moment in minutes if item.next_after(moment) <= minutes[-1]}
    first_pass = dt.datetime.combine(fall_back, dt.time(hour, minute), ZoneInfo(zone))  # fold=0: the first
    assert fires == {first_pass.astimezone(UTC)}
    assert first_pass.replace(fold=1).astimezone(UTC) not in fires
    for moment in minutes:
        assert item.next_after(moment) > moment
        last = item.last_at_or_before(moment)
        assert last is not None and last <= moment


@pytest.mark.parametrize(("zone", "fall_back", "spring_forward", "repeated"), NIGHTS)
def test_a_wildcard_job_fires_on_both_passes_of_the_repeated_hour(
    zone: str, fall_back: dt.date, spring_forward: dt.date, repeated: list[tuple[int, int]]
) -> None:
    """*/15 fires every 15 wall-clock minutes as shown, so the repeated half hour or hour fires twice."""
    item = _cron("*/15 * * * *", zone)
    minutes = _night(zone, fall_back)
    fires = list(itertools.takewhile(lambda moment: moment <= minutes[-1], item.times_after(minutes[0] - MINUTE)))
    walls = [moment.astimezone(ZoneInfo(zone)) for moment in fires]
    # Every quarter hour of elapsed time fires: the clock goes back, so wall times repeat.
    assert all(b - a == dt.timedelta(minutes=15) for a, b in itertools.pairwise(fires))
    shown = [(wall.hour, wall.minute) for wall in walls]
    assert sorted({hm for hm in shown if shown.count(hm) == 2}) == repeated
    assert [wall.fold for wall in walls if (wall.hour, wall.minute) in repeated] == [0] * len(repeated) + [1] * len(
        repeated
    )


@pytest.mark.parametrize(("zone", "fall_back", "spring_forward", "repeated"), NIGHTS)
def test_a_skipped_time_fires_once_at_the_end_of_the_gap_and_a_wildcard_skips_it(
    zone: str, fall_back: dt.date, spring_forward: dt.date, repeated: list[tuple[int, int]]
) -> None:
    """On the spring-forward night 02:15 does not exist: the fixed-time job fires once when the gap ends; */15 has no 02:15."""
    fixed = _cron("15 2 * * *", zone)
    minutes = _night(zone, spring_forward)
    fires = {fixed.next_after(moment) for moment in minutes if fixed.next_after(moment) <= minutes[-1]}
    assert len(fires) == 1
    (fired,) = fires
    local = fired.astimezone(ZoneInfo(zone))
    before = (fired - MINUTE).astimezone(ZoneInfo(zone))
    assert local.utcoffset() != before.utcoffset()  # the first minute after the gap
    assert (local.hour, local.minute) in {(3, 0), (2, 30)}  # Lord Howe's gap ends at 02:30
    wildcard = _cron("*/15 * * * *", zone)
    fires = list(itertools.takewhile(lambda moment: moment <= minutes[-1], wildcard.times_after(minutes[0])))
    # Every quarter hour of elapsed time fires, and none shows the skipped 02:15.
    assert all(b - a == dt.timedelta(minutes=15) for a, b in itertools.pairwise(fires))
    shown = [fire.astimezone(ZoneInfo(zone)) for fire in fires]
    assert not [wall for wall in shown if (wall.hour, wall.minute) == (2, 15)]


# -- the defect as the scheduler met it ---------------------------------------------------------


def test_a_next_fire_time_computed_in_the_second_pass_is_tomorrow_not_the_first_pass():
    """The defect: at 02:15 CET (second pass) 30 2 * * * gave 02:30 CEST, 45 minutes in the past."""
    nightly = _cron("30 2 * * *", "Europe/Berlin")
    second_pass = dt.datetime(2026, 10, 25, 1, 15, tzinfo=UTC)  # 02:15 CET
    assert second_pass.astimezone(ZoneInfo("Europe/Berlin")).fold == 1
    assert nightly.next_after(second_pass) == dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC)  # tomorrow 02:30 CET
    assert nightly.last_at_or_before(second_pass) == dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # tonight, CEST


def test_a_scheduler_started_in_the_second_pass_with_skip_fires_nothing_late_and_moves_on():
    """plan() at 02:20 CET with the stored first-pass tick (00:30Z, 50 min late): missed="skip" drops it, next is tomorrow."""
    nightly = _cron("30 2 * * *", "Europe/Berlin")
    now = dt.datetime(2026, 10, 25, 1, 20, tzinfo=UTC)
    decision = plan(
        nightly,
        next_fire_at=dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
        buffered_fire_at=None,
        busy=False,
        now=now,
    )
    assert decision.fire == ()
    assert decision.next_fire_at == dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    assert decision.missed_first == decision.missed_last == dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("expression", CRONS)
def test_every_sync_and_pass_across_both_nights_moves_the_next_fire_time_past_now(zone: str, expression: str):
    """Minute by minute across both 2026 DST nights: a sync, and a pass of the loop after it, store a next fire time after now."""
    item = _cron(expression, zone)
    changes = _transitions(ZoneInfo(zone), 2026) or [dt.datetime(2026, 6, 1, tzinfo=UTC)]
    for change in changes:
        moment = change - dt.timedelta(hours=3)
        while moment < change + dt.timedelta(hours=3):
            synced = item.next_after(moment)  # what Scheduler.sync() stores when it runs at ``moment``
            assert synced > moment
            now = moment + dt.timedelta(seconds=30)
            decision = plan(item, next_fire_at=synced, buffered_fire_at=None, busy=False, now=now)
            assert decision.next_fire_at > now
            assert all(moment < fire <= now for fire in decision.fire)  # nothing from before the sync fires
            moment += MINUTE


# -- declarations -------------------------------------------------------------------------------


def test_cron_without_cronsim_names_the_scheduler_extra(monkeypatch: pytest.MonkeyPatch):
    """With cronsim unimportable the error says how to install it, not that '0 3 * * *' is invalid."""
    monkeypatch.setitem(sys.modules, "cronsim", None)  # `import cronsim` now raises ImportError
    with pytest.raises(ConfigurationError) as caught:
        _cron("0 3 * * *", "UTC")
    text = str(caught.value)
    assert "pip install 'dramatiq-reliable[scheduler]'" in text
    assert "invalid" not in text and "'0 3 * * *'" not in text
    assert isinstance(caught.value.__cause__, ImportError)
    # Intervals need no cronsim.
    assert Schedule(name="s", actor_name="a", queue_name="q", every_ms=60_000).every_ms == 60_000
