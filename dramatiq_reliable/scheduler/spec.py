"""A schedule as declared in code: when it fires (cron or a fixed interval, in a time zone) and its policies.

Fire times are computed here and nowhere else, so every scheduler process agrees on them
without talking to the others.

**Cron** expressions are parsed by `cronsim <https://pypi.org/project/cronsim/>`_ (typed, no
dependencies, follows Debian cron, with an ``explain()`` text we show in ``schedules list``), and
read in the schedule's IANA time zone (:mod:`zoneinfo`).  Daylight-saving time follows Debian
cron:

* spring forward: a time that does not exist that day (02:30 when clocks jump from 02:00 to
  03:00) fires once, at the first minute after the gap (03:00 local);
* fall back: a fixed-time job (minute and hour fields without ``*``) fires once, at the first of
  the two repeated times (02:30 summer time); a job with ``*`` in the minute or hour field fires
  on both passes, as wall-clock times come round twice.

Six-field expressions (a seconds field first) are read by cronsim without the Debian DST quirks:
each wall-clock time that exists fires.

**Intervals** (``every_ms=``) count absolute time and are aligned to the Unix epoch (every 5
minutes fires at :00, :05, ... UTC), so DST never moves them and every process computes the same
ticks; use cron for wall-clock times.
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

from ..errors import ConfigurationError

__all__ = ["MISSED", "OVERLAP", "Missed", "Overlap", "Schedule", "cron_iter", "explain"]

Missed = Literal["skip", "once", "backfill"]
Overlap = Literal["skip", "buffer", "allow"]
MISSED: tuple[Missed, ...] = ("skip", "once", "backfill")
OVERLAP: tuple[Overlap, ...] = ("skip", "buffer", "allow")

UTC = dt.timezone.utc
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
_DAY_MS = 86_400_000


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError as error:  # pragma: no cover - the extra is missing
        raise ConfigurationError(
            "cron schedules need the cronsim package; pip install 'dramatiq-reliable[scheduler]'"
        ) from error
    return cronsim


def _positive_ms(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int of milliseconds >= {minimum}, got {value!r}")
    return value


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
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"schedule name {self.name!r} must be 1-200 characters of letters, digits and ._:/- "
                "starting with a letter or digit; name it e.g. 'nightly-sync'"
            )
        where = f"schedule {self.name!r}"
        if (self.cron is None) == (self.every_ms is None):
            raise ConfigurationError(
                f"{where}: pass exactly one of cron= and every_ms=, e.g. cron='0 3 * * *' or every_ms=60_000"
            )
        if self.cron is not None:
            if not isinstance(self.cron, str) or not self.cron.strip():
                raise ConfigurationError(f"{where}: cron must be a cron expression string, got {self.cron!r}")
            try:
                _cronsim().CronSim(self.cron, dt.datetime(2000, 1, 1, tzinfo=UTC))
            except Exception as error:
                raise ConfigurationError(
                    f"{where}: cron expression {self.cron!r} is invalid ({error}); write five fields, "
                    "minute hour day-of-month month day-of-week, e.g. '0 3 * * *'"
                ) from None
        else:
            _positive_ms(f"{where}: every_ms", self.every_ms, minimum=1000)
        try:
            zone_ok = isinstance(self.tz, str) and bool(self.tz) and ZoneInfo(self.tz) is not None
        except (ZoneInfoNotFoundError, ValueError):
            zone_ok = False
        if not zone_ok:
            raise ConfigurationError(
                f"{where}: tz {self.tz!r} is not an IANA time zone; use e.g. 'Europe/Berlin' or 'UTC'"
            )
        if self.missed not in MISSED:
            raise ConfigurationError(f"{where}: missed must be one of {MISSED!r}, got {self.missed!r}")
        if self.overlap not in OVERLAP:
            raise ConfigurationError(f"{where}: overlap must be one of {OVERLAP!r}, got {self.overlap!r}")
        _positive_ms(f"{where}: misfire_grace_ms", self.misfire_grace_ms, minimum=0)
        _positive_ms(f"{where}: backfill_window_ms", self.backfill_window_ms, minimum=0)
        _positive_ms(f"{where}: stale_after_ms", self.stale_after_ms)
        if not isinstance(self.args, tuple) or not isinstance(self.kwargs, dict) or not isinstance(self.options, dict):
            raise ConfigurationError(f"{where}: args must be a tuple, kwargs and options dicts")
        try:
            json.dumps([list(self.args), self.kwargs, self.options], allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ConfigurationError(
                f"{where}: args, kwargs and options must be JSON-serialisable ({error}); pass IDs and strings"
            ) from None

    # -- fire times ---------------------------------------------------------------------------

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)

    def next_after(self, moment: dt.datetime) -> dt.datetime:
        """The first fire time strictly after ``moment`` (an aware datetime), in UTC."""
        return next(self.times_after(moment))

    def times_after(self, moment: dt.datetime) -> Iterator[dt.datetime]:
        """Fire times strictly after ``moment``, in order, as UTC datetimes."""
        if self.every_ms is not None:
            step = self.every_ms
            epoch_ms = _epoch_ms(moment)
            k = epoch_ms // step + 1
            while True:
                yield _from_epoch_ms(k * step)
                k += 1
        else:
            assert self.cron is not None
            # Read the expression in the schedule's zone; astimezone sets ``fold`` right for a
            # repeated hour, so iteration continues from the pass we are in.
            for moment_local in cron_iter(self.cron, moment.astimezone(self.zone)):
                yield moment_local.astimezone(UTC)

    def last_at_or_before(self, moment: dt.datetime) -> dt.datetime | None:
        """The latest fire time at or before ``moment``, in UTC (``None`` if there is none)."""
        if self.every_ms is not None:
            return _from_epoch_ms(_epoch_ms(moment) // self.every_ms * self.every_ms)
        assert self.cron is not None
        probe = moment + dt.timedelta(microseconds=1)
        try:
            found = next(_cronsim().CronSim(self.cron, probe.astimezone(self.zone), reverse=True))
        except StopIteration:  # pragma: no cover - a cron expression always has a past
            return None
        return found.astimezone(UTC)  # type: ignore[no-any-return]

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


def cron_iter(expression: str, start: dt.datetime) -> Iterator[dt.datetime]:
    """Fire times of ``expression`` strictly after ``start``, in ``start``'s zone (Debian cron DST rules)."""
    return iter(_cronsim().CronSim(expression, start))


def explain(cron: str | None, every_ms: int | None, tz: str) -> str:
    """Words for a timing: cronsim's explanation of a cron expression, or ``every 5 min``."""
    if cron is not None:
        try:
            text = str(_cronsim().CronSim(cron, dt.datetime(2000, 1, 1, tzinfo=UTC)).explain())
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


def _epoch_ms(moment: dt.datetime) -> int:
    delta = moment.astimezone(UTC) - dt.datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _from_epoch_ms(ms: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(milliseconds=ms)
