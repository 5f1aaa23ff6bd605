"""A scheduler loop inside each worker process, so a small deployment needs no scheduler process."""

from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Middleware
from dramatiq.broker import Broker

from ..errors import ConfigurationError, ReliableError
from .loop import Scheduler

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
      scheduler_options: passed to :class:`Scheduler` (``registry``, ``batch_size``,
        ``poll_interval_ms``); database, schema and target come from the broker.

    >>> broker.add_middleware(WorkerScheduler())      # doctest: +SKIP
    """

    def __init__(self, *, stop_timeout_ms: int = 10_000, **scheduler_options: Any) -> None:
        if isinstance(stop_timeout_ms, bool) or not isinstance(stop_timeout_ms, int) or stop_timeout_ms < 1:
            raise ConfigurationError(
                f"stop_timeout_ms must be a positive int of milliseconds, got {stop_timeout_ms!r}; e.g. 10000"
            )
        for taken in ("database", "schema", "target"):
            if taken in scheduler_options:
                raise ConfigurationError(
                    f"WorkerScheduler takes {taken}= from the broker; drop it and configure the broker instead"
                )
        unknown = set(scheduler_options) - {"registry", "batch_size", "poll_interval_ms"}
        if unknown:
            raise ConfigurationError(
                f"WorkerScheduler got unknown options {sorted(unknown)!r}; it takes registry=, batch_size=, "
                "poll_interval_ms= and stop_timeout_ms="
            )
        self.stop_timeout_ms = stop_timeout_ms
        self.scheduler_options = scheduler_options
        self.scheduler: Scheduler | None = None
        self._thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        try:
            self.scheduler = Scheduler.from_broker(broker, **self.scheduler_options)
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
