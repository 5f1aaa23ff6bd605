"""Chaos: kills, Postgres cuts and RabbitMQ cuts cost at most a delay; nothing lost, doubled, phantom or stuck.

Real ``dramatiq`` worker processes and ``dramatiq-reliable relay`` processes, every one of them
connected through TCP proxies the test owns; orders sent through ``OutboxBroker`` in
transactions (some rolled back on purpose); an idempotent actor whose effect is a row; injected
transient failures and poison orders.  The seed is printed first (``CHAOS_SEED=...``) and the
ledger last, as one JSON line.  A soak is the same test with other sizes, e.g.
``CHAOS_COUNT=10000 pytest -m chaos -s`` (see ``chaos/scenario.py`` for every knob).

``test_chaos_on_a_cluster_loses_nothing`` is the same run on a 3-node RabbitMQ cluster of the
tests' own with quorum queues: the node holding the queue is stopped and started, later the node
holding it then is SIGKILLed and started, and a worker and a relay are SIGKILLed; the ledger line
also gives the longest stall (no job completed) around each node outage.
"""

from __future__ import annotations

import contextlib
import json
import sys

import pytest
from chaos.ledger import DeadLetterRow, Order, tally
from chaos.scenario import Run, Settings, execute
from dramatiq.common import dq_name, xq_name
from support import Rabbit

pytestmark = [pytest.mark.integration, pytest.mark.acceptance, pytest.mark.chaos, pytest.mark.timeout(900)]


def test_chaos_loses_doubles_and_strands_nothing(
    database_url, rabbitmq_url, db_schema, queue_name, db, rabbit, tmp_path
):
    settings = Settings.from_env()

    def say(line: str) -> None:
        print(line)
        print(line, file=sys.stderr)

    run = Run(settings, database_url, rabbitmq_url, db_schema, queue_name, tmp_path, say)
    ledger, fleet = execute(run, db, rabbit)
    say(ledger.line())
    assert ledger.counts["committed"] > 0.5 * settings.count, "most orders must commit, or the run proved nothing"
    assert ledger.run["kills"]["worker"] > 0 and ledger.run["cuts"]["postgres"] > 0, "the chaos must have happened"
    assert ledger.ok, (
        f"CHAOS_SEED={settings.seed}: lost={ledger.counts['lost']} doubled={ledger.counts['doubled']} "
        f"phantom={ledger.counts['phantom']} stuck={ledger.counts['stuck']} "
        f"spurious_dead_letters={ledger.counts['spurious_dead_letters']}\n{ledger.line()}\n{fleet.logs()}"
    )


def test_chaos_on_a_cluster_loses_nothing(database_url, db_schema, queue_name, db, healed_cluster, tmp_path):
    settings = Settings.from_env(cluster=True)

    def say(line: str) -> None:
        print(line)
        print(line, file=sys.stderr)

    urls = ";".join(healed_cluster.urls)
    reader = Rabbit(healed_cluster.urls[0])
    try:
        run = Run(settings, database_url, urls, db_schema, queue_name, tmp_path, say, cluster=healed_cluster)
        ledger, fleet = execute(run, db, reader)
    finally:
        # The cluster lives for the session: the run's queues go with the test.
        with contextlib.suppress(Exception):
            for name in (queue_name, dq_name(queue_name), xq_name(queue_name)):
                reader.channel.queue_delete(name)
        with contextlib.suppress(Exception):
            reader.close()
    say(ledger.line())
    assert ledger.counts["committed"] > 0.5 * settings.count, "most orders must commit, or the run proved nothing"
    outages = ledger.run["cluster"]["nodes"]
    assert {outage.split()[0] for outage in outages} == {"stop", "kill"}, f"both node outages must happen: {outages}"
    assert ledger.run["kills"]["worker"] > 0 and ledger.run["kills"]["relay"] > 0, "the kills must have happened"
    assert ledger.ok, (
        f"CHAOS_SEED={settings.seed}: lost={ledger.counts['lost']} doubled={ledger.counts['doubled']} "
        f"phantom={ledger.counts['phantom']} stuck={ledger.counts['stuck']} "
        f"spurious_dead_letters={ledger.counts['spurious_dead_letters']}\n{ledger.line()}\n{fleet.logs()}"
    )


def test_ledger_gives_each_order_one_verdict():
    orders = [
        Order(1, "m1", poison=False),  # done
        Order(2, "m2", poison=False),  # doubled
        Order(3, "m3", poison=True),  # dead
        Order(4, "m4", poison=True),  # lost: only in .XQ
        Order(5, "m5", poison=False),  # stuck: still in the outbox
        Order(6, "m6", poison=False),  # lost: dead-lettered although retry-safe
        Order(7, "m7", poison=False),  # lost: nowhere
        Order(8, "m8", poison=False),  # done, with a spurious dead letter
    ]
    ledger = tally(
        orders=orders,
        effects={1: 1, 2: 2, 8: 1, 99: 1},  # 99 never committed: a phantom
        dead_letters=[
            DeadLetterRow("m3", "unrecoverable", 1, "dramatiq_reliable.Unrecoverable"),
            DeadLetterRow("m6", "retries_exhausted", 1, "dramatiq_reliable.JobCommitFailed"),
            DeadLetterRow("m8", "retries_exhausted", 1, "dramatiq_reliable.JobCommitFailed"),
        ],
        outbox_pending={"m5"},
        queued=set(),
        xq={"m4", "m6"},
    )
    counts = ledger.counts
    assert (counts["done"], counts["dead"], counts["doubled"], counts["stuck"], counts["phantom"]) == (2, 1, 1, 1, 1)
    assert (counts["lost"], counts["xq_only"], counts["dead_lettered"], counts["vanished"]) == (3, 1, 1, 1)
    assert ledger.examples["spurious_dead_letters"] == [6, 8]
    assert not ledger.ok
    line = json.loads(ledger.line())
    assert line["chaos_ledger"] == {"lost": 3, "doubled": 1, "phantom": 1, "stuck": 1}
