"""The scheduler loop: claims due schedules and, in one transaction, writes each tick's outbox row, its tick record and the next fire time.

There is no leader.  Any number of loops (processes or threads) claim due rows with
``FOR UPDATE SKIP LOCKED``; the tick's message (its id derived from schedule and fire time),
the tick row and the advanced ``next_fire_at`` commit together or not at all, so a loop killed
at any point loses and doubles nothing: the next loop finds the row still due, or already moved
on.  The database clock decides what is due, so hosts with skewed clocks agree.

With ``lead_ms``, a schedule whose overlap policy is ``"allow"`` is claimed up to ``lead_ms``
before its fire time and its tick is written *ahead*: its message's ``available_at`` (the outbox
row's, or the ``PostgresBroker`` queue row's) is the fire time, so the relay publishes it, or a
consumer claims it, when due, however long the pass took.  The other policies decide at the
fire time from the run state then (is the last run still going?), so their ticks are written
only once due.  A tick written ahead has reason ``"ahead"``;
pausing, disabling or redefining its schedule before the fire time takes it back (its message
and tick row) in the same transaction as the change.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import random
import threading
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import psycopg
from dramatiq.broker import Broker
from dramatiq.common import q_name
from dramatiq.message import Message
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from .. import _sql, events, schema
from .._checks import check_choice, check_int, check_ms, is_int
from .._util import first_line, redact
from ..backing import SENDS_TO, SendsTo, backing_of
from ..database import Database, DatabaseLike
from ..errors import SchemaNotReady
from ..outbox.wake import wake_relays
from .policies import plan
from .registry import Registry, default_registry
from .spec import Schedule

__all__ = [
    "ScheduleTickSkipped",
    "ScheduleTicksMissed",
    "Scheduler",
    "SchedulerClock",
    "SchedulerPass",
    "tick_message_id",
]

logger = logging.getLogger("dramatiq_reliable.scheduler")

_NAMESPACE = uuid.UUID("6b1f8f0e-2f0c-4c4e-9d6c-5d7e3c1a9b10")


@dataclasses.dataclass(frozen=True)
class ScheduleTickSkipped(events.Event):
    """A tick was recorded as skipped (its previous run was still going)."""

    name: ClassVar[str] = "schedule.tick_skipped"
    schedule: str
    fire_at: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ScheduleTicksMissed(events.Event):
    """Ticks between ``first`` and ``last`` were missed (no scheduler ran) and dropped by the missed policy."""

    name: ClassVar[str] = "schedule.ticks_missed"
    level: ClassVar[int] = logging.WARNING
    schedule: str
    first: str
    last: str
    policy: str


@dataclasses.dataclass(frozen=True)
class SchedulerPass:
    """What one pass did: schedules claimed, ticks fired (messages written) and ticks skipped."""

    claimed: int
    fired: int
    skipped: int


class SchedulerClock(Protocol):
    """Where a :class:`Scheduler` reads the time and how it waits, instead of the database clock and a real sleep.

    For simulations and tests (a DST night in a second): :meth:`now` is the time every pass
    and sync uses; :meth:`wait` is called for every pause of :meth:`Scheduler.run` and returns
    once the pause is over or ``stop`` is set.
    """

    def now(self) -> dt.datetime:
        """The current time, aware."""
        ...

    def wait(self, seconds: float, stop: threading.Event) -> None:
        """Let ``seconds`` pass (or return early once ``stop`` is set)."""
        ...


def tick_message_id(schema_name: str, schedule_name: str, fire_at: dt.datetime) -> str:
    """The message id of a tick: the same schedule and fire time always give the same id."""
    stamp = fire_at.astimezone(dt.timezone.utc).isoformat()
    return str(uuid.uuid5(_NAMESPACE, f"{schema_name}\x00{schedule_name}\x00{stamp}"))


class Scheduler:
    """Syncs the declared schedules and fires their ticks through the outbox.

    Parameters:
      database: where the schedules and the outbox live (a URL, a pool or a ``Database``).
      schema: the Postgres schema of the tables.
      registry: the schedules this process declares (default: those declared with ``schedule()``).
      batch_size: schedules claimed per pass.
      poll_interval_ms: the longest sleep between passes.
      target: ``"outbox"`` (with ``OutboxBroker``: a relay publishes the message) or
        ``"queue"`` (with ``PostgresBroker``: the message goes into its queue table).  Either
        way the message, the tick and the next fire time commit in one transaction.
        :meth:`from_broker` picks it from the broker.
      clock: a :class:`SchedulerClock` to read the time from and wait on (simulations and
        tests); by default the database clock decides what is due, so hosts with skewed clocks
        agree.
      lead_ms: how long before its fire time an ``overlap="allow"`` schedule's tick is written,
        due at the fire time (0: only once due).  A pass over many schedules takes time; writing
        ahead makes the relay or the queue's consumers, not the pass, decide when the message
        goes out, so ticks are on time when thousands fall due at once; see
        ``docs/scheduling.md``.

    >>> scheduler = Scheduler(database="postgresql://app@localhost/app")   # doctest: +SKIP
    >>> scheduler.sync(); scheduler.run()                                    # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        database: DatabaseLike,
        schema: str = _sql.DEFAULT_SCHEMA,
        registry: Registry | None = None,
        batch_size: int = 500,
        poll_interval_ms: int = 1000,
        target: SendsTo = "outbox",
        clock: SchedulerClock | None = None,
        lead_ms: int = 0,
    ) -> None:
        check_choice("target", target, SENDS_TO, fix="or build it with Scheduler.from_broker(broker)")
        check_ms("lead_ms", lead_ms, minimum=0, fix="pass e.g. lead_ms=2000, or 0 to write ticks only once due")
        check_int("batch_size", batch_size, minimum=1, fix="pass e.g. batch_size=500")
        check_ms("poll_interval_ms", poll_interval_ms, minimum=1, fix="pass e.g. poll_interval_ms=1000")
        self.database = Database.of(database)
        # Only a pool made here from a URL is closed by close(); a shared Database is its owner's.
        self._owns_database = isinstance(database, str)
        self.schema = _sql.validate_schema(schema)
        self.registry = registry if registry is not None else default_registry
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_ms / 1000
        self.target: SendsTo = target
        self.clock = clock
        self.lead_ms = lead_ms
        self._stop = threading.Event()
        self._checked = False

    @classmethod
    def from_broker(
        cls,
        broker: Broker,
        *,
        registry: Registry | None = None,
        batch_size: int = 500,
        poll_interval_ms: int = 1000,
        clock: SchedulerClock | None = None,
        lead_ms: int = 0,
    ) -> Scheduler:
        """A scheduler on the broker's database and schema, writing where that broker reads.

        ``PostgresBroker``: ticks go into its queue table; ``OutboxBroker``: into the outbox.
        The other arguments are as for the constructor.
        """
        # The broker's Database is shared: close() leaves it open.
        backing = backing_of(broker, needed_by="Scheduler.from_broker()")
        return cls(
            database=backing.database,
            schema=backing.schema,
            target=backing.sends_to,
            registry=registry,
            batch_size=batch_size,
            poll_interval_ms=poll_interval_ms,
            clock=clock,
            lead_ms=lead_ms,
        )

    # -- sync ---------------------------------------------------------------------------------

    def sync(self) -> tuple[list[str], list[str]]:
        """Write the declared schedules to the table; disable the stored ones no longer declared.

        Returns (changed, disabled) names.  A process that declares no schedule does not sync
        (it has nothing to say), so a worker that imports none leaves the table alone.
        """
        declared = list(self.registry)
        if not declared:
            return [], []
        changed: list[str] = []
        with self.database.connection() as conn, conn.transaction():
            self._check(conn)
            # Syncs of one schema queue up here: concurrent start-ups never interleave upserts.
            conn.execute(
                _sql.query("schedule_sync_lock", self.schema), {"key": f"dramatiq_reliable.schedules:{self.schema}"}
            )
            now = self._now(conn).astimezone(dt.timezone.utc)
            stored = {
                row["name"]: row
                for row in conn.cursor(row_factory=dict_row)
                .execute(_sql.query("schedule_timing", self.schema), {"names": [s.name for s in declared]})
                .fetchall()
            }
            for item in declared:
                if self._sync_one(conn, item, now, stored.get(item.name)):
                    changed.append(item.name)
            # Every declared name, synced or not: a schedule that failed to sync keeps its row as it was.
            disabled = [
                row["name"]
                for row in conn.cursor(row_factory=dict_row)
                .execute(_sql.query("schedule_disable", self.schema), {"names": [s.name for s in declared]})
                .fetchall()
            ]
            if disabled:
                retract_ahead(conn, self.schema, disabled)
        if disabled:
            logger.warning("schedules no longer declared in code were disabled: %s", ", ".join(disabled))
        return changed, disabled

    def _sync_one(
        self, conn: psycopg.Connection[Any], item: Schedule, now: dt.datetime, stored: dict[str, Any] | None
    ) -> bool:
        """Upsert ``item``; True if its row changed.  A schedule that cannot be stored is logged and skipped.

        One bad schedule must not keep the process's other schedules from firing: its next fire
        time is computed before any SQL, and its upsert runs in a savepoint of its own.  A changed
        schedule's ticks written ahead under the old definition are taken back; when its timing
        is unchanged (``stored``, the row before, has the same hash) it is rewound to fire them
        again, with the new definition.
        """
        try:
            params = {
                "name": item.name,
                **item.definition(),
                "definition_hash": item.definition_hash(),
                "next_fire_at": item.next_after(now),
            }
        except Exception as error:  # a timing that cannot be computed (declared validation was bypassed)
            _log_unsynced(item, error)
            return False
        try:
            with conn.transaction():
                row = (
                    conn.cursor(row_factory=dict_row)
                    .execute(_sql.query("schedule_sync", self.schema), params)
                    .fetchone()
                )
                if row is not None:
                    first = retract_ahead(conn, self.schema, [item.name]).get(item.name)
                    timing_kept = (
                        stored is not None
                        and stored["enabled"]
                        and stored["definition_hash"] == params["definition_hash"]
                    )
                    if first is not None and timing_kept:
                        conn.execute(
                            _sql.query("schedule_rewind", self.schema), {"name": item.name, "first_fire_at": first}
                        )
        except (psycopg.DataError, psycopg.IntegrityError) as error:  # refused by the table; others go on
            _log_unsynced(item, error)
            return False
        return row is not None

    # -- one pass -----------------------------------------------------------------------------

    def tick_once(self, *, now: dt.datetime | None = None) -> SchedulerPass:
        """Claim due schedules and fire their ticks, all in one transaction.

        ``now`` overrides the database clock (tests of missed ticks and DST).
        """
        with self.database.connection() as conn, conn.transaction():
            self._check(conn)
            # In UTC: the session's TimeZone (or the clock's zone) must not turn shifts into wall-clock arithmetic.
            moment = (now if now is not None else self._now(conn)).astimezone(dt.timezone.utc)
            ahead_until = moment + dt.timedelta(milliseconds=self.lead_ms)
            rows = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    _sql.query("schedule_claim", self.schema),
                    {
                        "now": moment,
                        "ahead": ahead_until,
                        "batch_size": self.batch_size,
                    },
                )
                .fetchall()
            )
            if not rows:
                return SchedulerPass(0, 0, 0)
            fire = empty_ticks()
            advance: dict[str, list[Any]] = {
                k: [] for k in ("names", "next_fire_ats", "buffered_fire_ats", "last_fire_ats")
            }
            fired = skipped = 0
            stamp_ms = int(moment.timestamp() * 1000)
            for row in rows:
                item = Schedule.from_row(row)
                # Claimed ahead (overlap="allow", due within lead_ms): planned as at its fire
                # time, which fires exactly that one tick, not late, whatever the missed policy.
                # A row claimed for its buffered tick (overlap="buffer") is never written ahead.
                ahead = item.overlap == "allow" and moment < row["next_fire_at"] <= ahead_until
                decision = plan(
                    item,
                    next_fire_at=row["next_fire_at"],
                    buffered_fire_at=row["buffered_fire_at"],
                    busy=bool(row["busy"]),
                    now=row["next_fire_at"] if ahead else moment,
                )
                for fire_at in decision.fire:
                    message_id = tick_message_id(self.schema, item.name, fire_at)
                    # Written ahead: stamped with its fire time, so max_age counts from when it is due.
                    stamp = int(fire_at.timestamp() * 1000) if ahead else stamp_ms
                    body = tick_message(item, fire_at, message_id, stamp).encode()
                    add_tick(
                        fire,
                        item,
                        fire_at,
                        message_id,
                        "enqueued",
                        "ahead" if ahead else None,
                        body,
                        available_at=fire_at if ahead else None,
                    )
                    fired += 1
                for fire_at, reason in decision.skipped:
                    add_tick(
                        fire, item, fire_at, tick_message_id(self.schema, item.name, fire_at), "skipped", reason, b""
                    )
                    skipped += 1
                    events.emit(ScheduleTickSkipped(item.name, fire_at.isoformat(), reason))
                if decision.missed_first is not None and decision.missed_last is not None:
                    events.emit(
                        ScheduleTicksMissed(
                            item.name, decision.missed_first.isoformat(), decision.missed_last.isoformat(), item.missed
                        )
                    )
                advance["names"].append(item.name)
                advance["next_fire_ats"].append(decision.next_fire_at)
                advance["buffered_fire_ats"].append(decision.buffered_fire_at)
                advance["last_fire_ats"].append(decision.fire[-1] if decision.fire else None)
            if fire["names"]:
                if self.target == "queue":
                    conn.execute(_sql.query("schedule_fire_queue", self.schema), fire)
                else:
                    del fire["priorities"]
                    conn.execute(_sql.query("schedule_fire", self.schema), fire)
                    if fired:
                        # One NOTIFY per pass, delivered with its commit: ticks fire on time
                        # even when the relays' idle poll is long.
                        wake_relays(conn, schema=self.schema)
            conn.execute(_sql.query("schedule_advance", self.schema), advance)
        return SchedulerPass(len(rows), fired, skipped)

    def close(self) -> None:
        """Close the pool this scheduler created from a URL (not a shared one)."""
        if self._owns_database:
            self.database.close()

    def _check(self, conn: psycopg.Connection[Any]) -> None:
        if not self._checked:
            schema.ensure_ready(conn, schema=self.schema, required=schema.SCHEDULER_VERSION, feature="scheduler")
            self._checked = True

    # -- the loop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to return after the pass in hand; safe from signal handlers."""
        self._stop.set()

    def run(self, *, sync: bool = True, on_pass: Callable[[SchedulerPass], None] | None = None) -> None:
        """Sync (once), then fire due ticks until :meth:`stop`.  Outages are logged and waited out.

        ``on_pass`` is called with each pass's result (the command logs from it).
        """
        failures = 0
        synced = not sync
        logger.info("scheduler started on schema %r", self.schema)
        while not self._stop.is_set():
            try:
                if not synced:
                    self.sync()
                    synced = True
                result = self.tick_once()
                failures = 0
                if on_pass is not None:
                    on_pass(result)
                if result.claimed >= self.batch_size:
                    continue
                self._wait(self._sleep_s())
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout, SchemaNotReady) as error:
                failures += 1
                delay = min(30.0, 0.2 * 2 ** min(failures, 8)) * random.uniform(0.5, 1)
                self._checked = False
                logger.warning(
                    "scheduler cannot fire ticks (%s: %s); retrying in %.1fs",
                    type(error).__name__,
                    first_line(error),
                    delay,
                )
                self._wait(delay)
            except Exception:
                failures += 1
                delay = min(30.0, 0.2 * 2 ** min(failures, 8))
                logger.exception("scheduler failed unexpectedly; retrying in %.1fs", delay)
                self._wait(delay)
        logger.info("scheduler stopped")

    def _sleep_s(self) -> float:
        with self.database.connection() as conn:
            now = self.clock.now() if self.clock is not None else None
            row = (
                conn.cursor(row_factory=dict_row)
                .execute(_sql.query("schedule_next_due", self.schema), {"now": now, "lead_ms": self.lead_ms})
                .fetchone()
            )
            conn.rollback()
        if row is None or row["due_in_ms"] is None:
            return self.poll_interval_s
        if row["buffered"]:  # a buffered tick waits for a run to end: look again soon
            return min(self.poll_interval_s, 0.5)
        return max(0.0, min(self.poll_interval_s, int(row["due_in_ms"]) / 1000))

    def _wait(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.wait(seconds, self._stop)
        else:
            self._stop.wait(seconds)

    def _now(self, conn: psycopg.Connection[Any]) -> dt.datetime:
        """The time that decides what is due: the clock given, else the database's."""
        if self.clock is not None:
            return self.clock.now()
        row = conn.cursor(row_factory=dict_row).execute(_sql.query("schedule_clock", self.schema)).fetchone()
        assert row is not None
        return row["now"]  # type: ignore[no-any-return]


def tick_message(item: Schedule, fire_at: dt.datetime, message_id: str, timestamp_ms: int) -> Message[Any]:
    """The message of one tick of ``item``: its options name the schedule and the fire time (``ScheduleRuns`` reads them)."""
    return Message(
        queue_name=item.queue_name,
        actor_name=item.actor_name,
        args=item.args,
        kwargs=item.kwargs,
        options={**item.options, "schedule": item.name, "schedule_fire_at": fire_at.isoformat()},
        message_id=message_id,
        message_timestamp=timestamp_ms,
    )


def empty_ticks() -> dict[str, list[Any]]:
    """The parameters of schedule_fire(_queue).sql, one list per column, filled by :func:`add_tick`."""
    return {
        k: []
        for k in (
            "names",
            "fire_ats",
            "message_ids",
            "states",
            "reasons",
            "queue_names",
            "actor_names",
            "bodies",
            "priorities",
            "available_ats",
        )
    }


def add_tick(
    fire: dict[str, list[Any]],
    item: Schedule,
    fire_at: dt.datetime,
    message_id: str,
    state: str,
    reason: str | None,
    body: bytes,
    *,
    available_at: dt.datetime | None = None,
) -> None:
    fire["names"].append(item.name)
    fire["fire_ats"].append(fire_at)
    fire["message_ids"].append(message_id)
    fire["states"].append(state)
    fire["reasons"].append(reason)
    fire["queue_names"].append(q_name(item.queue_name))
    fire["actor_names"].append(item.actor_name)
    fire["bodies"].append(body)
    fire["available_ats"].append(available_at)  # None: due now
    priority = item.options.get("broker_priority")
    fire["priorities"].append(priority if is_int(priority) else 0)


def retract_ahead(conn: psycopg.Connection[Any], schema_name: str, names: list[str]) -> dict[str, dt.datetime]:
    """Take back the not-yet-due ticks written ahead of ``names``; return each one's earliest retracted fire time.

    Runs in the caller's transaction, which holds (or changes) the schedules' rows: a loop
    writing ahead holds the row until its commit, so nothing is written ahead after this.
    """
    rows = (
        conn.cursor(row_factory=dict_row)
        .execute(_sql.query("schedule_retract_ahead", schema_name), {"names": names})
        .fetchall()
    )
    return {row["schedule_name"]: row["first_fire_at"] for row in rows}


def _log_unsynced(item: Schedule, error: BaseException) -> None:
    logger.error(
        "schedule %r was not synced and keeps its stored row, if any (%s: %s); the other schedules were synced. "
        "Fix its declaration and restart",
        item.name,
        type(error).__name__,
        redact(first_line(error)),
    )
