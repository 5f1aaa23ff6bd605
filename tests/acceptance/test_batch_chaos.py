"""Chaos for batches: workers SIGKILLed and Postgres cut twice, and the callback still runs once, after every child.

Two worker processes (``batch_worker_app.py``) reach Postgres through a TCP proxy the test owns.
While a batch of ``DR_BATCH_CHAOS_CHILDREN`` (2,000) children runs, the test SIGKILLs each worker
once (restarting it, as a process manager would) and stops the proxy twice (every connection of
every worker reset, no new one accepted for a moment), each at a set share of the children done.
Then: one callback run that saw every child's effect, one enqueue of it (a trigger on the queue or
outbox table counts them, so a double fire is seen even though ``Idempotency`` would skip the
second run), one effect per child and the batch ``succeeded`` with nothing pending or dead.

CI runs once per broker; ``DR_SOAK_RUNS=10`` repeats each run ten times (a fresh batch each time).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from support import TcpProxy
from worker_apps import Workers

from dramatiq_reliable import OutboxBroker, PostgresBroker
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.workflows import Batch, batch_status

pytestmark = [pytest.mark.integration, pytest.mark.acceptance, pytest.mark.timeout(900)]

APP = Path(__file__).with_name("batch_worker_app.py")
CHILDREN = int(os.environ.get("DR_BATCH_CHAOS_CHILDREN", "2000"))
RUNS = int(os.environ.get("DR_SOAK_RUNS", "1"))
#: How long each Postgres outage lasts (the proxy's port closed, every connection reset).
CUT_S = 1.0
#: (share of children finished, what happens then): each worker killed once, Postgres cut twice.
SCHEDULE = ((0.15, "kill worker-0"), (0.3, "cut postgres"), (0.5, "kill worker-1"), (0.7, "cut postgres"))

_SETUP = """
CREATE TABLE {schema}.effects (run int NOT NULL, n int NOT NULL, pid int NOT NULL);
CREATE TABLE {schema}.reports (run int NOT NULL, children_seen bigint NOT NULL, pid int NOT NULL);
CREATE TABLE {schema}.callback_enqueues (message_id text NOT NULL, retry_decision text);
CREATE FUNCTION {schema}.note_callback() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.actor_name = 'report' THEN
        INSERT INTO {schema}.callback_enqueues (message_id, retry_decision)
        VALUES (NEW.message_id, convert_from(NEW.body, 'UTF8')::jsonb -> 'options' ->> 'retry_decision');
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER note_callback AFTER INSERT ON {schema}.{table} FOR EACH ROW EXECUTE FUNCTION {schema}.note_callback();
"""


def _one(db: psycopg.Connection[Any], query: str, schema: str, *params: Any) -> Any:
    row = db.execute(sql.SQL(query).format(schema=sql.Identifier(schema)), params).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0]


@pytest.fixture(params=["postgres", "outbox"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sender(kind: str, database_url: str, db_schema: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The test's own broker of the kind under test: it only sends (the batch and its children)."""
    if kind == "postgres":
        broker: Any = PostgresBroker(database=database_url, schema=db_schema)
    else:
        broker = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
    yield broker
    broker.close()


