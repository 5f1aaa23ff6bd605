"""Chaos for workflows: a chain with a fan-out in the middle survives SIGKILLed workers and Postgres cuts, step by step once.

Two worker processes (``workflow_worker_app.py``) reach Postgres through a TCP proxy the test owns
and run ``start -> Group(child x N) -> join -> finish``, each step writing its effect in its own job
transaction.  The schedule of chaos: the worker running ``start`` (whose transaction sends the whole
group) is SIGKILLed in flight (and restarted, as a process manager would); while the group runs,
the proxy is stopped once (every connection reset, no new one accepted for a moment) and a
worker SIGKILLed, each at a set share of the children done; the worker running the join is
SIGKILLed in flight; Postgres is cut while ``finish`` (whose transaction marks the workflow
succeeded) runs.  (A batch's chaos test cuts and kills more often mid-fan-out; here the aim is
every kind of step.)  A single step logs each run as it starts and then works ``STEP_MS``, so the test
aims at that very run.  Then: one effect per step and per child, the join run once and after every
child (it saw all their effects and their results in the group's order), one first send of each
step (a trigger on the queue or outbox table records every send, so a double send is seen even
though ``Idempotency`` would skip the second run; a retry carries its ``retry_decision``), and
``workflow_status`` ``succeeded``, every step done.

The second test kills nothing: a chain whose middle step dies (``max_retries=0``) under
``if_step_dies="wait"`` is resumed by ``dramatiq-reliable dead-letters replay`` (the real CLI, a
process of its own) while a worker process runs, and the rest of the chain runs once.

CI runs each once per broker; ``DR_SOAK_RUNS=10`` repeats the chaos run ten times (a fresh workflow each time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from dramatiq_reliable.workflows import Group, Workflow, workflow_status

pytestmark = [pytest.mark.integration, pytest.mark.acceptance, pytest.mark.timeout(900)]

APP = Path(__file__).with_name("workflow_worker_app.py")
#: A group's counter is one row (docs/workflows.md): tens or hundreds of children, not thousands.
CHILDREN = int(os.environ.get("DR_WORKFLOW_CHAOS_CHILDREN", "100"))
RUNS = int(os.environ.get("DR_SOAK_RUNS", "1"))
#: How long each child and each single step work: long enough that each kill and cut lands mid-group
#: (eight threads take 100 children in about half a second) and mid-step.
CHILD_MS, STEP_MS = 40, 300
#: How long each Postgres outage lasts (the proxy's port closed, every connection reset).
CUT_S = 0.5
#: (when, what happens then): when is a share of the children done, or a single step's name (as
#: soon as a run of it has started); "kill its worker" SIGKILLs the process running that step.
SCHEDULE: tuple[tuple[float | str, str], ...] = (
    ("start", "kill its worker"),
    (0.3, "cut postgres"),
    (0.6, "kill worker-1"),
    ("join", "kill its worker"),
    ("finish", "cut postgres"),
)


_SETUP = """
CREATE TABLE {schema}.effects (run int NOT NULL, step text NOT NULL, n int NOT NULL, seen bigint, pid int NOT NULL);
CREATE TABLE {schema}.switches (run int PRIMARY KEY, broken boolean NOT NULL);
CREATE TABLE {schema}.sends (actor_name text NOT NULL, message_id text NOT NULL, options jsonb NOT NULL);
CREATE FUNCTION {schema}.note_send() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {schema}.sends (actor_name, message_id, options)
    VALUES (NEW.actor_name, NEW.message_id, (convert_from(NEW.body, 'UTF8')::jsonb -> 'options') - 'traceback');
    RETURN NEW;
