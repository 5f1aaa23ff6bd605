"""Fire times: when a cron expression (read in a time zone) or an interval fires, as UTC instants.

Every scheduler process computes the same times from the same schedule without talking to the
others, and the loop relies on one invariant: **a next fire time is never at or before the time
it was computed from** (:func:`cron_times_after` yields strictly increasing instants, all after
its ``moment``), and :func:`cron_last_at_or_before` never returns one after its ``moment``.

**Cron** expressions are parsed by `cronsim <https://pypi.org/project/cronsim/>`_ (typed, no
dependencies, follows Debian cron, with an ``explain()`` text).  We let cronsim walk the
*wall-clock* times that match (a naive calendar walk, no time zone), and turn each wall time
into instants here, with ``zoneinfo``.  cronsim's own time-zone walk is not used: started inside
the second pass of a repeated hour it returns the first pass of a later wall time, which is in
the past (02:15 CET gives 02:30 CEST, 45 minutes earlier), and the scheduler loop then spins.

Daylight-saving time follows Debian cron, for **fixed-time** expressions (five fields, minute and
hour fields not starting with ``*``, e.g. ``30 2 * * *``):

* spring forward: a wall time that does not exist that day (02:30 when clocks jump from 02:00
  to 03:00) fires once, at the first whole minute after the gap (03:00 local); several such
  times that day fire once together there;
* fall back: a wall time that comes round twice fires once, on its first pass (02:30 summer
  time); the second pass does not fire.

Put simply, a fixed-time job fires when the wall clock first reaches *or jumps over* its time.

Every other expression (``*`` leading the minute or hour field, e.g. ``*/15 * * * *``, or six
fields with seconds) follows the wall clock as it is shown: a time skipped by spring forward
does not fire, a time shown twice by fall back fires on both passes.

**Intervals** (``every_ms``) count absolute time aligned to the Unix epoch, so DST never moves
them and every process computes the same ticks.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

from ..errors import ConfigurationError

# Internal: the scheduler's own arithmetic (spec, loop and admin use it).
__all__: list[str] = []

UTC = dt.timezone.utc
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_MINUTE = dt.timedelta(minutes=1)
#: UTC offsets stay within +-24 h, so instants of wall times more than two days apart are in the
#: wall times' order, whatever the zone's transitions in between.
_IN_ORDER_BEYOND = dt.timedelta(days=2)
#: The longest gap a zone's clock ever skipped is a day (Pacific/Apia, 2011-12-30).
_LONGEST_GAP_MINUTES = 2 * 24 * 60


def load_cronsim() -> Any:
    """The ``cronsim`` module, or ``ConfigurationError`` naming the extra that installs it."""
    try:
        import cronsim
    except ImportError as error:
        raise ConfigurationError(
            "cron schedules need the cronsim package, which is not installed; "
            "pip install 'dramatiq-reliable[scheduler]' (or pip install cronsim), or use every_ms="
        ) from error
    return cronsim


def is_fixed_time(expression: str) -> bool:
    """Debian cron's test for a fixed-time job: five fields, the minute and hour fields without a leading ``*``."""
    fields = expression.split()
    return len(fields) == 5 and not fields[0].startswith("*") and not fields[1].startswith("*")


def cron_times_after(expression: str, zone: ZoneInfo, moment: dt.datetime) -> Iterator[dt.datetime]:
    """Fire times of ``expression`` read in ``zone``, strictly after ``moment`` (aware), increasing, in UTC."""
    fixed = is_fixed_time(expression)
    local = moment.astimezone(zone)
    wall = local.replace(tzinfo=None)
    start = wall
    if not fixed:
        passes = occurrences(wall, zone)
        if len(passes) == 2 and moment < passes[1]:
            # ``moment`` is in the first pass of a repeated hour: the second pass of the wall
            # times already behind it is still ahead.
            start = wall - (passes[1] - passes[0])
    latest = moment
    # Instants of repeated wall times, held until no later wall time can come before them.
    pending: list[tuple[dt.datetime, dt.datetime]] = []
    for candidate in load_cronsim().CronSim(expression, start):
        if fixed:
            # One instant per wall time, non-decreasing with it: already in order.
            instant = _fixed_instant(candidate, zone)
            if instant is not None and instant > latest:
                latest = instant
                yield instant
            continue
        found = occurrences(candidate, zone)
        settled = len(found) == 1
        if pending and (settled or candidate - max(w for _, w in pending) > _IN_ORDER_BEYOND):
            # A wall time shown once lies between the two passes of no repeated time, so every
            # instant held is before it (and before everything after it).
            for instant, _ in sorted(pending):
                if instant > latest:
                    latest = instant
                    yield instant
            pending.clear()
        if settled:
            if found[0] > latest:
                latest = found[0]
                yield found[0]
        else:
            pending.extend((instant, candidate) for instant in found)
    for instant, _ in sorted(pending):  # cronsim found no match in 50 years
        if instant > latest:
            latest = instant
            yield instant