def test_a_batch_fires_its_callback_once_after_every_child_through_kills_and_postgres_cuts(
    kind: str,
    sender: Any,
    database_url: str,
    db_schema: str,
    db: psycopg.Connection[Any],
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    queue = str(request.getfixturevalue("queue_name")) if kind == "outbox" else "batch_chaos"
    table = "queue" if kind == "postgres" else "outbox"
    db.execute(sql.SQL(_SETUP).format(schema=sql.Identifier(db_schema), table=sql.Identifier(table)))
    child = dramatiq.actor(lambda run, n: None, actor_name="child", queue_name=queue, broker=sender)
    report = dramatiq.actor(lambda run: None, actor_name="report", queue_name=queue, broker=sender)

    proxy = TcpProxy.to(database_url).start()
    env = {**os.environ, "DATABASE_URL": proxy.url, "SCHEMA": db_schema, "QUEUE": queue, "BROKER": kind}
    if kind == "outbox":
        env["RABBITMQ_URL"] = str(request.getfixturevalue("rabbitmq_url"))
    workers = Workers(APP, env, tmp_path)
    ledgers = []
    try:
        for run in range(RUNS):
            ledger = _run(run, kind, sender, child, report, db, db_schema, proxy, workers)
            print(json.dumps(ledger))
            ledgers.append(ledger)
            verdicts = (ledger["reports"], ledger["children_seen"], ledger["enqueues"], ledger["effects"])
            assert verdicts == (1, [CHILDREN], 1, (CHILDREN, CHILDREN)), f"{ledger}\n{workers.tails()}"
            assert ledger["state"] == ("succeeded", CHILDREN, 0, 0), f"{ledger}\n{workers.tails()}"
            assert ledger["chaos_before_fire"] == [event for _, event in SCHEDULE], (
                f"every kill and cut must land while children were pending, or the run proved nothing: {ledger}"
            )
    finally:
        workers.close()
        proxy.stop()
    print(json.dumps({"batch_chaos": kind, "runs": len(ledgers), "children": CHILDREN, "all_once": True}))


def _run(
    run: int,
    kind: str,
    sender: Any,
    child: dramatiq.Actor[Any, Any],
    report: dramatiq.Actor[Any, Any],
    db: psycopg.Connection[Any],
    schema: str,
    proxy: TcpProxy,
    workers: Workers,
) -> dict[str, Any]:
    """One batch through the schedule of kills and cuts; the ledger of what happened."""
    batch = Batch(callback=report.message(run), broker=sender)
    with sender.transaction(), batch:
        for n in range(CHILDREN):
            batch.add(child.message(run, n))
    started = time.monotonic()
    for i in range(len(workers.processes)):
        workers.start(i)

    def finished() -> int:
        status = batch_status(db, schema, batch.id)
        return status.done + status.dead

    chaos: list[str] = []
    for share, event in SCHEDULE:

        def reached(share: float = share) -> bool:
            workers.keep_up()
            return finished() >= share * CHILDREN

        wait_for(
            reached,
            timeout_ms=120_000,
            interval_ms=50,
            message=lambda share=share: (
                f"run {run}: {finished()} of {CHILDREN} children finished, waiting for {share:.0%}\n{workers.tails()}"
            ),
        )
        pending = batch_status(db, schema, batch.id).fired_at is None
        if event.startswith("kill"):
            workers.kill(int(event[-1]))
        else:
            proxy.stop()
            time.sleep(CUT_S)  # the outage itself, not a wait for a condition
            proxy.start()
        if pending:
            chaos.append(event)

    def fired() -> bool:
        workers.keep_up()
        return bool(_one(db, "SELECT count(*) FROM {schema}.reports WHERE run = %s", schema, run))

    wait_for(
        fired,
        timeout_ms=180_000,
        interval_ms=50,
        message=lambda: f"run {run}: the callback never ran\n{workers.tails()}",
    )
    elapsed = time.monotonic() - started
    # Stop gracefully: whatever is in flight finishes, so a late second callback would be counted.
    workers.stop()
    status = batch_status(db, schema, batch.id)
    reports = db.execute(
        sql.SQL("SELECT children_seen FROM {}.reports WHERE run = %s").format(sql.Identifier(schema)), (run,)
    ).fetchall()
    effects = db.execute(
        sql.SQL("SELECT count(*), count(DISTINCT n) FROM {}.effects WHERE run = %s").format(sql.Identifier(schema)),
        (run,),
    ).fetchone()
    return {
        "run": run,
        "broker": kind,
        "children": CHILDREN,
        "seconds": round(elapsed, 1),
        "reports": len(reports),
        "children_seen": [int(row[0]) for row in reports],
        # A retry of the callback itself is a new row with its options.retry_decision set (a commit whose
        # outcome was unknown sets unknown_outcome_retries, not retries): not a second fire.
        "enqueues": _one(
            db,
            "SELECT count(*) FROM {schema}.callback_enqueues WHERE message_id = %s AND retry_decision IS NULL",
            schema,
            batch.callback.message_id,
        ),
        "effects": tuple(int(value) for value in effects) if effects else None,
        "state": (status.state, status.done, status.dead, status.pending),
        "chaos_before_fire": chaos,
        "worker_restarts_on_their_own": workers.restarts,
    }
