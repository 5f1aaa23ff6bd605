"""The desired-workers formula, the drain rate, the collector's gauges from a known reading, and a port in use.

No service: a reading is built by hand and handed to the collector through a stand-in monitor.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.core import Metric

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.autoscale import Autoscale, DrainRate, desired_workers
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.flow import KeyState
from dramatiq_reliable.health import Health, HealthMonitor, QueueHealth
from dramatiq_reliable.prometheus import METRIC_NAMES, HealthCollector, MetricsServer

# -- the formula ------------------------------------------------------------------------------------

# (depth, oldest_age_s, drain_rate, workers, worker_rate, target_s, minimum, maximum) -> desired
TABLE = [
    # an empty queue asks for the minimum, whatever its past
    ((0, None, None, 5, 1.0, 60.0, 0, None), 0),
    ((0, 900.0, 3.0, 5, 1.0, 60.0, 2, None), 2),
    # the backlog cleared within the target at the configured rate: 120 jobs, 1/s, 60 s -> 2
    ((120, None, None, None, 1.0, 60.0, 0, None), 2),
    ((121, None, None, None, 1.0, 60.0, 0, None), 3),
    ((1, None, None, None, 1.0, 60.0, 0, None), 1),
    # an observed drain faster than configured: 4 workers draining 8/s are 2/s each -> 600/(2*60) = 5
    ((600, 10.0, 8.0, 4, 1.0, 60.0, 0, None), 5),
    # an observed drain slower than configured never lowers the rate: 600/(1*60) = 10
    ((600, 10.0, 0.4, 4, 1.0, 60.0, 0, None), 10),
    # a message that waited past the target asks for one more worker than now
    ((10, 120.0, None, 4, 1.0, 60.0, 0, None), 5),
    # ... and for one at least when the workers are unknown (a Postgres queue)
    ((10, 120.0, None, None, 1.0, 60.0, 0, None), 1),
    # the bounds
    ((6000, None, None, None, 1.0, 60.0, 0, 20), 20),
    ((5, None, None, None, 1.0, 60.0, 3, 20), 3),
]


@pytest.mark.parametrize(("arguments", "expected"), TABLE)
def test_desired_workers_table(arguments: tuple[Any, ...], expected: int) -> None:
    depth, age, drain, workers, rate, target, minimum, maximum = arguments
    assert (
        desired_workers(
            depth=depth,
            oldest_age_s=age,
            drain_rate=drain,
            workers=workers,
            worker_rate=rate,
            target_s=target,
            minimum=minimum,
            maximum=maximum,
        )
        == expected
    )


@given(
    depth=st.integers(min_value=0, max_value=10**7),
    age=st.none() | st.floats(min_value=0, max_value=10**6),
    drain=st.none() | st.floats(min_value=0, max_value=10**5),
    workers=st.none() | st.integers(min_value=0, max_value=1000),
    rate=st.floats(min_value=0.01, max_value=1000),
    target=st.floats(min_value=1, max_value=3600),
    minimum=st.integers(min_value=0, max_value=10),
    extra=st.none() | st.integers(min_value=0, max_value=100),
)
def test_desired_workers_properties(
    depth: int,
    age: float | None,
    drain: float | None,
    workers: int | None,
    rate: float,
    target: float,
    minimum: int,
    extra: int | None,
) -> None:
    maximum = None if extra is None else minimum + extra
    arguments: dict[str, Any] = {
        "oldest_age_s": age,
        "drain_rate": drain,
        "workers": workers,
        "worker_rate": rate,
        "target_s": target,
        "minimum": minimum,
        "maximum": maximum,
    }
    wanted = desired_workers(depth=depth, **arguments)
    # within the bounds
    assert wanted >= (minimum if maximum is None else min(minimum, maximum))
    assert maximum is None or wanted <= max(maximum, minimum)
    # enough to clear the backlog in time at the configured rate, unless capped
    if maximum is None and depth and not (drain and workers):
        assert wanted * rate * target >= depth
    # more messages never ask for fewer workers
    assert desired_workers(depth=depth + 100, **arguments) >= wanted


def test_autoscale_refuses_bad_knobs_naming_the_fix() -> None:
    with pytest.raises(
        ConfigurationError, match=r"worker_rate must be a positive number of jobs per second, not 0; e\.g\."
    ):
        Autoscale(worker_rate=0)
    with pytest.raises(ConfigurationError, match="target_s"):
        Autoscale(target_s=math.inf)
    with pytest.raises(ConfigurationError, match="maximum"):
        Autoscale(minimum=5, maximum=2)
    assert (
        Autoscale(worker_rate=2, target_s=30).desired(depth=120, oldest_age_s=None, drain_rate=None, workers=None) == 2
    )


def test_drain_rate_is_the_fall_of_the_depth_over_the_window() -> None:
    drain = DrainRate(window_s=100, min_span_s=5)
    drain.record(1000.0, {"a": 500, "b": 10})
    assert drain.rate("a") is None  # one reading: no rate yet
    drain.record(1000.0, {"a": 0})  # the same reading again (a cached one): ignored
    drain.record(1002.0, {"a": 480, "b": 20})
    assert drain.rate("a") is None  # two seconds apart: too short to say
    drain.record(1010.0, {"a": 400, "b": 30})
    assert drain.rate("a") == pytest.approx(10.0)
    assert drain.rate("b") is None  # rising: the drain is unknown, not negative
    assert drain.rate("missing") is None
    drain.record(1150.0, {"a": 100})
    # readings older than the window are dropped: (400 - 100) / 140 from the reading at 1010
    assert drain.rate("a") == pytest.approx(300 / 140)


# -- the collector ------------------------------------------------------------------------------------


class _Monitor:
    """Stands in for HealthMonitor: a fixed reading, and what it was given."""

    def __init__(self, reading: Health | None, *, database: Any = "postgresql://", rabbitmq: Any = "amqp://") -> None:
        self.reading = reading
        self.database = database
        self.rabbitmq = rabbitmq
        self.reads = 0

    def get(self) -> Health | None:
        self.reads += 1
        return self.reading

    def close(self) -> None:
        pass


def _samples(collector: HealthCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families: list[Metric] = list(collector.collect())
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def _reading(**overrides: Any) -> Health:
    now = time.time()
    orders = QueueHealth(
        queue="orders",
        depth=120,
        delayed=4,
        xq=1,
        consumers=2,
        outbox_backlog=3,
        outbox_oldest_age_s=42.5,
        outbox_scheduled=7,
        dead_letters=5,
        retries_waiting=6,
        queue_oldest_age_s=None,
    )
    quiet = QueueHealth(queue="quiet", depth=0, outbox_backlog=0, dead_letters=0)
    limited = KeyState(
        key="api.example",
        limiter="api",
        per_second=1.0,
        burst=1,
        waiting=4,
        busy_until_ms=None,
        paused_until_ms=int((now + 30) * 1000),
        paused_status=429,
        slowed_until_ms=None,
        slow_factor=None,
        granted=0,
        postponed=4,
    )
    return Health(
        queues=(orders, quiet), collected_at=now, rate_limits=(limited,), relay_last_publish_age_s=12.5, **overrides
    )


def test_collector_reports_every_number_of_a_known_reading() -> None:
    monitor = _Monitor(_reading())
    collector = HealthCollector(monitor, autoscale=Autoscale(worker_rate=1.0, target_s=60))
    samples = _samples(collector)
    assert monitor.reads == 1  # one reading for every gauge
    orders = (("queue", "orders"),)
    expected = {
        "dramatiq_reliable_queue_depth": 120,
        "dramatiq_reliable_queue_delayed": 4,
        "dramatiq_reliable_queue_xq": 1,
        "dramatiq_reliable_queue_consumers": 2,
        "dramatiq_reliable_outbox_backlog": 3,
        "dramatiq_reliable_outbox_oldest_age_seconds": 42.5,
        "dramatiq_reliable_outbox_scheduled": 7,
        "dramatiq_reliable_dead_letters": 5,
        "dramatiq_reliable_retries_waiting": 6,
        "dramatiq_reliable_desired_workers": 2,
    }
    assert {name: samples[(name, orders)] for name in expected} == expected
    # an empty queue reads 0 where known, and its unknown numbers are left out
    assert samples[("dramatiq_reliable_outbox_oldest_age_seconds", (("queue", "quiet"),))] == 0
    assert ("dramatiq_reliable_queue_delayed", (("queue", "quiet"),)) not in samples
    assert ("dramatiq_reliable_queue_oldest_age_seconds", orders) not in samples
    assert samples[("dramatiq_reliable_rate_limited_keys", ())] == 1
    assert samples[("dramatiq_reliable_relay_last_publish_age_seconds", ())] == 12.5
    assert samples[("dramatiq_reliable_rate_limit_waiting", (("key", "api.example"),))] == 4
    assert 28 < samples[("dramatiq_reliable_rate_limit_paused_seconds", (("key", "api.example"),))] <= 30
    assert samples[("dramatiq_reliable_up", (("service", "postgres"),))] == 1
    assert samples[("dramatiq_reliable_up", (("service", "rabbitmq"),))] == 1
    assert {name for name, _ in samples} <= METRIC_NAMES


def test_collector_says_a_service_is_down_rather_than_reporting_zeros() -> None:
    down = Health(
        queues=(QueueHealth(queue="orders"),), collected_at=time.time(), postgres_error="cannot reach Postgres"
    )
    samples = _samples(HealthCollector(_Monitor(down)))
    assert samples[("dramatiq_reliable_up", (("service", "postgres"),))] == 0
    assert not [name for name, _ in samples if name.startswith(("dramatiq_reliable_outbox", "dramatiq_reliable_rate"))]
    nothing = _samples(HealthCollector(_Monitor(None, rabbitmq=None)))
    assert nothing == {("dramatiq_reliable_up", (("service", "postgres"),)): 0}


# -- a port in use ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_port_in_use_is_a_clear_error() -> None:
    monitor = HealthMonitor(database=None)
    with _taken_port() as port, pytest.raises(ConfigurationError) as caught:
        MetricsServer(monitor, port=port)
    assert str(caught.value) == (
        f"port {port} on '127.0.0.1' is already in use; stop what listens on 127.0.0.1:{port} "
        "(e.g. another 'dramatiq-reliable metrics') or pick another with --port / port="
    )


def test_the_command_exits_2_on_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with _taken_port() as port:
        code = main(["metrics", "--port", str(port), "--database-url", "postgresql://app@127.0.0.1:1/app"])
    assert code == ExitCode.USAGE
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"dramatiq-reliable: error: port {port} on '127.0.0.1' is already in use;")


def test_the_server_serves_on_loopback_and_releases_the_port() -> None:
    reading = _reading()
    with MetricsServer(_Monitor(reading), port=0) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            body = response.read().decode()
        assert 'dramatiq_reliable_outbox_backlog{queue="orders"} 3.0' in body
    with socket.socket() as again:  # closed: nothing listens there any more
        # SO_REUSEADDR as servers set it: the scrape's connection may sit in TIME_WAIT, a listener may not.
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.port))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--worker-rate", "0"], "'0' is not a positive number of jobs per second; write e.g. 2.5"),
        (["--worker-rate", "nan"], "'nan' is not a positive number of jobs per second"),
        (["--min-workers", "5", "--max-workers", "2"], "--max-workers 2 is below --min-workers 5; raise it"),
        (["--port", "0"], "'0' is out of range; give a whole number from 1 to 65535"),
        (["--target-wait", "10ms"], "'10ms' is too short; the shortest is 1000ms"),
    ],
)
def test_the_command_refuses_bad_knobs(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", *argv]) == ExitCode.USAGE
    assert message in capsys.readouterr().err