END $$;
-- A retry is a new row that carries its retry_decision (a failed attempt, or a commit whose outcome
-- was unknown: unknown_outcome_retries, no retries): not a second send of the step.
CREATE VIEW {schema}.first_sends AS SELECT * FROM {schema}.sends WHERE NOT options ? 'retry_decision';
CREATE TRIGGER note_send AFTER INSERT ON {schema}.{table} FOR EACH ROW EXECUTE FUNCTION {schema}.note_send();
"""


def _rows(db: psycopg.Connection[Any], query: str, schema: str, *params: Any) -> list[tuple[Any, ...]]:
    return db.execute(sql.SQL(query).format(schema=sql.Identifier(schema)), params).fetchall()  # type: ignore[arg-type]


def _count(db: psycopg.Connection[Any], schema: str, run: int, step: str) -> int:
    rows = _rows(db, "SELECT count(*) FROM {schema}.effects WHERE run = %s AND step = %s", schema, run, step)
    return int(rows[0][0])


@pytest.fixture(params=["postgres", "outbox"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


Setup = tuple[Any, dict[str, "dramatiq.Actor[Any, Any]"], dict[str, str]]


@pytest.fixture
def setup(
    kind: str, database_url: str, db_schema: str, db: psycopg.Connection[Any], request: pytest.FixtureRequest
) -> Iterator[Setup]:
    """The test's own broker of the kind under test (it only sends: the workflow's first stage), its actors and env."""
    queue = str(request.getfixturevalue("queue_name")) if kind == "outbox" else "workflow_chaos"
    if kind == "postgres":
        broker: Any = PostgresBroker(database=database_url, schema=db_schema)
    else:
        broker = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
    table = "queue" if kind == "postgres" else "outbox"
    db.execute(sql.SQL(_SETUP).format(schema=sql.Identifier(db_schema), table=sql.Identifier(table)))
    # The worker app's actors, declared here too so the test can build their messages (bodies never run here).
    actors = {
        name: dramatiq.actor(lambda *args: None, actor_name=name, queue_name=queue, broker=broker)
        for name in ("start", "child", "join", "finish", "fragile", "after")
    }
    env = {**os.environ, "SCHEMA": db_schema, "QUEUE": queue, "BROKER": kind}
    if kind == "outbox":
        env["RABBITMQ_URL"] = str(request.getfixturevalue("rabbitmq_url"))
    yield broker, actors, env
    broker.close()


def test_a_chain_with_a_fan_out_runs_every_step_once_through_kills_and_postgres_cuts(
    kind: str,
    setup: Setup,
    database_url: str,
    db_schema: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    sender, actors, env = setup
    proxy = TcpProxy.to(database_url).start()
    env = {**env, "DATABASE_URL": proxy.url, "CHILD_MS": str(CHILD_MS), "STEP_MS": str(STEP_MS)}
    # Dramatiq restarts a consumer 3 s after a connection error (a PostgresBroker's after each cut),
    # and a worker's stop waits for it: a shorter pause keeps CI short and changes nothing checked.
    env.setdefault("dramatiq_restart_delay", "500")
    workers = Workers(APP, env, tmp_path)
    ledgers = []
    try:
        for run in range(RUNS):
            ledger = _run(run, kind, sender, actors, db, db_schema, proxy, workers)
            print(json.dumps(ledger))
            ledgers.append(ledger)
            expected_effects = {"start": (1, 1), "child": (CHILDREN, CHILDREN), "join": (1, 1), "finish": (1, 1)}
            assert ledger["effects"] == expected_effects, f"{ledger}\n{workers.tails()}"
            assert ledger["join"] == [{"in_order": 1, "children_seen": CHILDREN}], f"{ledger}\n{workers.tails()}"
            assert ledger["finish_total"] == [sum(range(CHILDREN))], f"{ledger}\n{workers.tails()}"
            assert ledger["first_sends"] == {"start": 1, "child": CHILDREN, "join": 1, "finish": 1}, (
                f"a step was sent twice (or never): {ledger}\n{workers.tails()}"
            )
            assert ledger["state"] == "succeeded" and ledger["steps"] == {"done": CHILDREN + 3}, ledger
            assert ledger["attempts"]["start"] >= 2 and ledger["attempts"]["join"] >= 2, (
                f"the start and the join steps were not killed in flight: {ledger}"
            )
            assert ledger["chaos_in_time"] == [f"{when}: {what}" for when, what in SCHEDULE], (
                f"every kill and cut must land before the step it aims at committed, or the run proved nothing: {ledger}"
            )
    finally:
        workers.close()
        proxy.stop()
    print(json.dumps({"workflow_chaos": kind, "runs": len(ledgers), "children": CHILDREN, "all_once": True}))


def _attempts(workers: Workers, run: int, step: str) -> list[int]:
    """The pids of the runs of ``step`` started in this run (the worker app logs each), committed or not."""
    marker = f"{step} attempt run={run} pid="
    return [
        int(line[len(marker) :])
        for log in workers.logs
        if log.exists()
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(marker)
    ]


def _run(
    run: int,
    kind: str,
    sender: Any,
    actors: dict[str, dramatiq.Actor[Any, Any]],
    db: psycopg.Connection[Any],
    schema: str,
    proxy: TcpProxy,
    workers: Workers,
) -> dict[str, Any]:
    """One workflow through the schedule of kills and cuts; the ledger of what happened."""
    workflow = Workflow(
        [
            actors["start"].message(run),
            Group([actors["child"].message(run, n) for n in range(CHILDREN)]),
            actors["join"].message(run),
            actors["finish"].message(run),
        ],
        broker=sender,
    )
    with sender.transaction():
        workflow.run()
    started = time.monotonic()
    for i in range(len(workers.processes)):
        workers.start(i)

    chaos: list[str] = []
    timeline: list[float] = []  # seconds from the workers' start to each event
    for when, what in SCHEDULE:
        # What the event aims at: the step itself, or the join (every child's event lands before it).
        aim = when if isinstance(when, str) else "join"

        def reached(when: float | str = when) -> bool:
            workers.keep_up()
            if isinstance(when, str):
                return bool(_attempts(workers, run, when))
            return _count(db, schema, run, "child") >= when * CHILDREN

        wait_for(
            reached,
            timeout_ms=120_000,
            interval_ms=20,
            message=lambda when=when: (
                f"run {run}: waiting for {when!r} ({_count(db, schema, run, 'child')} of {CHILDREN} children "
                f"done)\n{workers.tails()}"
            ),
        )
        pending = _count(db, schema, run, aim) == 0
        timeline.append(round(time.monotonic() - started, 1))
        if what == "kill its worker":
            pid = _attempts(workers, run, str(when))[-1]
            running = [i for i, process in enumerate(workers.processes) if process is not None and process.pid == pid]
            assert running, f"run {run}: the worker running {when} (pid {pid}) is gone already"
            workers.kill(running[0])
        elif what.startswith("kill"):
            workers.kill(int(what[-1]))
        else:
            proxy.stop()
            time.sleep(CUT_S)  # the outage itself, not a wait for a condition
            proxy.start()
        if pending:
            chaos.append(f"{when}: {what}")

    def finished() -> bool:
        workers.keep_up()
        return workflow_status(db, schema, workflow.id).state != "running"

    wait_for(
        finished, timeout_ms=180_000, interval_ms=50, message=lambda: f"run {run}: never finished\n{workers.tails()}"
    )
    elapsed = time.monotonic() - started
    # Stop gracefully: whatever is in flight finishes, so a late second run of a step would be counted.
    workers.stop()
    stopped = time.monotonic() - started - elapsed
    status = workflow_status(db, schema, workflow.id)
    effects = _rows(
        db,
        "SELECT step, count(*), count(DISTINCT n) FROM {schema}.effects WHERE run = %s GROUP BY step",
        schema,
        run,
    )
    ids = [step.message_id for step in status.steps]
    sends = _rows(
        db,
        "SELECT actor_name, count(*) FROM {schema}.first_sends WHERE message_id = ANY(%s) GROUP BY actor_name",
        schema,
        ids,
    )
    steps: dict[str, int] = {}
    for step in status.steps:
        steps[step.state] = steps.get(step.state, 0) + 1
    return {
        "run": run,
        "broker": kind,
        "children": CHILDREN,
        "seconds": round(elapsed, 1),
        "stop_seconds": round(stopped, 1),
        "effects": {str(step): (int(rows), int(distinct)) for step, rows, distinct in effects},
        "join": [
            {"in_order": int(n), "children_seen": int(seen)}
            for n, seen in _rows(
                db, "SELECT n, seen FROM {schema}.effects WHERE run = %s AND step = 'join'", schema, run
            )
        ],
        "finish_total": [
            int(n)
            for (n,) in _rows(db, "SELECT n FROM {schema}.effects WHERE run = %s AND step = 'finish'", schema, run)
        ],
        "first_sends": {str(actor): int(count) for actor, count in sends},
        "sent_twice": [
            options
            for (options,) in _rows(
                db,
                "SELECT options FROM {schema}.first_sends WHERE message_id IN (SELECT message_id FROM "
                "{schema}.first_sends GROUP BY message_id HAVING count(*) > 1) ORDER BY message_id",
                schema,
            )
        ],
        "state": status.state,
        "steps": steps,
        "chaos_in_time": chaos,
        "timeline": timeline,
        # Runs of each single step started (its commits are "effects"): more than one is a run killed in flight.
        "attempts": {step: len(_attempts(workers, run, step)) for step in ("start", "join", "finish")},
        "worker_restarts_on_their_own": workers.restarts,
    }


def test_a_chain_whose_middle_step_died_resumes_once_when_the_cli_replays_its_dead_letter(
    kind: str,
    setup: Setup,
    database_url: str,
    db_schema: str,
    db: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    sender, actors, env = setup
    run = 0
    _rows(db, "INSERT INTO {schema}.switches (run, broken) VALUES (%s, true) RETURNING run", db_schema, run)
    workflow = Workflow(
        [actors["start"].message(run), actors["fragile"].message(run), actors["after"].message(run)],
        if_step_dies="wait",
        broker=sender,
    )
    with sender.transaction():
        workflow.run()
    workers = Workers(APP, {**env, "DATABASE_URL": database_url}, tmp_path, count=1)
    workers.start(0)
    try:
        wait_for(
            lambda: workflow_status(db, db_schema, workflow.id).waiting_for_replay,
            timeout_ms=60_000,
            message=lambda: f"the middle step never died\n{workers.tails()}",
        )
        dead = _rows(db, "SELECT id, actor_name FROM {schema}.dead_letters WHERE state = 'dead'", db_schema)
        assert [actor for _, actor in dead] == ["fragile"], dead
        assert (_count(db, db_schema, run, "fragile"), _count(db, db_schema, run, "after")) == (0, 0), (
            "the dead step's effect must roll back with it, and nothing after it may run"
        )
        assert workflow_status(db, db_schema, workflow.id).state == "running"

        _rows(db, "UPDATE {schema}.switches SET broken = false WHERE run = %s RETURNING run", db_schema, run)
        replay = subprocess.run(
            [
                sys.executable,
                "-m",
                "dramatiq_reliable",
                "dead-letters",
                "replay",
                str(dead[0][0]),
                "--yes",
                "--database-url",
                database_url,
                "--schema",
                db_schema,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
        wait_for(
            lambda: workflow_status(db, db_schema, workflow.id).state != "running",
            timeout_ms=60_000,
            message=lambda: f"the replayed step did not resume the workflow\n{workers.tails()}",
        )
        # Stop gracefully: a second run of a step still in flight would be counted below.
        workers.stop()
    finally:
        workers.close()
    status = workflow_status(db, db_schema, workflow.id)
    assert (status.state, [s.state for s in status.steps]) == ("succeeded", ["done", "done", "done"])
    effects = _rows(db, "SELECT step, n FROM {schema}.effects WHERE run = %s ORDER BY step", db_schema, run)
    assert effects == [("after", 1), ("fragile", 0), ("start", 0)], f"each step once, 'after' fed 'fixed': {effects}"
    sends = _rows(
        db,
        "SELECT actor_name, count(*) FROM {schema}.first_sends WHERE message_id = ANY(%s) AND actor_name <> 'fragile' "
        "GROUP BY actor_name ORDER BY actor_name",
        db_schema,
        [step.message_id for step in status.steps],
    )
    # The replay is a send of its own, so 'fragile' is left out; the steps around it are sent once.
    assert sends == [("after", 1), ("start", 1)], sends
