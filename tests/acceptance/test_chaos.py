"""Chaos: kills, Postgres cuts and RabbitMQ cuts cost at most a delay; nothing lost, doubled, phantom or stuck.

Real ``dramatiq`` worker processes and ``dramatiq-reliable relay`` processes, every one of them
connected through TCP proxies the test owns; orders sent through ``OutboxBroker`` in
transactions (some rolled back on purpose); an idempotent actor whose effect is a row; injected
transient failures and poison orders.  The seed is printed first (``CHAOS_SEED=...``) and the
ledger last, as one JSON line.  A soak is the same test with other sizes, e.g.
``CHAOS_COUNT=10000 pytest -m chaos -s`` (see ``chaos/scenario.py`` for every knob).
"""

from __future__ import annotations

import sys

import pytest
from chaos.scenario import Run, Settings, execute

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
