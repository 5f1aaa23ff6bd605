"""Desired workers: how many worker processes a queue needs, from its depth, age and recent throughput.

An autoscaler (KEDA, a Kubernetes HPA on an external metric, a script) that scales on raw queue
depth needs a per-deployment divisor nobody knows, and one that scales on CPU never sees a queue
of slow I/O-bound jobs.  :func:`desired_workers` turns the health numbers into the one number an
autoscaler can act on directly (KEDA's ``AverageValue`` target of ``1`` makes it the replica
count).  It is a pure function so its arithmetic is tested on tables of numbers, and both the
Prometheus endpoint and the OpenTelemetry gauges report the same figure.

The formula (``docs/metrics.md`` explains it with examples)::

    per_worker = max(worker_rate, drain_rate / workers)   # jobs/s one worker clears
    backlog    = ceil(depth / (per_worker * target_s))    # clear the backlog within target_s
    behind     = workers + 1 if oldest_age_s > target_s   # a message waited too long: one more
    desired    = clamp(max(backlog, behind), minimum, maximum)

``drain_rate`` is the fall of the depth per second over the last readings (:class:`DrainRate`),
a lower bound of the throughput (messages keep arriving while it drains): it only ever raises
``per_worker`` above the configured ``worker_rate``, so a fleet that is faster than assumed is not
over-scaled, and one that is slower still gets the configured estimate.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import TYPE_CHECKING

from ._checks import check_int, shown
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .health import Health

__all__ = ["Autoscale", "DrainRate", "desired_by_queue", "desired_workers"]


@dataclasses.dataclass(frozen=True)
class Autoscale:
    """The knobs of :func:`desired_workers`, the same for every queue of one reading.

    ``worker_rate``: jobs per second one worker process clears (measure it once: the consumed
    messages counter of a busy worker over a minute, divided by its process count).
    ``target_s``: how long a message may wait; the backlog is sized to clear within it.
    ``minimum`` / ``maximum``: the bounds of the answer (``maximum=None``: no upper bound).
    ``window_s``: how far back :class:`DrainRate` looks for the recent drain rate.
    """

    #: One job per second per process: a cautious default for I/O-bound jobs.
    worker_rate: float = 1.0
    #: A minute: the article's alert on a queue's oldest message fires at five.
    target_s: float = 60.0
    minimum: int = 0
    maximum: int | None = None
    #: Five minutes: long enough to smooth a burst, short enough to follow a change of load.
    window_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("worker_rate", "target_s", "window_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigurationError(
                    f"{name} must be a positive number of {_UNITS[name]}, not {shown(value)}; e.g. {_EXAMPLES[name]}"
                )
        check_int("minimum", self.minimum, minimum=0, fix="e.g. minimum=1")
        check_int("maximum", self.maximum, minimum=max(1, self.minimum), allow_none=True, fix="e.g. maximum=20")

    def desired(self, *, depth: int, oldest_age_s: float | None, drain_rate: float | None, workers: int | None) -> int:
        """:func:`desired_workers` with these knobs."""
        return desired_workers(
            depth=depth,
            oldest_age_s=oldest_age_s,
            drain_rate=drain_rate,
            workers=workers,
            worker_rate=self.worker_rate,
            target_s=self.target_s,
            minimum=self.minimum,
            maximum=self.maximum,
        )


_UNITS = {"worker_rate": "jobs per second", "target_s": "seconds", "window_s": "seconds"}
_EXAMPLES = {"worker_rate": "worker_rate=2.5", "target_s": "target_s=60", "window_s": "window_s=300"}


def desired_workers(
    *,
    depth: int,
    oldest_age_s: float | None,
    drain_rate: float | None,
    workers: int | None,
    worker_rate: float,
    target_s: float,
    minimum: int = 0,
    maximum: int | None = None,
) -> int:
    """How many worker processes clear ``depth`` messages within ``target_s`` (see the module docstring).

    ``workers`` is the number now consuming the queue (RabbitMQ's consumer count), ``None`` when
    unknown (a Postgres queue): the drain rate then cannot be shared out and only the configured
    ``worker_rate`` counts, and a message waiting past ``target_s`` asks for at least one worker.
    An empty queue asks for ``minimum``: the jobs running now are not in ``depth``, and an
    autoscaler's scale-down delay (KEDA's ``cooldownPeriod``) lets them finish.
    """
    if depth <= 0:
        return minimum
    per_worker = worker_rate
    if drain_rate is not None and drain_rate > 0 and workers:
        per_worker = max(worker_rate, drain_rate / workers)
    wanted = math.ceil(depth / (per_worker * target_s))
    if oldest_age_s is not None and oldest_age_s > target_s:
        wanted = max(wanted, (workers or 0) + 1)
    wanted = max(wanted, minimum)
    return wanted if maximum is None else min(wanted, maximum)


class DrainRate:
    """The recent fall of each queue's depth, in messages per second, from successive readings.

    Each reading's depths are recorded with its time; the rate of a queue is the fall of its
    depth from the oldest reading inside ``window_s`` to the newest, over the time between them,
    and ``None`` until two readings are ``min_span_s`` apart or when the depth rose.  A reading
    already recorded (a cached one served twice) is ignored.  Thread-safe.
    """

    def __init__(self, *, window_s: float = 300.0, min_span_s: float = 5.0) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._lock = threading.Lock()
        self._readings: collections.deque[tuple[float, dict[str, int]]] = collections.deque()

    def record(self, at: float, depths: dict[str, int]) -> None:
        """Record the depths read at ``at`` (seconds, any monotonic-enough clock)."""
        with self._lock:
            if self._readings and at <= self._readings[-1][0]:
                return
            self._readings.append((at, dict(depths)))
            while len(self._readings) > 2 and at - self._readings[1][0] >= self.window_s:
                self._readings.popleft()

    def rate(self, queue: str) -> float | None:
        """Messages per second the queue's depth fell over the window; ``None`` when unknown or rising."""
        with self._lock:
            known = [(at, depths[queue]) for at, depths in self._readings if queue in depths]
        if len(known) < 2:
            return None
        (first_at, first), (last_at, last) = known[0], known[-1]
        span = last_at - first_at
        if span < self.min_span_s or last > first:
            return None
        return (first - last) / span


def desired_by_queue(health: Health, autoscale: Autoscale, drain: DrainRate) -> dict[str, int]:
    """The desired workers of every queue of ``health`` whose depth is known, feeding ``drain`` first.

    The Prometheus endpoint and the OpenTelemetry gauge both call it, so they report one figure.
    """
    depths = {item.queue: item.depth for item in health.queues if item.depth is not None}
    drain.record(health.collected_at, depths)
    return {
        item.queue: autoscale.desired(
            depth=depth, oldest_age_s=item.queue_oldest_age_s, drain_rate=drain.rate(item.queue), workers=item.consumers
        )
        for item in health.queues
        if (depth := depths.get(item.queue)) is not None
    }
