"""A scheduler loop inside each worker process, so a small deployment needs no scheduler process."""

from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Middleware
from dramatiq.broker import Broker

from .._checks import check_int, check_ms
from ..errors import ReliableError
from .loop import Scheduler
from .registry import Registry

__all__ = ["WorkerScheduler"]

logger = logging.getLogger("dramatiq_reliable.scheduler")


class WorkerScheduler(Middleware):
    """Runs a :class:`Scheduler` loop thread in every worker process.

    Any number of loops may run (SKIP LOCKED and the tick's primary key make each tick fire
    once), so every worker process running one is safe.  The thread syncs the declared schedules
    at boot, then fires due ticks into the outbox (``OutboxBroker``) or the queue table
    (``PostgresBroker``), and stops at shutdown within ``stop_timeout_ms``: a pass cut short
    there rolls back, and another loop fires its ticks.

    Parameters:
      stop_timeout_ms: how long worker shutdown waits for the pass in hand.
      registry, batch_size, poll_interval_ms, lead_ms: as for :class:`Scheduler`; database,
        schema and target come from the broker (``Scheduler.from_broker``).

    >>> broker.add_middleware(WorkerScheduler())      # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        stop_timeout_ms: int = 10_000,
        registry: Registry | None = None,
        batch_size: int = 500,
        poll_interval_ms: int = 1000,
        lead_ms: int = 0,
    ) -> None:
        check_ms("stop_timeout_ms", stop_timeout_ms, minimum=1, fix="pass e.g. stop_timeout_ms=10_000")
        # Checked here, at start-up, rather than in the worker thread at boot.
        check_int("batch_size", batch_size, minimum=1, fix="pass e.g. batch_size=500")
        check_ms("poll_interval_ms", poll_interval_ms, minimum=1, fix="pass e.g. poll_interval_ms=1000")
        check_ms("lead_ms", lead_ms, minimum=0, fix="pass e.g. lead_ms=2000, or 0 to write ticks only once due")
        self.lead_ms = lead_ms
        self.stop_timeout_ms = stop_timeout_ms
        self.registry = registry
        self.batch_size = batch_size
        self.poll_interval_ms = poll_interval_ms
        self.scheduler: Scheduler | None = None
        self._thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        try:
            self.scheduler = Scheduler.from_broker(
                broker,
                registry=self.registry,
                batch_size=self.batch_size,
                poll_interval_ms=self.poll_interval_ms,
                lead_ms=self.lead_ms,
            )
        except ReliableError as error:
            logger.error("%s; no scheduler runs in this worker", error)
            return
        # run() syncs first and waits out an unreachable Postgres, so boot never blocks on it.
        self._thread = threading.Thread(target=self.scheduler.run, name="dramatiq-reliable-scheduler", daemon=True)
        self._thread.start()

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self.scheduler is not None and self._thread is not None:
            self.scheduler.stop()
            self._thread.join(timeout=self.stop_timeout_ms / 1000)
            if self._thread.is_alive():
                logger.warning(
                    "the scheduler thread did not stop within stop_timeout_ms=%d; its open pass rolls back "
                    "and another loop fires those ticks",
                    self.stop_timeout_ms,
                )
            self.scheduler = None
            self._thread = None
