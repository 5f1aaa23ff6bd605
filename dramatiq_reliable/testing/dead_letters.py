"""An in-memory dead-letter store, for unit tests of actors under Dramatiq's ``StubBroker``.

>>> from dramatiq_reliable.testing import InMemoryDeadLetterStore
>>> store = InMemoryDeadLetterStore()
>>> broker = StubBroker(middleware=[DeadLetters(store=store), ClassifiedRetries(max_retries=0)])  # doctest: +SKIP
>>> ...  # run the worker; a failing job lands in store
>>> store.list().items[0].reason                                                                  # doctest: +SKIP
'retries_exhausted'

It keeps rows in a dict with the Postgres store's semantics where a test can see them (one
``dead`` row per message id, refreshed on a second capture; replays mark rows ``replayed`` and,
given ``broker=``, enqueue the message again with its message id and options minus
:data:`~dramatiq_reliable.dead_letters.RESET_OPTIONS`).  Thread-safe.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dramatiq.broker import Broker
from dramatiq.message import Message

from ..dead_letters.analysis import Failure
from ..dead_letters.cursor import decode_cursor, encode_cursor
from ..dead_letters.records import (
    DEFAULT_REPLAY_MAX_AGE_MS,
    DEFAULT_RETENTION_MS,
    RESET_OPTIONS,
    UNSET,
    DeadLetter,
    DeadLetterCount,
    DeadLetterFilter,
    DeadLetterGroup,
    DeadLetterPage,
    DiscardResult,
    PurgeResult,
    ReplayResult,
    State,
)
from ..dead_letters.validators import (
    check_by,
    check_filter,
    check_id,
    check_ids,
    check_limit,
    check_state,
    check_target,
)

__all__ = ["InMemoryDeadLetterStore"]

_UTC = datetime.timezone.utc


def _now() -> datetime.datetime:
    return datetime.datetime.now(_UTC)


def _from_ms(ms: int | None) -> datetime.datetime | None:
    return None if ms is None else datetime.datetime.fromtimestamp(ms / 1000, tz=_UTC)


class InMemoryDeadLetterStore:
    """A :class:`~dramatiq_reliable.dead_letters.DeadLetterStore` in a dict (see the module docstring)."""

    def __init__(
        self,
        *,
        broker: Broker | None = None,
        replay_max_age_ms: int | None = DEFAULT_REPLAY_MAX_AGE_MS,
        retention_ms: int | None = DEFAULT_RETENTION_MS,
    ) -> None:
        self.broker = broker
        self.replay_max_age_ms = replay_max_age_ms
        self.retention_ms = retention_ms
        self.rows: dict[int, DeadLetter] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    # -- writing -------------------------------------------------------------------------------

    def save(self, failure: Failure, *, timeout_ms: int) -> DeadLetter:
        with self._lock:
            now = _now()
            dead = [row for row in self.rows.values() if row.message_id == failure.message_id and row.state == "dead"]
            fields = self._fields(failure, now)
            if dead:
                old = dead[0]
                fields.update(
                    sent_at=old.sent_at,
                    attempts=max(old.attempts, failure.attempts),
                    first_failed_at=min(old.first_failed_at, fields["first_failed_at"]),
                    captures=old.captures + 1,
                )
                row = dataclasses.replace(old, **fields)
            else:
                row = DeadLetter(id=self._take_id(), state="dead", **fields)
            self.rows[row.id] = row
            return row

    def save_imported(self, failure: Failure, *, after_id: int) -> int | None:
        with self._lock:
            if any(row.message_id == failure.message_id and row.id > after_id for row in self.rows.values()):
                return None
            if any(row.message_id == failure.message_id and row.state == "dead" for row in self.rows.values()):
                return None
            row = DeadLetter(id=self._take_id(), state="dead", **self._fields(failure, _now()))
            self.rows[row.id] = row
            return row.id

    def _take_id(self) -> int:
        taken, self._next_id = self._next_id, self._next_id + 1
        return taken

    @staticmethod
    def _fields(failure: Failure, now: datetime.datetime) -> dict[str, Any]:
        first = _from_ms(failure.first_failed_ms)
        return {
            "message_id": failure.message_id,
            "queue_name": failure.queue_name,
            "actor_name": failure.actor_name,
            "error_type": failure.error_type,
            "error_message": failure.error_message,
            "attempts": failure.attempts,
            "reason": failure.reason,
            "http_status": failure.http_status,
            "fingerprint": failure.fingerprint,
            "culprit": failure.culprit,
            "sent_at": _from_ms(failure.sent_ms) or now,
            "first_failed_at": min(first, now) if first else now,
            "last_failed_at": now,
            "worker_host": socket.gethostname(),
            "worker_pid": os.getpid(),
            "message": json.loads(failure.message_json),
            "traceback": failure.traceback,
            "retry_decision": failure.retry_decision,
        }

    def check_ready(self) -> None:
        return None

    def close(self) -> None:
        return None

    # -- reading -------------------------------------------------------------------------------

    def _matching(
        self, where: DeadLetterFilter, ids: Sequence[int] | None = None, state: State | None = "dead"
    ) -> list[DeadLetter]:
        def matches(row: DeadLetter) -> bool:
            return (
                (state is None or row.state == state)
                and (ids is None or row.id in ids)
                and all(
                    getattr(where, name) is None or getattr(row, name) == getattr(where, name)
                    for name in ("actor_name", "queue_name", "error_type", "fingerprint")
                )
                and (where.since is None or row.last_failed_at >= where.since)
                and (where.until is None or row.last_failed_at < where.until)
            )

        with self._lock:
            return sorted(
                (row for row in self.rows.values() if matches(row)),
                key=lambda r: (r.last_failed_at, r.id),
                reverse=True,
            )

    def get(self, dead_letter_id: int) -> DeadLetter | None:
        check_id(dead_letter_id)
        with self._lock:
            return self.rows.get(dead_letter_id)

    def list(
        self,
        *,
        where: DeadLetterFilter | None = None,
        state: State | None = "dead",
        limit: int = 50,
        cursor: str | None = None,
    ) -> DeadLetterPage:
        check_state(state)
        check_limit(limit)
        before_at, before_id = decode_cursor(cursor)
        rows = self._matching(check_filter(where), state=state)
        if before_at is not None and before_id is not None:
            rows = [row for row in rows if (row.last_failed_at, row.id) < (before_at, before_id)]
        items = tuple(rows[:limit])
        next_cursor = encode_cursor(items[-1].last_failed_at, items[-1].id) if len(items) == limit else None
        return DeadLetterPage(items, next_cursor)

    def count(
        self, *, where: DeadLetterFilter | None = None, ids: Sequence[int] | None = None, state: State | None = "dead"
    ) -> int:
        return len(self._matching(check_filter(where), check_ids(ids), check_state(state)))

    def stats(self, *, where: DeadLetterFilter | None = None, limit: int = 20) -> tuple[DeadLetterGroup, ...]:
        check_limit(limit)
        groups: dict[str, list[DeadLetter]] = {}
        for row in self._matching(check_filter(where)):
            groups.setdefault(row.fingerprint, []).append(row)
        result = [
            DeadLetterGroup(
                fingerprint=key,
                count=len(rows),
                actors=len({row.actor_name for row in rows}),
                first_failed_at=min(row.first_failed_at for row in rows),
                last_failed_at=max(row.last_failed_at for row in rows),
                error_type=rows[0].error_type,
                culprit=rows[0].culprit,
                actor_name=rows[0].actor_name,
                queue_name=rows[0].queue_name,
                error_message=rows[0].error_message[:500],
                latest_id=max(row.id for row in rows),
            )
            for key, rows in groups.items()
        ]
        result.sort(key=lambda group: (group.count, group.last_failed_at), reverse=True)
        return tuple(result[:limit])

    def counts(self) -> tuple[DeadLetterCount, ...]:
        groups: dict[tuple[str, str | None], list[DeadLetter]] = {}
        for row in self._matching(DeadLetterFilter()):
            groups.setdefault((row.actor_name, row.error_type), []).append(row)
        return tuple(
            sorted(
                (
                    DeadLetterCount(
                        actor,
                        error,
                        len(rows),
                        min(r.last_failed_at for r in rows),
                        max(r.last_failed_at for r in rows),
                    )
                    for (actor, error), rows in groups.items()
                ),
                key=lambda count: -count.count,
            )
        )

    # -- replay, discard, purge ----------------------------------------------------------------

    def _too_old(self, row: DeadLetter, max_age_ms: int | None) -> bool:
        return max_age_ms is not None and row.sent_at < _now() - datetime.timedelta(milliseconds=max_age_ms)

    def replay_preview(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        force: bool = False,
        max_age_ms: Any = UNSET,
    ) -> tuple[int, int]:
        limit = self.replay_max_age_ms if max_age_ms is UNSET else max_age_ms
        rows = self._matching(check_filter(where), check_ids(ids))
        return len(rows), 0 if force else sum(self._too_old(row, limit) for row in rows)

    def replay(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        queue_name: str | None = None,
        delay_ms: int | None = None,
        force: bool = False,
        max_age_ms: Any = UNSET,
        by: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayResult:
        id_list, where = check_target(ids, where, "replay")
        limit = None if force else (self.replay_max_age_ms if max_age_ms is UNSET else max_age_ms)
        handled_by = check_by(by)
        replayed, too_old, problems = 0, 0, {}
        known = set(self.rows)
        for row in reversed(self._matching(where, id_list)):
            if self._too_old(row, limit):
                too_old += 1
                problems[row.id] = "first sent too long ago; pass force to replay it, or discard it"
                continue
            target = queue_name or row.queue_name
            with self._lock:
                self.rows[row.id] = dataclasses.replace(
                    row, state="replayed", handled_at=_now(), handled_by=handled_by, replayed_to=target
                )
            replayed += 1
            if self.broker is not None:
                body = dict(row.message or {})
                options = {key: value for key, value in (body.get("options") or {}).items() if key not in RESET_OPTIONS}
                options["replay_of"] = {"dead_letter_id": row.id, "sent_at_ms": int(row.sent_at.timestamp() * 1000)}
                message: Message[Any] = Message(
                    queue_name=target,
                    actor_name=row.actor_name,
                    args=tuple(body.get("args") or ()),
                    kwargs=dict(body.get("kwargs") or {}),
                    options=options,
                    message_id=row.message_id,
                    message_timestamp=int(time.time() * 1000),
                )
                self.broker.enqueue(message, delay=delay_ms)
        for dead_letter_id in id_list or ():
            if dead_letter_id not in known:
                problems[dead_letter_id] = "not found"
            elif dead_letter_id not in problems and self.rows[dead_letter_id].state != "replayed":
                problems[dead_letter_id] = f"already {self.rows[dead_letter_id].state}"
        if progress is not None and replayed:
            progress(replayed, replayed)
        return ReplayResult(replayed, too_old if id_list is None else 0, problems if id_list is not None else {})

    def discard(
        self,
        *,
        ids: Sequence[int] | None = None,
        where: DeadLetterFilter | None = None,
        note: str | None = None,
        by: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DiscardResult:
        id_list, where = check_target(ids, where, "discard")
        handled_by = check_by(by)
        rows = self._matching(where, id_list)
        with self._lock:
            for row in rows:
                self.rows[row.id] = dataclasses.replace(
                    row, state="discarded", handled_at=_now(), handled_by=handled_by, note=note
                )
        problems: dict[int, str] = {}
        for dead_letter_id in id_list or ():
            found = self.rows.get(dead_letter_id)
            if found is None:
                problems[dead_letter_id] = "not found"
            elif dead_letter_id not in {row.id for row in rows}:
                problems[dead_letter_id] = f"already {found.state}"
        if progress is not None and rows:
            progress(len(rows), len(rows))
        return DiscardResult(len(rows), problems)

    def purge(self, *, older_than_ms: Any = UNSET, handled_older_than_ms: int | None = 0) -> PurgeResult:
        older = self.retention_ms if older_than_ms is UNSET else older_than_ms
        now = _now()
        dead = handled = 0
        with self._lock:
            for row in list(self.rows.values()):
                if row.state == "dead":
                    if older is not None and row.last_failed_at < now - datetime.timedelta(milliseconds=older):
                        del self.rows[row.id]
                        dead += 1
                elif (
                    handled_older_than_ms is not None
                    and row.handled_at is not None
                    and row.handled_at <= now - datetime.timedelta(milliseconds=handled_older_than_ms)
                ):
                    del self.rows[row.id]
                    handled += 1
        return PurgeResult(dead, handled)
