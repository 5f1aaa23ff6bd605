"""Concurrency per key: at most N runs of a key at once across every worker, a full key's jobs parked in Postgres.

This generalises :class:`~dramatiq_reliable.Singleton` (N = 1) with the same lease rules: a run
takes a *slot row* (its fencing token is the slot's identity), a heartbeat renews it, a killed
worker's slot lapses ``lease_ms`` later.  Where the singleton postpones a held key's message
through the broker, a full key here *parks* it: the message is stored in ``concurrency_parked``
and acked, and the run that frees a slot sends the key's oldest parked message again in the
transaction that frees it.  Parking and freeing take the same per-key lock, so a message never
parks just after the release that should have woken it.

Why parking rather than postponing with a delay: a postponed message comes back every delay to
find the key still full, and a tenant with 10,000 jobs keeps 10,000 messages cycling through
the queue in front of a tenant with 3.  A parked message leaves the queue after one cheap
statement; each key's parked messages come back only through that key's own freed slots, one
per slot, oldest first.  So a big key holds at most N worker threads and at most N of its
messages are in the queue at a time: any other key's jobs are behind at most one pass over the
big key's arrivals, never behind its backlog.  That is the round-robin between keys, and the
limit is what bounds each key's share of the fleet.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import SkipMessage
from psycopg.rows import dict_row

from .. import _sql, events
from .._checks import is_int
from ..errors import ActorOptionError
from ._keyed import (
    KeyedMiddleware,
    check_key_option,
    derive_key,
    fail_closed,
    parked_body,
    parked_priority,
    parked_queue,
)

__all__ = ["ConcurrencyLimit", "ConcurrencyParked", "concurrency_waiting"]

_OPTIONS = frozenset({"concurrency_limit", "concurrency_limit_key"})
# How many keys with lapsed slots one heartbeat sweeps.
_SWEEP_LIMIT = 100


@dataclasses.dataclass(frozen=True)
class ConcurrencyParked(events.Event):
    """A job found its key running ``limit`` jobs already and was parked until a slot frees."""

    name = "concurrency.parked"
    actor_name: str
    message_id: str
    key: str
    limit: int


@dataclasses.dataclass
class _Slot:
    key: str
    token: int
    message_id: str


_current: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("dramatiq_reliable_slot", default=None)


class ConcurrencyLimit(KeyedMiddleware[_Slot]):
    """At most ``concurrency_limit`` runs per key at once, across every worker and host.

    Actor options:
      concurrency_limit: how many runs of one key may overlap (an int >= 1).
      concurrency_limit_key: a callable over the actor's arguments giving the key, e.g.
        ``lambda tenant_id, *_: f"tenant-{tenant_id}"``; default the actor's name (the limit is
        then the actor's, fleet-wide).  Distinct from the singleton's ``concurrency_key``.

    Parameters:
      database, schema: where the tables live; default the broker's (an ``OutboxBroker`` or a
        ``PostgresBroker``: a woken message is sent again as a row of its outbox or queue table).
      lease_ms: how long a slot outlives a holder that stopped renewing it (a killed worker);
        the heartbeat renews every ``lease_ms / 3``.

    A job whose key is full is parked in Postgres (not failed, not a retry, no thread held) and
    sent again when a run of its key ends, oldest first per key.  A key function that raises or
    returns no usable string fails closed: the job does not run and is dead-lettered
    (``message.fail()``).  Postgres down while taking a slot: the job does not run and
    ``DatabaseUnavailable`` lets the retries retry it.  Put it before :class:`OrderedKeys` and
    ``Idempotency``:

    >>> broker.add_middleware(ConcurrencyLimit())  # doctest: +SKIP
    """

    label = "ConcurrencyLimit"
    option = "concurrency_limit"
    renew_query = "concurrency_renew"

    @property
    def actor_options(self) -> set[str]:
        return set(_OPTIONS)

    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        name = actor.actor_name
        limit = actor.options.get("concurrency_limit")
        check_key_option(actor, "concurrency_limit_key", "lambda tenant_id, *_: f'tenant-{tenant_id}'")
        if limit is None:
            if actor.options.get("concurrency_limit_key") is not None:
                raise ActorOptionError(
                    f"actor {name!r} sets concurrency_limit_key but no concurrency_limit; add e.g. concurrency_limit=5"
                )
            return
        if not is_int(limit) or limit < 1:
            raise ActorOptionError(
                f"actor {name!r}: concurrency_limit must be an int >= 1, got {limit!r}; write e.g. concurrency_limit=5"
            )
        self.database_for(broker)

    def key_for(self, actor: dramatiq.Actor[Any, Any], message: MessageProxy) -> str | None:
        """The key of ``message``, or ``None`` when its actor has no limit (``ActorOptionError`` when the
        key function fails)."""
        if actor.options.get("concurrency_limit") is None:
            return None
        derive = actor.options.get("concurrency_limit_key")
        return actor.actor_name if derive is None else derive_key(derive, "concurrency_limit_key", message)

    def lock_name(self, schema: str, key: str) -> str:
        """The per-key lock that parking and freeing share (prefix + key, as the sweep builds it)."""
        return f"{_lock_prefix(schema)}{key}"

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        _current.set(None)
        try:
            actor = broker.get_actor(message.actor_name)
        except ActorNotFound:
            return
        try:
            key = self.key_for(actor, message)
        except ActorOptionError as error:
            fail_closed(message, error)
        if key is None:
            return
        limit = int(actor.options["concurrency_limit"])
        _, schema, _ = self.database_for(broker)
        params = {
            "lock": self.lock_name(schema, key),
            "key": key,
            "limit": limit,
            "message_id": message.message_id,
            "actor_name": message.actor_name,
            "owner": self.owner,
            "lease_ms": self.lease_ms,
            "queue_name": parked_queue(message),
            "body": parked_body(message),
            "priority": parked_priority(message),
        }
        row = self._take(broker, "concurrency_take", params, f"take a slot of {key!r} for {message.message_id!r}")
        if row["token"] is None:
            # Parked durably first, acked after (SkipMessage): a crash in between duplicates, never loses.
            events.emit(ConcurrencyParked(message.actor_name, message.message_id, key, limit))
            raise SkipMessage(f"concurrency key {key!r} runs {limit} jobs; the message was parked")
        slot = _Slot(key, int(row["token"]), message.message_id)
        self._held.hold(slot)
        _current.set(slot)

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        self._release(broker, message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._release(broker, message)

    def _release(self, broker: Broker, message: MessageProxy) -> None:
        slot = _current.get()
        if slot is None or slot.message_id != message.message_id:
            return
        _current.set(None)
        _, schema, _ = self.database_for(broker)
        params = {"lock": self.lock_name(schema, slot.key), "key": slot.key, "token": slot.token}
        self._free(broker, "concurrency_release", params, f"the concurrency slot {slot.key!r} of {slot.message_id}")

    def sweep(self, broker: Broker) -> int:
        """Hand the places of lapsed slots (killed workers) to parked messages; returns how many were sent."""
        _, schema, _ = self.database_for(broker)
        return self._sweep(broker, "concurrency_sweep", {"lock_prefix": _lock_prefix(schema), "limit": _SWEEP_LIMIT})


def _lock_prefix(schema: str) -> str:
    return f"dramatiq_reliable.concurrency:{schema}:"


def concurrency_waiting(conn: psycopg.Connection[Any], *, schema: str, limit: int = 20) -> list[dict[str, Any]]:
    """The keys with parked jobs, most first: ``key``, ``parked``, ``running``, ``oldest_parked_at``."""
    cursor = conn.cursor(row_factory=dict_row)
    return cursor.execute(_sql.query("concurrency_waiting", _sql.validate_schema(schema)), {"limit": limit}).fetchall()
