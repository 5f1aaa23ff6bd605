"""Rate limits per key: what a limit is, and the bucket rows every worker shares in Postgres.

A :class:`RateLimit` says how often the calls of one key may happen (``per_second=25``) and how
many may come at once (``burst``).  The buckets live in ``rate_limit_buckets`` (migration 13),
one row per key, so every worker process of every host draws on the same tokens with no Redis
or Memcached beside Postgres.

**Token bucket, kept as one timestamp.**  A sliding window stores one row per call (or per
window) and counts them on every take; a token bucket needs one row per key and one
``INSERT ... ON CONFLICT DO UPDATE`` per take, its refill computed from the statement's clock.
It is kept as GCRA (the generic cell rate algorithm): the row's ``tat`` is when the bucket would
be full again.  In any window of ``w`` seconds at most ``burst + rate * w`` takes are granted, so
``burst=1`` (the default) keeps every one-second window at the limit plus one, the guarantee a
provider's "N per second" asks for.

**A job that finds no token reserves the next one** (``tat`` moves on by one step) and is
postponed to it.  Waiting jobs so come back one at a time, each at its own slot, and a thousand
of them do not wake together to fight over one token.  ``tat`` also tells how many reservations
are ahead (:func:`limited_keys`), so no row per waiting job is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _sql
from .._checks import check_int, check_ms, check_text
from ..errors import ConfigurationError

# take, pause and paused_ms are the middleware's: public here are the limit and what status shows.
__all__ = ["KeyState", "RateLimit", "limited_keys"]

#: The longest key, limiter name and suffix together: keys are built from names and IDs.
MAX_KEY_CHARS = 500
#: How long a 429 without ``Retry-After`` pauses its key: the provider said "too fast" but not
#: for how long, and one second at least stops every worker calling in the meantime.
DEFAULT_PAUSE_MS = 1_000
#: After a pause the key runs at this fraction of its rate for ``slow_ms``: the declared rate was
#: what the provider just refused, so it is not resumed at once.
DEFAULT_SLOW_FACTOR = 0.5
DEFAULT_SLOW_MS = 60_000

_PERIODS_MS = {"per_second": 1_000, "per_minute": 60_000, "per_hour": 3_600_000}


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """At most ``per_second`` (or ``per_minute``, ``per_hour``) calls per key, ``burst`` at once.

    ``name`` is what actors name in ``rate_limit="stripe"``; a key function may return the name
    alone (one bucket for every call) or ``"<name>:<suffix>"`` (a bucket per customer, per
    account), each with this limit.  The name holds no ``":"`` for that reason.

    Parameters:
      name: the limiter's name.
      per_second, per_minute, per_hour: the rate; exactly one.
      burst: how many calls may start together after a quiet spell (default 1: every window of
        ``w`` seconds sees at most ``1 + rate * w`` calls).
      pause_ms: how long a 429 with no ``Retry-After`` pauses the key (default 1 s).
      slow_factor, slow_ms: after a pause, the key runs at ``slow_factor`` of its rate for
        ``slow_ms`` (default half the rate for a minute); ``slow_factor=1`` turns this off.

    >>> stripe = RateLimit("stripe", per_second=25, burst=5)
    >>> stripe.interval_ms
    40.0
    """

    name: str
    per_second: int | None = None
    per_minute: int | None = None
    per_hour: int | None = None
    burst: int = 1
    pause_ms: int = DEFAULT_PAUSE_MS
    slow_factor: float = DEFAULT_SLOW_FACTOR
    slow_ms: int = DEFAULT_SLOW_MS

    def __post_init__(self) -> None:
        check_text("name", self.name, max_chars=100, fix="name the limiter after the API it guards, e.g. 'stripe'")
        if ":" in self.name:
            raise ConfigurationError(
                f"rate limit name {self.name!r} holds ':', which separates the name from a key's suffix; "
                "name it without ':' (e.g. 'stripe') and let a key function return 'stripe:cust_42'"
            )
        given = [name for name in _PERIODS_MS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ConfigurationError(
                f"rate limit {self.name!r} needs exactly one of per_second, per_minute, per_hour, got "
                f"{given or 'none'}; e.g. RateLimit({self.name!r}, per_second=25)"
            )
        check_int(f"rate limit {self.name!r}: {given[0]}", getattr(self, given[0]), minimum=1, maximum=1_000_000)
        check_int(f"rate limit {self.name!r}: burst", self.burst, minimum=1, maximum=1_000_000, fix="e.g. burst=1")
        check_ms(f"rate limit {self.name!r}: pause_ms", self.pause_ms, minimum=1, fix="e.g. pause_ms=1000")
        check_ms(f"rate limit {self.name!r}: slow_ms", self.slow_ms, fix="e.g. slow_ms=60000, or 0 not to slow down")
        factor = self.slow_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigurationError(
                f"rate limit {self.name!r}: slow_factor must be a number above 0 and at most 1, got {factor!r}; "
                "e.g. slow_factor=0.5 to halve the rate after a 429, 1 to keep it"
            )

    @property
    def interval_ms(self) -> float:
        """Milliseconds between two tokens at the declared rate."""
        for name, period_ms in _PERIODS_MS.items():
            count: int | None = getattr(self, name)
            if count is not None:
                return period_ms / count
        raise AssertionError("checked in __post_init__")  # pragma: no cover


class Registry:
    """The limits a middleware knows, by name; one name with two definitions is refused."""

    def __init__(self, limits: Iterable[RateLimit] = ()) -> None:
        self._limits: dict[str, RateLimit] = {}
        for limit in limits:
            self.add(limit)

    def add(self, limit: RateLimit) -> RateLimit:
        if not isinstance(limit, RateLimit):
            raise ConfigurationError(
                f"limits must hold RateLimit objects, got {limit!r}; e.g. RateLimit('x', per_second=5)"
            )
        known = self._limits.get(limit.name)
        if known is not None and known != limit:
            raise ConfigurationError(
                f"rate limit {limit.name!r} is declared twice with different limits; give one of them another name"
            )
        self._limits[limit.name] = limit
        return limit

    def get(self, name: str) -> RateLimit | None:
        return self._limits.get(name)

    def __iter__(self) -> Iterator[RateLimit]:
        return iter(list(self._limits.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._limits


# -- the bucket rows -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Take:
    """The outcome of one take: granted now, or a slot ``wait_ms`` ahead (``paused``: by a 429).

    ``asked_at`` is ``time.monotonic()`` just before the statement, whose clock ``wait_ms`` is
    counted from: a wait in place ends at ``asked_at + wait_ms``, not a round trip later.
    """

    granted: bool
    wait_ms: int
    slot_ms: int
    paused: bool
    asked_at: float = 0.0


def take(conn: psycopg.Connection[Any], schema: str, limit: RateLimit, key: str) -> Take:
    """Take a token of ``key`` now, or reserve the next one (see the module docstring)."""
    asked_at = time.monotonic()
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(
            _sql.rendered("rate_take", schema),
            {"key": key, "limiter": limit.name, "interval_ms": limit.interval_ms, "burst": limit.burst},
        )
        .fetchone()
    )
    assert row is not None  # an upsert returns its row
    return Take(
        granted=bool(row["granted"]),
        wait_ms=max(0, int(row["wait_ms"])),
        slot_ms=int(row["slot_ms"]),
        paused=bool(row["paused"]),
        asked_at=asked_at,
    )


def slot_ahead(conn: psycopg.Connection[Any], schema: str, key: str, slot_ms: int) -> tuple[int, int]:
    """``(ms until slot_ms, ms the key stays paused)`` by Postgres' clock, for a job back at its slot."""
    row = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.rendered("rate_paused", schema), {"key": key, "slot_ms": slot_ms})
        .fetchone()
    )
    assert row is not None  # a SELECT without FROM returns its row
    return int(row["ahead_ms"]), max(0, int(row["paused_ms"]))


