"""A schedule as declared in code: when it fires (cron or a fixed interval, in a time zone) and its policies.

Fire times, and what daylight-saving time does to them, are computed in
:mod:`~dramatiq_reliable.scheduler.fire_times` and nowhere else, so every scheduler process
agrees on them without talking to the others.  Every field is validated here, when the schedule
is declared, so nothing a sync or a pass could choke on reaches the database.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .._checks import MAX_MS, check_choice, check_ms
from ..errors import ConfigurationError
from .fire_times import (
    cron_last_at_or_before,
    cron_times_after,
    interval_last_at_or_before,
    interval_times_after,
    load_cronsim,
)

__all__ = ["MISSED", "OVERLAP", "Missed", "Overlap", "Schedule", "explain"]

Missed = Literal["skip", "once", "backfill"]
Overlap = Literal["skip", "buffer", "allow"]
MISSED: tuple[Missed, ...] = ("skip", "once", "backfill")
OVERLAP: tuple[Overlap, ...] = ("skip", "buffer", "allow")

#: The longest interval: 100 years, the bound every duration option shares.  A longer one is a
#: typo (a unit slip), and past it the next fire time overflows ``datetime`` and Postgres.
MAX_EVERY_MS = MAX_MS

UTC = dt.timezone.utc
# fullmatch, never ``$``: ``$`` also matches before a final newline, which let "name\n" through.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}")
_DAY_MS = 86_400_000


def check_schedule_name(name: object) -> str:
    """Return ``name`` if it is a valid schedule name, else raise ``ConfigurationError`` with the rule.

    1-200 characters of letters, digits and ``._:/-``, starting with a letter or digit: a name
    shows in logs, tables and URLs, so no spaces, newlines or NULs.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigurationError(
            f"schedule name {name!r} must be 1-200 characters of letters, digits and ._:/- "
            "starting with a letter or digit; name it e.g. 'nightly-sync'"
        )
    return name


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One schedule: the actor it sends, when, and what happens to missed and overlapping ticks.

    Build it with :func:`~dramatiq_reliable.scheduler.schedule`, which validates every field.
    See that function for the meaning of each.
    """

    name: str
    actor_name: str
    queue_name: str
    cron: str | None = None
    every_ms: int | None = None
    tz: str = "UTC"
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    missed: Missed = "skip"
    misfire_grace_ms: int = 60_000
    backfill_window_ms: int = _DAY_MS
    overlap: Overlap = "skip"
    stale_after_ms: int = _DAY_MS

    def __post_init__(self) -> None:
        check_schedule_name(self.name)
        where = f"schedule {self.name!r}"
        for field, value in (("actor_name", self.actor_name), ("queue_name", self.queue_name)):
            if not isinstance(value, str) or not value or not _storable(value):
                raise ConfigurationError(
                    f"{where}: {field} must be a non-empty string without NUL, got {value!r}; "
                    "pass the actor (or its name with queue_name=)"
                )
        if (self.cron is None) == (self.every_ms is None):
            raise ConfigurationError(
                f"{where}: pass exactly one of cron= and every_ms=, e.g. cron='0 3 * * *' or every_ms=60_000"
            )
        if self.cron is not None:
            if not isinstance(self.cron, str) or not self.cron.strip():
                raise ConfigurationError(f"{where}: cron must be a cron expression string, got {self.cron!r}")
            # Outside the try: a missing cronsim is not an invalid expression.
            cronsim = load_cronsim()
            try:
                cronsim.CronSim(self.cron, dt.datetime(2000, 1, 1, tzinfo=UTC))
            except Exception as error:
                raise ConfigurationError(
                    f"{where}: cron expression {self.cron!r} is invalid ({error}); write five fields, "
                    "minute hour day-of-month month day-of-week, e.g. '0 3 * * *'"
                ) from None
        else:
            check_ms(
                f"{where}: every_ms",
                self.every_ms,
                minimum=1000,
                maximum=MAX_EVERY_MS,
                fix="pass an interval from 1 second to 100 years, e.g. every_ms=60_000",
            )
        try:
            zone_ok = isinstance(self.tz, str) and bool(self.tz) and ZoneInfo(self.tz) is not None
        except (ZoneInfoNotFoundError, ValueError):
            zone_ok = False
        if not zone_ok:
            raise ConfigurationError(
                f"{where}: tz {self.tz!r} is not an IANA time zone; use e.g. 'Europe/Berlin' or 'UTC'"
            )
        check_choice(f"{where}: missed", self.missed, MISSED)
        check_choice(f"{where}: overlap", self.overlap, OVERLAP)
        check_ms(f"{where}: misfire_grace_ms", self.misfire_grace_ms, minimum=0)
        check_ms(f"{where}: backfill_window_ms", self.backfill_window_ms, minimum=0)
        check_ms(f"{where}: stale_after_ms", self.stale_after_ms, minimum=1)
        if not isinstance(self.args, tuple) or not isinstance(self.kwargs, dict) or not isinstance(self.options, dict):
            raise ConfigurationError(f"{where}: args must be a tuple, kwargs and options dicts")
        try:
            json.dumps([list(self.args), self.kwargs, self.options], allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ConfigurationError(
                f"{where}: args, kwargs and options must be JSON-serialisable ({error}); pass IDs and strings"
            ) from None
        if not _storable([self.args, self.kwargs, self.options]):
            # Postgres jsonb refuses them, so the sync would fail for this schedule.
            raise ConfigurationError(
                f"{where}: args, kwargs and options must not hold NUL characters or lone surrogates; "
                "pass IDs and plain strings"
            )

    # -- fire times ---------------------------------------------------------------------------

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)

    def next_after(self, moment: dt.datetime) -> dt.datetime:
        """The first fire time strictly after ``moment`` (an aware datetime), in UTC."""
        return next(self.times_after(moment))

    def times_after(self, moment: dt.datetime) -> Iterator[dt.datetime]:
        """Fire times strictly after ``moment``, increasing, as UTC datetimes (DST: see ``fire_times``)."""
        if self.every_ms is not None:
            return interval_times_after(self.every_ms, moment)
        assert self.cron is not None
        return cron_times_after(self.cron, self.zone, moment)

    def last_at_or_before(self, moment: dt.datetime) -> dt.datetime | None:
        """The latest fire time at or before ``moment``, in UTC (``None`` if there is none)."""
        if self.every_ms is not None:
            return interval_last_at_or_before(self.every_ms, moment)
        assert self.cron is not None
        return cron_last_at_or_before(self.cron, self.zone, moment)

    def explain(self) -> str:
        """What the timing means in words: ``At 03:00 every day (Europe/Berlin)``."""
        return explain(self.cron, self.every_ms, self.tz)

    def definition(self) -> dict[str, Any]:
        """The stored fields, as the sync writes them."""
        return {
            "actor_name": self.actor_name,
            "queue_name": self.queue_name,
            "cron": self.cron,
            "interval_ms": self.every_ms,
            "tz": self.tz,
            "args": json.dumps(list(self.args)),
            "kwargs": json.dumps(self.kwargs, sort_keys=True),
            "options": json.dumps(self.options, sort_keys=True),
            "missed": self.missed,
            "misfire_grace_ms": self.misfire_grace_ms,
            "backfill_window_ms": self.backfill_window_ms,
            "overlap": self.overlap,
            "stale_after_ms": self.stale_after_ms,
        }

    def definition_hash(self) -> str:
        """A hash of the timing only: changing it (not the arguments) recomputes the next fire time."""
        timing = json.dumps([self.cron, self.every_ms, self.tz], sort_keys=True)
        return hashlib.sha256(timing.encode()).hexdigest()[:32]

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Schedule:
        """A schedule as stored (``args``/``kwargs``/``options`` already decoded by psycopg)."""
        return cls(
            name=row["name"],
            actor_name=row["actor_name"],
            queue_name=row["queue_name"],
            cron=row["cron"],
            every_ms=None if row["interval_ms"] is None else int(row["interval_ms"]),
            tz=row["tz"],
            args=tuple(row["args"] or ()),
            kwargs=dict(row["kwargs"] or {}),
            options=dict(row["options"] or {}),
            missed=row["missed"],
            misfire_grace_ms=int(row["misfire_grace_ms"]),
            backfill_window_ms=int(row["backfill_window_ms"]),
            overlap=row["overlap"],
            stale_after_ms=int(row["stale_after_ms"]),
        )


def _storable(value: object) -> bool:
    """True if every string in ``value`` (a JSON value) fits Postgres ``text``/``jsonb``: no NUL, valid UTF-8."""
    if isinstance(value, str):
        if "\x00" in value:
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate
            return False
        return True
    if isinstance(value, dict):
        return all(_storable(key) and _storable(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return all(_storable(item) for item in value)
    return True


def explain(cron: str | None, every_ms: int | None, tz: str) -> str:
    """Words for a timing: cronsim's explanation of a cron expression, or ``every 5 min``."""
    if cron is not None:
        try:
            text = str(load_cronsim().CronSim(cron, dt.datetime(2000, 1, 1, tzinfo=UTC)).explain())
        except Exception:
            text = cron
        return f"{text} ({tz})"
    assert every_ms is not None
    return f"every {_duration(every_ms)}"


def _duration(ms: int) -> str:
    for unit, size in (("d", _DAY_MS), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"
