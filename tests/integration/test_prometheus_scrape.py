"""The Prometheus endpoint scraped over real HTTP, on a known state of a real Postgres and RabbitMQ.

The state: 2 messages published to RabbitMQ, 3 committed outbox rows not yet published (aged 90 s),
1 delayed outbox row, 2 dead letters.  Each number must come out of ``/metrics`` as such.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import Otel, capture_dead_letter

from dramatiq_reliable import OutboxBroker, PostgresBroker
from dramatiq_reliable.autoscale import Autoscale
from dramatiq_reliable.health import HealthMonitor
from dramatiq_reliable.prometheus import METRIC_NAMES, MetricsServer
from dramatiq_reliable.queue_depths import QueueDepths
from dramatiq_reliable.testing import drain_outbox, wait_for
from dramatiq_reliable.tracing import Tracing


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def known_state(broker: OutboxBroker, queue_name: str, db: psycopg.Connection, db_schema: str) -> str:
    @dramatiq.actor(broker=broker, queue_name=queue_name)
    def task() -> None:
        pass

    with broker.transaction():
        task.send()
        task.send()
    assert drain_outbox(broker) == 2  # now in RabbitMQ
    with broker.transaction():
        for _ in range(3):
            task.send()
        task.send_with_options(delay=3_600_000)  # waits in the outbox for its time: not a backlog
    db.execute(
        psycopg.sql.SQL("UPDATE {}.outbox SET created_at = created_at - interval '90 seconds'").format(
            psycopg.sql.Identifier(db_schema)
        )
    )
    for _ in range(2):
        capture_dead_letter(broker, queue_name=queue_name)
    return queue_name


def _check_known_state(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], queue: str) -> None:
    label = (("queue", queue),)
    numbers = {
        name: samples.get((f"dramatiq_reliable_{name}", label))
        for name in ("queue_depth", "queue_consumers", "outbox_backlog", "outbox_scheduled", "dead_letters")
    }
    assert numbers == {
        "queue_depth": 2,
        "queue_consumers": 0,
        "outbox_backlog": 3,
        "outbox_scheduled": 1,
        "dead_letters": 2,
    }
    assert 90 <= samples[("dramatiq_reliable_outbox_oldest_age_seconds", label)] < 150
    assert samples[("dramatiq_reliable_up", (("service", "postgres"),))] == 1
    assert samples[("dramatiq_reliable_up", (("service", "rabbitmq"),))] == 1
    assert {name for name, _ in samples} <= METRIC_NAMES


def test_a_scrape_reports_the_known_state(
    known_state: str, database_url: str, rabbitmq_url: str, db_schema: str
) -> None:
    monitor = HealthMonitor(
        database=database_url,
        schema=db_schema,
        rabbitmq=QueueDepths(rabbitmq_url=rabbitmq_url),
        queues=lambda: [known_state],
        ttl_ms=60_000,
    )
    # 0.01 jobs/s per worker, 60 s: 2 messages need ceil(2 / 0.6) = 4 workers
    with MetricsServer(monitor, port=0, autoscale=Autoscale(worker_rate=0.01, target_s=60)) as server:
        samples = _scrape(server.port)
        _check_known_state(samples, known_state)
        assert samples[("dramatiq_reliable_desired_workers", (("queue", known_state),))] == 4
        assert samples[("dramatiq_reliable_rate_limited_keys", ())] == 0
        # the relay published 2 rows moments ago (drain_outbox keeps them: on_published="mark")
        assert 0 <= samples[("dramatiq_reliable_relay_last_publish_age_seconds", ())] < 60


@pytest.fixture
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def metrics_command(
    known_state: str, database_url: str, rabbitmq_url: str, db_schema: str, free_port: int
) -> Iterator[subprocess.Popen[str]]:
    argv = [sys.executable, "-m", "dramatiq_reliable", "metrics", "--port", str(free_port), "--schema", db_schema]
    argv += ["--queue", known_state, "--database-url", database_url, "--rabbitmq-url", rabbitmq_url]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()


def test_the_command_serves_the_same_numbers_and_stops_on_sigterm(
    metrics_command: subprocess.Popen[str], known_state: str, free_port: int
) -> None:
    def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        assert metrics_command.poll() is None, "the command exited early"
        try:
            return _scrape(free_port)
        except OSError:
            return None

    samples = wait_for(scraped, timeout_ms=15_000, message="the metrics command never answered")
    _check_known_state(samples, known_state)
    metrics_command.send_signal(signal.SIGTERM)
    assert metrics_command.wait(timeout=10) == 0
    assert metrics_command.stderr is not None
    log = metrics_command.stderr.read()
    assert "serving metrics for schema" in log and "metrics endpoint stopped" in log


def test_the_otel_gauges_report_the_same_desired_workers_and_queue_age(
    database_url: str, db_schema: str, queue_name: str, otel: Otel
) -> None:
    """A PostgresBroker under Tracing: its queue's oldest age and desired workers are OTel gauges too."""
    tracing = Tracing(meter_provider=otel.meter_provider, tracer_provider=otel.tracer_provider, health_cache_ms=0)
    broker = PostgresBroker(database=database_url, schema=db_schema, middleware=[tracing])
    try:

        @dramatiq.actor(broker=broker, queue_name=queue_name)
        def task() -> None:
            pass

        for _ in range(61):
            task.send()
        dest = {"messaging.destination.name": queue_name}
        # 61 messages at the default 1 job/s per worker within 60 s: 2 workers
        assert otel.total("dramatiq_reliable.queue.desired_workers", **dest) == 2
        assert 0 <= otel.total("dramatiq_reliable.queue.oldest_age", **dest) < 60
        assert not otel.points("dramatiq_reliable.relay.last_publish_age")  # nothing published: no heartbeat
    finally:
        broker.close()
        tracing.close()
