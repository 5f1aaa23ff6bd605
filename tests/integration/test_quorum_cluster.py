"""Quorum queues on a 3-node cluster: losing the leader's node stalls the work for the election only.

Relay and worker get all three node URLs; each connection starts at a random node
(``dramatiq_reliable.outbox.nodes``).  A steady stream of sends runs while the node holding the
queue's Raft leader is stopped (as a rolling restart would) and then while another leader's node
is SIGKILLed: every message is delivered, and the longest send-to-run latency, the stall, is
bounded by the election plus one reconnect.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pika
import pytest
from dramatiq.common import dq_name, xq_name

from dramatiq_reliable import OutboxBroker, Relay
from dramatiq_reliable.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

#: The longest a message may wait while a leader is lost: the election (a few seconds), Dramatiq's
#: consumer restart delay (3 s) and the relay's reconnect backoff, with room for a loaded CI box.
STALL_BOUND_S = 25.0


def _leader(cluster: Any, queue: str) -> Any:
    """The node holding ``queue``'s Raft leader, asked of a running node."""
    node = cluster.running_nodes()[0]
    rows = json.loads(node.ctl("-q", "list_queues", "name", "leader", "--formatter", "json"))
    (leader,) = [row["leader"] for row in rows if row["name"] == queue]
    return cluster.node_named(leader)


def _delete_queues(cluster: Any, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(cluster.running_nodes()[0].url))
    try:
        for name in (queue, dq_name(queue), xq_name(queue)):
            connection.channel().queue_delete(name)
    finally:
        connection.close()


class Stream:
    """Sends one message every ``interval_s`` and records when each was sent and when it ran."""

    def __init__(self, actor: dramatiq.Actor[Any, Any], interval_s: float = 0.05) -> None:
        self.actor, self.interval_s = actor, interval_s
        self.sent: dict[int, float] = {}
        self.ran: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)

    def record(self, n: int) -> None:
        self.ran.setdefault(n, time.monotonic())

    def _send(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            self.sent[n] = time.monotonic()
            self.actor.send(n)  # an autocommit outbox row: Postgres, not RabbitMQ, so it never fails here
            n += 1

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def stall_since(self, since: float) -> float:
        """The longest send-to-run latency of the messages sent since ``since`` (all must have run)."""
        return max(self.ran[n] - t for n, t in self.sent.items() if t >= since)


@pytest.fixture
def cluster_broker(healed_cluster, database_url, db_schema, queue_name) -> Iterator[OutboxBroker]:
    broker = OutboxBroker(url=healed_cluster.urls, database=database_url, schema=db_schema, queue_type="quorum")
    dramatiq.set_broker(broker)
    yield broker
    broker.close()
    _delete_queues(healed_cluster, queue_name)


def test_losing_the_leaders_node_stops_no_work_for_longer_than_the_election(
    healed_cluster, cluster_broker, queue_name, capsys
):
    stream: Stream
    actor = dramatiq.actor(
        lambda n: stream.record(n), actor_name=f"{queue_name}_s", queue_name=queue_name, broker=cluster_broker
    )
    stream = Stream(actor)
    relay = Relay.from_broker(cluster_broker, poll_interval_ms=20, backoff_max_ms=1000, confirm_timeout_ms=5000)
    relaying = threading.Thread(target=relay.run, daemon=True)
    worker = dramatiq.Worker(cluster_broker, worker_timeout=100, worker_threads=2)
    relaying.start()
    worker.start()
    stalls = {}
    try:
        with stream:
            wait_for(lambda: len(stream.ran) >= 20, timeout_ms=30_000, message="messages flow before any loss")
            for how in ("stop", "kill"):
                leader = _leader(healed_cluster, queue_name)
                lost_at = time.monotonic()
                getattr(leader, how)()
                # Work goes on: messages sent after the loss run.
                wait_for(
                    lambda lost_at=lost_at: (
                        sum(1 for n, t in stream.sent.items() if t > lost_at + 1 and n in stream.ran) >= 20
                    ),
                    timeout_ms=int(STALL_BOUND_S * 1000) + 10_000,
                    message=f"messages sent after the leader's node was {how}ped run",
                )
                healed_cluster.heal()
                last = max(stream.sent)
                wait_for(lambda last=last: all(n in stream.ran for n in range(last + 1)), timeout_ms=30_000)
                stalls[how] = stream.stall_since(lost_at)
        last = max(stream.sent)
        wait_for(
            lambda: all(n in stream.ran for n in range(last + 1)),
            timeout_ms=30_000,
            message="every message sent runs: nothing lost",
        )
    finally:
        worker.stop()
        relay.stop()
        relaying.join(timeout=30)
    with capsys.disabled():
        print(f"\nquorum failover stall: leader node stopped {stalls['stop']:.1f} s, killed {stalls['kill']:.1f} s")
    assert set(stream.ran) == set(stream.sent)
    assert all(stall < STALL_BOUND_S for stall in stalls.values()), stalls
