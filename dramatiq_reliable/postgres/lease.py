"""Leases: the rows a process holds, their heartbeat, and acks written in batches.

A claimed row is hidden until its lease runs out.  While the process lives, one heartbeat
thread extends every lease it holds, so a job may run for longer than the lease; once the
process dies (``kill -9``, a lost node) nothing extends them and the rows become visible to
the other consumers when the lease ends: a crash loses nothing, it delays.

Acks are written in batches: a worker thread that acks while another thread's ``DELETE`` is
in flight leaves its row to that thread, which loops until nothing is pending.  An ack that
cannot be written (Postgres down) stays pending and is retried by the heartbeat; if the
process dies first, the row is redelivered after its lease (at least once, never zero).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import psycopg
from psycopg_pool import PoolTimeout

from .._util import first_line
from ..database import Database
from . import queue

__all__ = []

logger = logging.getLogger("dramatiq_reliable.postgres")


class Held(NamedTuple):
    """A row this process holds: the lease token it holds it by, and its queue."""

    lease: int
    queue_name: str


class Ack(NamedTuple):
    """An ack waiting to be written: the row, the lease it was held by, and its queue."""

    row_id: int
    lease: int
    queue_name: str


class Leases:
    """Held rows of one broker, keyed by row id."""

    def __init__(
        self,
        database: Database,
        schema: str,
        *,
        lease_ms: int,
        heartbeat_ms: int,
        on_release: Callable[[str], None],
        housekeeping: Callable[[psycopg.Connection[Any]], None] | None = None,
        housekeeping_ms: int = 300_000,
    ) -> None:
        self.database = database
        self.schema = schema
        self.lease_ms = lease_ms
        self.heartbeat_ms = heartbeat_ms
        self._on_release = on_release
        self._housekeeping = housekeeping
        self._housekeeping_ms = housekeeping_ms
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._per_queue: dict[str, int] = {}
        self._acks: list[Ack] = []
        self._flushing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- bookkeeping ----------------------------------------------------------------------------

    def hold(self, queue_name: str, rows: list[queue.ClaimedRow]) -> None:
        with self._lock:
            for row in rows:
                self._held[row.id] = Held(row.lease, queue_name)
            self._per_queue[queue_name] = self._per_queue.get(queue_name, 0) + len(rows)
        self.start()

    def held_count(self, queue_name: str) -> int:
        """Rows of ``queue_name`` claimed and not yet acked, nacked or released (prefetch in use)."""
        with self._lock:
            return self._per_queue.get(queue_name, 0)

    def forget(self, row_id: int) -> None:
        """Stop holding ``row_id`` (its fate was settled elsewhere: a retry in place, a nack)."""
        with self._lock:
            held = self._held.pop(row_id, None)
            if held is not None:
                self._per_queue[held.queue_name] -= 1
        if held is not None:
            self._on_release(held.queue_name)

    # -- acks -----------------------------------------------------------------------------------

    def ack(self, row_id: int, lease: int, queue_name: str) -> None:
        """Queue the ack of a row and write every pending ack unless another thread is writing."""
        with self._lock:
            self._acks.append(Ack(row_id, lease, queue_name))
            if self._flushing:
                return
            self._flushing = True
        self._flush_loop()

    def flush(self) -> None:
        """Write pending acks now (the heartbeat calls this; so does shutdown)."""
        with self._lock:
            if self._flushing or not self._acks:
                return
            self._flushing = True
        self._flush_loop()

    def _flush_loop(self) -> None:
        while True:
            with self._lock:
                batch, self._acks = self._acks, []
                if not batch:
                    self._flushing = False
                    return
            try:
                with self.database.autocommit() as conn:
                    queue.ack(conn, self.schema, [(ack.row_id, ack.lease) for ack in batch])
            except (psycopg.Error, PoolTimeout) as error:
                with self._lock:
                    self._acks[:0] = batch
                    self._flushing = False
                logger.warning(
                    "could not ack %d message(s) in Postgres (%s: %s); the heartbeat retries, and the rows "
                    "come back after their lease if this process stops first",
                    len(batch),
                    type(error).__name__,
                    first_line(error),
                )
                return
            for ack in batch:
                self.forget(ack.row_id)

    # -- heartbeat ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dramatiq-reliable-lease-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.flush()

    def beat(self) -> int:
        """Extend every lease held now; the number of rows still held by this process."""
        with self._lock:
            held = [(row_id, entry.lease) for row_id, entry in self._held.items()]
        if not held:
            return 0
        with self.database.autocommit() as conn:
            return queue.heartbeat(conn, self.schema, held, lease_ms=self.lease_ms)

    def _run(self) -> None:
        next_housekeeping = time.monotonic() + self._housekeeping_ms / 1000
        while not self._stop.wait(self.heartbeat_ms / 1000):
            try:
                self.flush()
                self.beat()
                if self._housekeeping is not None and time.monotonic() >= next_housekeeping:
                    next_housekeeping = time.monotonic() + self._housekeeping_ms / 1000
                    with self.database.autocommit() as conn:
                        self._housekeeping(conn)
            except (psycopg.Error, PoolTimeout) as error:
                logger.warning(
                    "lease heartbeat failed (%s); held messages become visible to other workers if this lasts "
                    "past the lease (%d ms)",
                    type(error).__name__,
                    self.lease_ms,
                )
            except Exception:
                logger.exception("lease heartbeat failed")