def cron_last_at_or_before(expression: str, zone: ZoneInfo, moment: dt.datetime) -> dt.datetime | None:
    """The latest fire time of ``expression`` in ``zone`` at or before ``moment``, in UTC (``None``: none in 50 years)."""
    fixed = is_fixed_time(expression)
    local = moment.astimezone(zone)
    wall = local.replace(tzinfo=None)
    start = wall
    passes = occurrences(wall, zone)
    if len(passes) == 2 and moment >= passes[1]:
        # ``moment`` is in the second pass of a repeated hour: the first pass of the wall times
        # still ahead of it on the clock is already behind it.
        start = wall + (passes[1] - passes[0])
    best: dt.datetime | None = None
    best_wall = start
    # A reverse walk from a time with microseconds yields wall times at or before it.
    for candidate in load_cronsim().CronSim(expression, start + _MICROSECOND, reverse=True):
        if fixed:
            # Non-decreasing with the wall time: the first at or before ``moment`` is the latest.
            instant = _fixed_instant(candidate, zone)
            if instant is not None and instant <= moment:
                return instant
            continue
        found = occurrences(candidate, zone)
        for instant in found:
            if instant <= moment and (best is None or instant > best):
                best, best_wall = instant, candidate
        if best is not None and ((len(found) == 1 and found[0] <= moment) or best_wall - candidate > _IN_ORDER_BEYOND):
            return best
    return best


def occurrences(wall: dt.datetime, zone: ZoneInfo) -> tuple[dt.datetime, ...]:
    """The instants (UTC, earliest first) at which ``zone``'s clock shows the naive ``wall``.

    One for most times, two for a time repeated when clocks fall back, none for a time skipped
    when they spring forward.
    """
    found: list[dt.datetime] = []
    for fold in (0, 1):
        instant = wall.replace(tzinfo=zone, fold=fold).astimezone(UTC)
        if instant.astimezone(zone).replace(tzinfo=None) == wall and instant not in found:
            found.append(instant)
    return tuple(sorted(found))


def _fixed_instant(wall: dt.datetime, zone: ZoneInfo) -> dt.datetime | None:
    """When a fixed-time job for ``wall`` fires: its first pass, or the first minute after a gap that skipped it."""
    found = occurrences(wall, zone)
    if found:
        return found[0]
    probe = wall
    for _ in range(_LONGEST_GAP_MINUTES):
        probe += _MINUTE
        found = occurrences(probe, zone)
        if found:
            return found[0]
    return None  # pragma: no cover - no zone skips more than a day


def interval_times_after(every_ms: int, moment: dt.datetime) -> Iterator[dt.datetime]:
    """Multiples of ``every_ms`` since the Unix epoch strictly after ``moment``, in UTC."""
    k = epoch_ms(moment) // every_ms + 1
    while True:
        yield from_epoch_ms(k * every_ms)
        k += 1


def interval_last_at_or_before(every_ms: int, moment: dt.datetime) -> dt.datetime:
    """The latest multiple of ``every_ms`` since the Unix epoch at or before ``moment``, in UTC."""
    return from_epoch_ms(epoch_ms(moment) // every_ms * every_ms)


def epoch_ms(moment: dt.datetime) -> int:
    """Whole milliseconds since the Unix epoch, rounded down (no float on the way)."""
    delta = moment.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def from_epoch_ms(ms: int) -> dt.datetime:
    """The UTC instant ``ms`` milliseconds after the Unix epoch."""
    return _EPOCH + dt.timedelta(milliseconds=ms)
