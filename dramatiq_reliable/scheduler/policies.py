"""Which ticks of a due schedule fire, which are skipped and which wait: the missed-tick and overlap policies.

A pure function of the schedule, its stored state and the database clock, so the rules are
tested without a database and every scheduler loop applies them the same way.

Missed ticks: a tick is *on time* while it is at most ``misfire_grace_ms`` late; on-time ticks
always fire (a loop that stalled for a few seconds loses nothing).  Older ticks were *missed*
(every scheduler was down): ``missed="skip"`` drops them, ``"once"`` fires the latest of them
unless an on-time tick fires in the same pass, ``"backfill"`` fires each one no older than
``backfill_window_ms``.

Overlap, applied to the ticks that would fire, oldest first: while the schedule's previous run is
queued or running (``busy``), ``overlap="skip"`` records each tick as skipped, ``"buffer"``
keeps the first one to fire when the run ends (later ones are skipped) and ``"allow"`` fires
them all.  A tick that fires makes the schedule busy for the ticks after it in the same pass.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from .spec import Schedule

__all__ = ["MAX_TICKS_PER_PASS", "Plan", "plan"]

#: One pass handles at most this many ticks of one schedule; the rest wait for the next pass.
MAX_TICKS_PER_PASS = 1000

UTC = dt.timezone.utc
_EPSILON = dt.timedelta(microseconds=1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one pass does with one schedule."""

    fire: tuple[dt.datetime, ...]
    skipped: tuple[tuple[dt.datetime, str], ...]
    next_fire_at: dt.datetime
    buffered_fire_at: dt.datetime | None
    #: missed ticks dropped without a tick row (``missed="skip"``, or older than the backfill window)
    missed_first: dt.datetime | None = None
    missed_last: dt.datetime | None = None


def _ticks_from(item: Schedule, start: dt.datetime, end: dt.datetime, limit: int) -> list[dt.datetime]:
    """Fire times in ``[start, end]``, at most ``limit`` of them."""
    found: list[dt.datetime] = []
    if start > end or limit <= 0:
        return found
    for moment in item.times_after(start - _EPSILON):
        if moment > end or len(found) >= limit:
            break
        found.append(moment)
    return found


def plan(
    item: Schedule,
    *,
    next_fire_at: dt.datetime,
    buffered_fire_at: dt.datetime | None,
    busy: bool,
    now: dt.datetime,
) -> Plan:
    """Decide the pass for ``item``, whose stored next fire time is ``next_fire_at``.

    The times may be aware in any zone (psycopg returns ``timestamptz`` in the session's
    ``TimeZone``); they are compared and shifted in UTC, as arithmetic on an aware datetime in a
    zone with DST is wall-clock arithmetic (an hour off across a change).
    """
    now = now.astimezone(UTC)
    next_fire_at = next_fire_at.astimezone(UTC)
    buffered_fire_at = None if buffered_fire_at is None else buffered_fire_at.astimezone(UTC)
    late_cut = now - dt.timedelta(milliseconds=item.misfire_grace_ms)
    candidates: list[dt.datetime] = []
    missed_first = missed_last = None
    resume_at: dt.datetime | None = None  # where the next pass starts when this one is capped
    if next_fire_at <= now:
        if next_fire_at < late_cut:
            # Missed ticks: [next_fire_at, late_cut).
            last_missed = item.last_at_or_before(late_cut - _EPSILON)
            if last_missed is not None and last_missed >= next_fire_at:
                if item.missed == "backfill":
                    oldest = max(next_fire_at, now - dt.timedelta(milliseconds=item.backfill_window_ms))
                    candidates = _ticks_from(item, oldest, late_cut - _EPSILON, MAX_TICKS_PER_PASS + 1)
                    if oldest > next_fire_at:
                        missed_first, missed_last = next_fire_at, oldest - _EPSILON
                elif item.missed == "once":
                    candidates = [last_missed]
                    if next_fire_at < last_missed:
                        missed_first, missed_last = next_fire_at, last_missed - _EPSILON
                else:
                    missed_first, missed_last = next_fire_at, last_missed
            on_time_start = late_cut
        else:
            on_time_start = next_fire_at
        room = MAX_TICKS_PER_PASS + 1 - len(candidates)
        on_time = _ticks_from(item, on_time_start, now, room)
        if item.missed == "once" and on_time and candidates:
            # One run covers the missed ticks: an on-time tick is that run.
            missed_first, missed_last = missed_first or next_fire_at, candidates[0]
            candidates = []
        candidates += on_time
        if len(candidates) > MAX_TICKS_PER_PASS:
            resume_at = candidates[MAX_TICKS_PER_PASS]
            candidates = candidates[:MAX_TICKS_PER_PASS]

    fire: list[dt.datetime] = []
    skipped: list[tuple[dt.datetime, str]] = []
    buffered = buffered_fire_at
    if buffered is not None and not busy:
        fire.append(buffered)
        buffered = None
        busy = True
    for moment in candidates:
        if item.overlap == "allow" or not busy:
            fire.append(moment)
            busy = True
        elif item.overlap == "buffer" and buffered is None:
            buffered = moment
        else:
            skipped.append((moment, "overlap"))
    if resume_at is not None:
        following = resume_at
    elif next_fire_at <= now:
        following = item.next_after(now)
    else:
        following = next_fire_at
    return Plan(
        fire=tuple(fire),
        skipped=tuple(skipped),
        next_fire_at=following,
        buffered_fire_at=buffered,
        missed_first=missed_first,
        missed_last=missed_last,
    )
