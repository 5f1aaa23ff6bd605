"""Operating schedules: list them with their last run, pause, resume and trigger one run now.

The functions the ``schedules`` command and the web page call, so both act the same way.  Each
is one short transaction on the ``schedules`` row (locked ``FOR UPDATE``), so it never races a
scheduler loop: a loop that holds the row is waited for, and one that comes later sees the change.

- *pause* keeps the row out of every loop's claim until *resume*; a buffered tick is dropped, and
  so is a tick written ahead (``lead_ms``) that is not due yet (its outbox row and tick row).
- *resume* recomputes ``next_fire_at`` from the database clock: the ticks that fell while the
  schedule was paused are never fired, whatever its missed-tick policy.
- *trigger* fires one run now, through the outbox, with a tick row (reason ``manual``) in the
  same transaction.  Its fire time is the database clock cut to the millisecond and its message
  id is derived from it as for any tick, so two clicks in the same millisecond write one message,
  and two deliberate triggers are two runs.  A paused schedule may be triggered (a pause stops
  the clock, not the operator); a disabled one (removed from code) is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from psycopg.rows import dict_row

from .. import _sql, schema
from .._checks import check_choice, check_text
from ..backing import SENDS_TO, SendsTo, sends_to_of_schema, target_unknown
from ..database import Database, DatabaseLike
from ..errors import ScheduleDisabled, ScheduleNotFound
from ..outbox.wake import wake_relays
from .loop import add_tick, empty_ticks, retract_ahead, tick_message, tick_message_id
from .spec import Schedule, explain

__all__ = ["ScheduleStatus", "list_schedules", "pause_schedule", "resume_schedule", "trigger_schedule"]

UTC = dt.timezone.utc

_TIMES = ("next_fire_at", "buffered_fire_at", "last_fire_at", "last_finished_at")
#: A declared schedule's name is 1-200 characters (see ``Schedule``): a longer one names nothing.
_MAX_NAME_CHARS = 200


@dataclasses.dataclass(frozen=True)
class ScheduleStatus:
    """One schedule as stored, with its last tick and that tick's run state (a row of ``schedules list``)."""

    name: str
    actor_name: str
    queue_name: str
    cron: str | None
    every_ms: int | None
    tz: str
    explain: str
    missed: str
    overlap: str
    enabled: bool
    paused: bool
    next_fire_at: dt.datetime | None
    buffered_fire_at: dt.datetime | None
    last_fire_at: dt.datetime | None
    last_state: str | None
    last_reason: str | None
    last_message_id: str | None
    last_finished_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ScheduleStatus:
        every_ms = None if row["interval_ms"] is None else int(row["interval_ms"])
        return cls(
            name=row["name"],
            actor_name=row["actor_name"],
            queue_name=row["queue_name"],
            cron=row["cron"],
            every_ms=every_ms,
            tz=row["tz"],
            explain=explain(row["cron"], every_ms, row["tz"]),
            missed=row["missed"],
            overlap=row["overlap"],
            enabled=bool(row["enabled"]),
            paused=bool(row["paused"]),
            next_fire_at=_utc(row["next_fire_at"]),
            buffered_fire_at=_utc(row["buffered_fire_at"]),
            last_fire_at=_utc(row["last_fire_at"]),
            last_state=row["last_state"],
            last_reason=row["last_reason"],
            last_message_id=row["last_message_id"],
            last_finished_at=_utc(row["last_finished_at"]),
        )

    def local(self, moment: dt.datetime | None) -> dt.datetime | None:
        """``moment`` in the schedule's time zone (the zone its cron expression is read in)."""
        return None if moment is None else moment.astimezone(ZoneInfo(self.tz))

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values: each time twice, ``X`` in UTC and ``X_local`` in the schedule's zone."""
        data: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _TIMES:
                local = self.local(value)
                data[field.name] = None if value is None else value.isoformat()
                data[f"{field.name}_local"] = None if local is None else local.isoformat()
            else:
                data[field.name] = value
        return data


def list_schedules(
    database: DatabaseLike, *, schema: str = _sql.DEFAULT_SCHEMA, name: str | None = None
) -> list[ScheduleStatus]:
    """Every stored schedule (or the one called ``name``), by name; ``ScheduleNotFound`` if ``name`` is unknown."""
    schema_name = _sql.validate_schema(schema)
    if name is not None:
        _check_name(name)
    with _connection(database) as conn:
        _check(conn, schema_name)
        rows = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("schedule_list", schema_name), {"name": name})
            .fetchall()
        )
        conn.rollback()
    if name is not None and not rows:
        raise _not_found(name, schema_name)
    return [ScheduleStatus.from_row(row) for row in rows]


def pause_schedule(database: DatabaseLike, name: str, *, schema: str = _sql.DEFAULT_SCHEMA) -> ScheduleStatus:
    """Stop ``name`` firing until :func:`resume_schedule` (idempotent); a buffered tick is dropped."""
    schema_name = _sql.validate_schema(schema)
    _check_name(name)
    with _connection(database) as conn, conn.transaction():
        _check(conn, schema_name)
        _get(conn, schema_name, name)
        _set_paused(conn, schema_name, name, paused=True, next_fire_at=None)
        # A tick written ahead (lead_ms) and not yet due must not fire: taken back with the pause.
        retract_ahead(conn, schema_name, [name])
    return list_schedules(database, schema=schema_name, name=name)[0]


