"""A silent partition (packets dropped, no RST) between a client and Postgres or RabbitMQ.

The client runs in a network namespace (tests/netns.py) and the cut is an iptables DROP both
ways, so its kernel sees only silence.  Each test checks that the client returns or recovers
within the bound docs/guarantees.md gives ("A silent partition") and that nothing is lost.  The
measured figures are printed (``-s`` shows them) so the docs can quote them.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import dramatiq
import psycopg
import pytest
from netns import Netns, unavailable_reason
from psycopg import sql
from support import running, server_address

from dramatiq_reliable import OutboxBroker, Relay
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.acceptance, pytest.mark.partition]

SCRIPTS = Path(__file__).parent / "partition"

#: The documented bound on noticing a silent partition (TCP_USER_TIMEOUT 10 s, keepalives from 5 s).
NOTICE_BOUND_S = 15
#: An unbound send() with Postgres cut: the dead pooled connection (tcp_user_timeout, about
#: 10.5 s), then a second attempt that waits the pool's timeout_ms (10 s) for a fresh connection.
SEND_BOUND_S = 25


class Client:
    """A partition script running in the namespace, its JSON lines collected by a thread."""

    def __init__(self, net: Netns, script: str, **settings: str) -> None:
        args = [sys.executable, str(SCRIPTS / script), *(f"{key}={value}" for key, value in settings.items())]
        self.process = net.popen(args, cwd=str(SCRIPTS))
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def expect(self, *events: str, timeout_s: float, after: float = 0.0) -> dict[str, Any]:
        """The next line whose event is one of ``events``, stamped after ``after`` (a monotonic
        time); the lines passed over are kept in ``seen``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, remaining))
            except queue.Empty:
                line = None
            if line is not None:
                self.seen.append(line)
                if line["event"] in events and line["t"] > after:
                    return line
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no {' or '.join(events)} from {self.process.args[-1]!r} within {timeout_s}s; saw {self.seen}"
                )

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        """Close its stdin (the script's signal to stop), kill it if it does not, reap it."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(timeout=20)
        except (subprocess.TimeoutExpired, OSError):
            self.process.kill()
            self.process.wait(timeout=10)
        self._reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def net() -> Iterator[Netns]:
    """A network namespace of the test's own, removed after it (rules and veth included)."""
    reason = unavailable_reason()
    if reason is not None:
        from conftest import IN_CI

        if IN_CI:
            pytest.fail(f"{reason}; CI=true, so this is a failure, not a skip", pytrace=False)
        pytest.skip(reason)
    with Netns.create() as namespace:
        yield namespace


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """Clients to stop after the test, even if it failed (tests ask for it last, so the clients
    stop before the schema and queues they use are dropped)."""
    started: list[Client] = []
    yield started
    for client in started:
        client.stop()


def _port(url: str) -> int:
    return server_address(url)[1]


def _figure(name: str, seconds: float, bound: float | str) -> None:
    print(f"\npartition figure: {name} {seconds:.1f}s (bound {bound})")


def test_send_with_postgres_cut_raises_within_the_bound_and_loses_nothing(
    net, database_url, rabbitmq_url, db_schema, queue_name, db, clients
):
    """An unbound send() on a silently cut Postgres raises within SEND_BOUND_S, not minutes; the
    sends that returned are in the outbox and the one that raised is not."""
    client = Client(
        net,
        "send.py",
        database_url=net.url(database_url),
        rabbitmq_url=net.url(rabbitmq_url),
        schema=db_schema,
        queue=queue_name,
    )
    clients.append(client)
    client.expect("ready", timeout_s=30)

    net.cut(_port(database_url))
    client.send("send 1")
    during = client.expect("sent", "failed", timeout_s=120)
    net.heal(_port(database_url))
    client.send("send 2")
    after = client.expect("sent", "failed", timeout_s=30)

    _figure("send() with Postgres cut", during["elapsed"], SEND_BOUND_S)
    assert during["event"] == "failed", during
    assert during["elapsed"] <= SEND_BOUND_S, during
    assert after["event"] == "sent", after
    rows = db.execute(
        sql.SQL("SELECT body FROM {}.outbox WHERE queue_name = %s").format(sql.Identifier(db_schema)), (queue_name,)
    ).fetchall()
    assert sorted(json.loads(bytes(body))["args"][0] for (body,) in rows) == [0, 2]


#: The relay's cases: the kernel's bound (TCP_USER_TIMEOUT, before the 30 s confirm timeout), and
#: a confirm timeout shorter than a long TCP_USER_TIMEOUT the URL sets: the publish then aborts
#: its connection at the confirm timeout (3 s) and one connect attempt (pika's socket_timeout,
#: 10 s) finds RabbitMQ unreachable, where a graceful close would wait out the 120 s.
RELAY_CASES = {
    "tcp_user_timeout": ("", 30_000, NOTICE_BOUND_S),
    "confirm_timeout": ("?tcp_options=" + quote("{'TCP_USER_TIMEOUT': 120000}"), 3_000, 3 + 10 + 2),
}


