"""The schedules a process declares in code, collected in a registry that the scheduler syncs to Postgres."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import ConfigurationError
from .spec import Missed, Overlap, Schedule

__all__ = ["Registry", "default_registry", "schedule"]


class Registry:
    """The schedules declared by this process, by name.

    Declaring the same name twice with another definition is refused: two modules would
    otherwise fight over one row.  The module-level :data:`default_registry` is what
    :func:`schedule` fills and what the scheduler syncs unless given another.
    """

    def __init__(self) -> None:
        self._schedules: dict[str, Schedule] = {}
        self._lock = threading.Lock()

    def add(self, item: Schedule) -> Schedule:
        """Register ``item``; the same definition again is a no-op (a module imported twice)."""
        if not isinstance(item, Schedule):
            raise ConfigurationError(f"Registry.add() takes a Schedule, got {type(item).__name__!r}")
        with self._lock:
            known = self._schedules.get(item.name)
            if known is not None and known != item:
                raise ConfigurationError(
                    f"schedule {item.name!r} is declared twice with different definitions; give one of them another name"
                )
            self._schedules[item.name] = item
        return item

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests); the next sync disables its row."""
        with self._lock:
            self._schedules.pop(name, None)

    def clear(self) -> None:
        with self._lock:
            self._schedules.clear()

    def __iter__(self) -> Iterator[Schedule]:
        with self._lock:
            return iter(list(self._schedules.values()))

    def __len__(self) -> int:
        return len(self._schedules)

    def __contains__(self, name: object) -> bool:
        return name in self._schedules

    def get(self, name: str) -> Schedule | None:
        return self._schedules.get(name)


#: The registry :func:`schedule` adds to.
default_registry = Registry()


def schedule(
    name: str,
    *,
    actor: Any,
    cron: str | None = None,
    every_ms: int | None = None,
    tz: str = "UTC",
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    queue_name: str | None = None,
    missed: Missed = "skip",
    misfire_grace_ms: int = 60_000,
    backfill_window_ms: int = 86_400_000,
    overlap: Overlap = "skip",
    stale_after_ms: int = 86_400_000,
    registry: Registry | None = None,
) -> Schedule:
    """Declare that ``actor`` is sent on a timetable, and register it for the scheduler to sync.

    >>> schedule("nightly-sync", cron="0 3 * * *", tz="Europe/Berlin", actor=sync_orders)  # doctest: +SKIP

    Parameters:
      name: the schedule's stable identity (its row, its ticks' message ids); renaming it makes a new schedule.
      actor: the Dramatiq actor to send (or its name, with ``queue_name=``).
      cron / every_ms: a cron expression read in ``tz`` (five fields, or six with seconds), or a
        fixed interval of at least 1000 ms aligned to the epoch.  Exactly one.
      tz: the IANA time zone the cron expression is read in; see the module docs for DST.
      args, kwargs, options: the message's arguments and message options (JSON values).
      missed: what to do with ticks more than ``misfire_grace_ms`` late (the scheduler was down):
        ``"skip"`` (default) drops them and waits for the next tick, ``"once"`` runs one for all
        of them (the latest), ``"backfill"`` runs each one no older than ``backfill_window_ms``.
      misfire_grace_ms: how late a tick may fire and still count as on time (default 60 s).
      overlap: a tick due while the schedule's previous run is queued or running: ``"skip"``
        (default) records it as skipped, ``"buffer"`` keeps one to run when the previous run ends,
        ``"allow"`` sends it anyway.
      stale_after_ms: a run that has not finished after this long (a lost message) stops blocking.
      registry: where to register (default :data:`default_registry`).
    """
    if isinstance(actor, str):
        if queue_name is None:
            raise ConfigurationError(
                f"schedule {name!r}: actor={actor!r} is a name, so pass queue_name= too (or pass the actor itself)"
            )
        actor_name = actor
    else:
        found = getattr(actor, "actor_name", None)
        if not isinstance(found, str):
            raise ConfigurationError(
                f"schedule {name!r}: actor must be a Dramatiq actor or an actor name, got {type(actor).__name__!r}"
            )
        actor_name = found
        queue_name = queue_name or actor.queue_name
    if not isinstance(queue_name, str) or not queue_name:
        raise ConfigurationError(f"schedule {name!r}: queue_name must be a non-empty string, got {queue_name!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ConfigurationError(f"schedule {name!r}: args must be a list or tuple, got {args!r}")
    item = Schedule(
        name=name,
        actor_name=actor_name,
        queue_name=queue_name,
        cron=cron,
        every_ms=every_ms,
        tz=tz,
        args=tuple(args),
        kwargs=dict(kwargs or {}),
        options=dict(options or {}),
        missed=missed,
        misfire_grace_ms=misfire_grace_ms,
        backfill_window_ms=backfill_window_ms,
        overlap=overlap,
        stale_after_ms=stale_after_ms,
    )
    return (registry if registry is not None else default_registry).add(item)