def resume_schedule(database: DatabaseLike, name: str, *, schema: str = _sql.DEFAULT_SCHEMA) -> ScheduleStatus:
    """Let ``name`` fire again from its first tick after now; the ticks missed while paused never fire.

    Resuming a schedule that is not paused changes nothing (its due tick is left to fire).
    """
    schema_name = _sql.validate_schema(schema)
    _check_name(name)
    with _connection(database) as conn, conn.transaction():
        _check(conn, schema_name)
        row = _get(conn, schema_name, name)
        if row["paused"]:
            next_fire_at = Schedule.from_row(row).next_after(row["now"])
            _set_paused(conn, schema_name, name, paused=False, next_fire_at=next_fire_at)
    return list_schedules(database, schema=schema_name, name=name)[0]


def trigger_schedule(
    database: DatabaseLike, name: str, *, schema: str = _sql.DEFAULT_SCHEMA, target: SendsTo | None = None
) -> str:
    """Fire one run of ``name`` now and return its message id.

    ``target`` is where the message goes, as for :class:`Scheduler`: ``"outbox"`` (an
    ``OutboxBroker``'s relay publishes it) or ``"queue"`` (a ``PostgresBroker``'s queue table;
    an outbox row would never run there, as no relay reads it).  ``None`` reads it from the
    schema (:func:`~dramatiq_reliable.backing.sends_to_of_schema`) and raises
    :class:`~dramatiq_reliable.TargetUnknown` when the schema cannot tell.  The message row and the tick
    row (reason ``manual``) commit together.  A second trigger in
    the same millisecond returns the first one's message id and writes nothing.  The schedule's
    own ticks are unchanged.  Raises ``ScheduleDisabled`` for a schedule removed from code.
    """
    schema_name = _sql.validate_schema(schema)
    _check_name(name)
    if target is not None:
        check_choice("target", target, SENDS_TO, fix="'outbox' for OutboxBroker, 'queue' for PostgresBroker")
    with _connection(database) as conn, conn.transaction():
        _check(conn, schema_name)
        row = _get(conn, schema_name, name)
        if not row["enabled"]:
            raise ScheduleDisabled(
                f"schedule {name!r} is disabled (it is no longer declared in code), so it cannot be triggered; "
                "declare it again with schedule(...) and restart, or send its actor directly"
            )
        if target is None:
            target = sends_to_of_schema(conn, schema_name)
            if target is None:
                raise target_unknown("manual runs", schema_name, outbox="target='outbox'", queue="target='queue'")
        if target == "queue":
            _check_queue(conn, schema_name)
        item = Schedule.from_row(row)
        now: dt.datetime = row["now"]
        fire_at = now.astimezone(UTC).replace(microsecond=now.microsecond // 1000 * 1000)
        message_id = tick_message_id(schema_name, item.name, fire_at)
        params = empty_ticks()
        body = tick_message(item, fire_at, message_id, int(fire_at.timestamp() * 1000)).encode()
        add_tick(params, item, fire_at, message_id, "enqueued", "manual", body)
        if target == "outbox":
            del params["priorities"]
        statement = "schedule_fire_queue" if target == "queue" else "schedule_fire"
        written = conn.execute(_sql.query(statement, schema_name), params).rowcount
        if written == 1:
            if target == "outbox":
                # A manual run is someone waiting: wake the relays when this commits.
                wake_relays(conn, schema=schema_name)
            return message_id
        # The tick of this millisecond exists already (a double click): that run is this one.
        existing = (
            conn.cursor(row_factory=dict_row)
            .execute(_sql.query("schedule_tick_message_id", schema_name), {"name": item.name, "fire_at": fire_at})
            .fetchone()
        )
        assert existing is not None
        return str(existing["message_id"])


# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _connection(database: DatabaseLike) -> Iterator[psycopg.Connection[Any]]:
    """A connection from ``database``; a pool made here from a URL is closed after."""
    owned = not isinstance(database, Database)
    handle = Database.of(database, max_size=1) if owned else database
    assert isinstance(handle, Database)
    try:
        with handle.connection() as conn:
            yield conn
    finally:
        if owned:
            handle.close()


def _check(conn: psycopg.Connection[Any], schema_name: str) -> None:
    schema.ensure_ready(conn, schema=schema_name, required=schema.SCHEDULER_VERSION, feature="scheduler")


def _check_queue(conn: psycopg.Connection[Any], schema_name: str) -> None:
    schema.ensure_ready(conn, schema=schema_name, required=schema.QUEUE_VERSION, feature="PostgresBroker")


def _get(conn: psycopg.Connection[Any], schema_name: str, name: str) -> dict[str, Any]:
    row = conn.cursor(row_factory=dict_row).execute(_sql.query("schedule_get", schema_name), {"name": name}).fetchone()
    if row is None:
        raise _not_found(name, schema_name)
    return row


def _set_paused(
    conn: psycopg.Connection[Any], schema_name: str, name: str, *, paused: bool, next_fire_at: dt.datetime | None
) -> None:
    conn.execute(
        _sql.query("schedule_set_paused", schema_name), {"name": name, "paused": paused, "next_fire_at": next_fire_at}
    )


def _check_name(name: object) -> None:
    """Refuse, before any I/O, a name no schedule can have: not a string, a NUL or a lone surrogate
    (Postgres text holds neither; the driver would raise its own error), or past 200 characters."""
    check_text("schedule name", name, max_chars=_MAX_NAME_CHARS, fix="pass e.g. 'nightly-sync'")


def _not_found(name: str, schema_name: str) -> ScheduleNotFound:
    where = "" if schema_name == _sql.DEFAULT_SCHEMA else f" --schema {schema_name}"
    return ScheduleNotFound(
        f"no schedule named {name!r} in schema {schema_name!r}; run 'dramatiq-reliable schedules list{where}' "
        "for the names (a schedule is stored when a process that declares it starts)"
    )


def _utc(moment: dt.datetime | None) -> dt.datetime | None:
    return None if moment is None else moment.astimezone(UTC)