@pytest.mark.parametrize("case", sorted(RELAY_CASES))
def test_relay_with_rabbitmq_cut_gives_up_within_the_bound_and_publishes_every_row_once_after_heal(
    case, net, broker, database_url, rabbitmq_url, db_schema, queue_name, rabbit, clients
):
    """A relay whose RabbitMQ goes silent mid-publish gives the batch up within its bound (not
    140 s after it started), keeps the rows, and after the heal publishes every row exactly once."""
    query, confirm_timeout_ms, bound = RELAY_CASES[case]
    client = Client(
        net,
        "relay.py",
        database_url=net.url(database_url),
        rabbitmq_url=net.url(rabbitmq_url) + query,
        schema=db_schema,
        confirm_timeout_ms=str(confirm_timeout_ms),
    )
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    clients.append(client)
    client.expect("ready", timeout_s=30)
    sent = {task.send(n).message_id for n in range(5)}
    client.expect("published", timeout_s=30)
    wait_for(lambda: rabbit.count(queue_name) == 5, timeout_ms=30_000, message="the relay published the first rows")

    net.cut(_port(rabbitmq_url))
    cut = time.monotonic()
    with broker.transaction():
        sent |= {task.send(n).message_id for n in range(5, 25)}
    gave_up = client.expect("unavailable", "published", timeout_s=180, after=cut)
    net.heal(_port(rabbitmq_url))
    healed = time.monotonic()
    wait_for(lambda: rabbit.count(queue_name) >= 25, timeout_ms=60_000, message="the relay published after the heal")
    recovered = time.monotonic() - healed

    _figure(f"relay publish with RabbitMQ cut ({case})", gave_up["elapsed"], bound)
    _figure(f"relay, heal to all published ({case})", recovered, "backoff_max_ms + connect")
    assert gave_up["event"] == "unavailable", gave_up
    assert gave_up["elapsed"] <= bound, gave_up
    bodies = rabbit.take_all(queue_name, expect=25)
    assert sorted(body["message_id"] for body in bodies) == sorted(sent)


@pytest.fixture
def effects(db: psycopg.Connection[Any], db_schema: str) -> str:
    db.execute(
        sql.SQL("CREATE TABLE {}.partition_effects (order_id int NOT NULL, attempt int NOT NULL)").format(
            sql.Identifier(db_schema)
        )
    )
    return db_schema


def _effects(db: psycopg.Connection[Any], schema: str) -> dict[int, int]:
    rows = db.execute(
        sql.SQL("SELECT order_id, count(*) FROM {}.partition_effects GROUP BY order_id").format(sql.Identifier(schema))
    ).fetchall()
    return {int(order_id): int(count) for order_id, count in rows}


def _worker(net: Netns, database_url: str, rabbitmq_url: str, schema: str, queue_name: str, release: Path) -> Client:
    return Client(
        net,
        "worker.py",
        database_url=net.url(database_url),
        rabbitmq_url=net.url(rabbitmq_url),
        schema=schema,
        queue=queue_name,
        release=str(release),
    )


def _relay(broker: OutboxBroker) -> Relay:
    return Relay.from_broker(broker, poll_interval_ms=100, backoff_max_ms=1000)


def test_worker_with_rabbitmq_cut_notices_within_the_bound_and_consumes_after_heal(
    net, broker, effects, database_url, rabbitmq_url, queue_name, db, tmp_path, clients
):
    """A worker whose RabbitMQ goes silent drops its consumer within NOTICE_BOUND_S (not the
    heartbeat's 65-130 s), reconnects after the heal and runs the message sent during the cut,
    once."""
    task = dramatiq.actor(lambda n, hold: None, actor_name="partition_effect", queue_name=queue_name, broker=broker)
    client = _worker(net, database_url, rabbitmq_url, effects, queue_name, tmp_path / "release")
    clients.append(client)
    client.expect("ready", timeout_s=30)
    relay = _relay(broker)
    with running(relay.run, relay.stop):
        task.send(1, False)
        wait_for(lambda: _effects(db, effects).get(1), timeout_ms=30_000, message="order 1 ran before the cut")

        net.cut(_port(rabbitmq_url))
        cut = time.monotonic()
        task.send(2, False)
        noticed = client.expect("consumer_error", timeout_s=NOTICE_BOUND_S + 5, after=cut)["t"] - cut
        net.heal(_port(rabbitmq_url))
        healed = time.monotonic()
        wait_for(lambda: _effects(db, effects).get(2), timeout_ms=90_000, message="order 2 ran after the heal")
        recovered = time.monotonic() - healed

    _figure("worker noticed RabbitMQ cut", noticed, NOTICE_BOUND_S)
    _figure("worker, heal to the message sent during the cut run", recovered, "-")
    assert noticed <= NOTICE_BOUND_S
    assert _effects(db, effects) == {1: 1, 2: 1}


def test_worker_with_postgres_cut_mid_job_loses_no_job(
    net, broker, effects, database_url, rabbitmq_url, queue_name, db, tmp_path, clients
):
    """A job whose Postgres goes silent between its write and its commit is not lost: the commit
    fails within the bound, the message waits (its retry is written once Postgres is back) and it
    runs to one effect after the heal."""
    task = dramatiq.actor(lambda n, hold: None, actor_name="partition_effect", queue_name=queue_name, broker=broker)
    release = tmp_path / "release"
    client = _worker(net, database_url, rabbitmq_url, effects, queue_name, release)
    clients.append(client)
    client.expect("ready", timeout_s=30)
    relay = _relay(broker)
    with running(relay.run, relay.stop):
        task.send(1, True)
        client.expect("ran", timeout_s=30)
        net.cut(_port(database_url))
        cut = time.monotonic()
        release.touch()
        client.expect("released", timeout_s=10)
        # Long enough for the commit to fail (TCP_USER_TIMEOUT 10 s), shorter than the retry's
        # worker_write_timeout_ms (30 s), which keeps trying until Postgres is back.
        time.sleep(12)  # the cut's length is the scenario, not a synchronisation
        net.heal(_port(database_url))
        healed = time.monotonic()
        wait_for(lambda: _effects(db, effects).get(1), timeout_ms=90_000, message="order 1 ran after the heal")
        recovered = time.monotonic() - healed

    _figure("job with Postgres cut mid-job, heal to its effect", recovered, "-")
    _figure("cut length", healed - cut, "-")
    assert _effects(db, effects) == {1: 1}