def pause(
    conn: psycopg.Connection[Any],
    schema: str,
    limit: RateLimit,
    key: str,
    *,
    pause_ms: int,
    status: int | None,
    message_id: str,
) -> None:
    """Pause ``key`` for every worker for ``pause_ms`` (never shortening a longer pause), then slow it."""
    conn.execute(
        _sql.rendered("rate_pause", schema),
        {
            "key": key,
            "limiter": limit.name,
            "interval_ms": limit.interval_ms,
            "burst": limit.burst,
            "pause_ms": pause_ms,
            "slow_ms": limit.slow_ms if limit.slow_factor < 1 else 0,
            "slow_factor": limit.slow_factor if limit.slow_factor < 1 else None,
            "status": status,
            "message_id": message_id,
        },
    )


@dataclasses.dataclass(frozen=True)
class KeyState:
    """One limited key as ``status``, the web page and the gauges show it.

    ``paused_until_ms`` is when a provider's 429 stops holding the key (``None``: not paused);
    ``waiting`` counts the jobs postponed to a reserved token still ahead, and
    ``busy_until_ms`` is when the last of them is due.
    """

    key: str
    limiter: str
    per_second: float
    burst: int
    waiting: int
    busy_until_ms: int | None
    paused_until_ms: int | None
    paused_status: int | None
    slowed_until_ms: int | None
    slow_factor: float | None
    granted: int
    postponed: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for people: the key, its limit, and what holds it back now."""
        parts = []
        if self.paused_until_ms is not None:
            by = f" by a {self.paused_status}" if self.paused_status else ""
            parts.append(f"paused{by} until {_when(self.paused_until_ms)}")
        if self.slowed_until_ms is not None and self.slow_factor is not None:
            parts.append(f"at {self.slow_factor:g} of its rate until {_when(self.slowed_until_ms)}")
        if self.waiting:
            due = f", the last due {_when(self.busy_until_ms)}" if self.busy_until_ms is not None else ""
            parts.append(f"{self.waiting} job{'s' if self.waiting != 1 else ''} waiting{due}")
        return f"rate limit {self.key!r} ({self.per_second:g}/s, burst {self.burst}): " + ", ".join(parts)


def limited_keys(conn: psycopg.Connection[Any], schema: str, *, limit: int = 100) -> list[KeyState]:
    """The keys limited now (paused, slowed, or with jobs waiting), most pressing first."""
    rows = conn.cursor(row_factory=dict_row).execute(_sql.query("rate_status", schema), {"limit": limit}).fetchall()
    return [
        KeyState(
            key=row["key"],
            limiter=row["limiter"],
            per_second=round(1000 / float(row["interval_ms"]), 6),
            burst=int(row["burst"]),
            waiting=int(row["waiting"]),
            busy_until_ms=_ms(row["busy_until_ms"]) if int(row["waiting"]) else None,
            paused_until_ms=_ms(row["paused_until_ms"]),
            paused_status=row["paused_status"],
            slowed_until_ms=_ms(row["slowed_until_ms"]),
            slow_factor=row["slow_factor"],
            granted=int(row["granted"]),
            postponed=int(row["postponed"]),
        )
        for row in rows
    ]


def _when(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc).isoformat(timespec="milliseconds")


def _ms(value: Any) -> int | None:
    return None if value is None or not math.isfinite(float(value)) else int(value)
