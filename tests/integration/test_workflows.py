"""Workflows against real Postgres (and RabbitMQ): results feed the next step, groups join, dead steps obey the policy."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware import Callbacks
from support import Otel

from dramatiq_reliable import (
    Cancellation,
    ConfigurationError,
    DeadLetters,
    Idempotency,
    NotBound,
    PostgresBroker,
    PostgresDeadLetterStore,
    Tracing,
    build_middleware,
)
from dramatiq_reliable.cli import main
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.tracing.semconv import LINK_ROLE
from dramatiq_reliable.workflows import (
    WORKFLOW_OPTION,
    Group,
    Workflow,
    Workflows,
    cancel_workflow,
    list_workflows,
    workflow_status,
)

pytestmark = pytest.mark.integration


def _with_workflows(broker: Any) -> Any:
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(Cancellation())
    broker.add_middleware(DeadLetters())
    broker.add_middleware(Workflows())  # last: its after-hook runs first, inside the job's transaction
    dramatiq.set_broker(broker)
    return broker


#: The broker kind matters where messages travel through a worker; the rest is SQL, run once.
postgres_only = pytest.mark.parametrize("backed_broker", ["postgres"], indirect=True)


@pytest.fixture
def flowing(backed_broker: Any) -> Any:
    """A broker of each kind with Idempotency (transactional), DeadLetters and Workflows; the global broker."""
    return _with_workflows(backed_broker)


def _state(broker: Any, schema: str, id: str) -> str:
    return workflow_status(broker.database, schema, id).state


def test_results_feed_the_next_step_and_a_group_joins_into_one_step(
    flowing: Any,
    backed_queue: str,
    backed_worker: dramatiq.Worker,
    database_url: str,
    db_schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    joined: list[Any] = []

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def fetch(order_id: int) -> dict[str, int]:
        return {"order": order_id, "lines": 3}

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def price(line: int, order: dict[str, int]) -> int:
        return order["order"] * 100 + line

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def total(prices: list[int]) -> int:
        return sum(prices)

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def report(label: str, amount: int) -> None:
        joined.append((label, amount))

    workflow = Workflow(
        [
            fetch.message(7),
            Group([price.message(line) for line in range(3)]),
            total.message(),
            dramatiq.pipeline([report.message("order 7")], broker=flowing),
        ],
        broker=flowing,
    )
    with flowing.transaction():
        sent = workflow.run()
    assert [m.actor_name for m in sent] == ["fetch"] and sent[0].options[WORKFLOW_OPTION] == workflow.id
    backed_worker.start()
    wait_for(lambda: joined, timeout_ms=30_000, message="the last step never ran")
    wait_for(lambda: _state(flowing, db_schema, workflow.id) == "succeeded", timeout_ms=10_000)
    assert joined == [("order 7", 700 + 701 + 702)], "a result did not reach the next step, or a step ran twice"
    status = workflow_status(flowing.database, db_schema, workflow.id)
    assert [(s.stage, s.actor_name, s.state) for s in status.steps] == [
        (0, "fetch", "done"),
        (1, "price", "done"),
        (1, "price", "done"),
        (1, "price", "done"),
        (2, "total", "done"),
        (3, "report", "done"),
    ]
    assert status.steps[4].result == 2103
    assert main(["workflows", "show", workflow.id, "--database-url", database_url, "--schema", db_schema]) == 0
    shown = capsys.readouterr().out
    assert "succeeded" in shown and "total" in shown
    assert main(["workflows", "show", "nope", "--database-url", database_url, "--schema", db_schema]) == 7
    assert [w.id for w in list_workflows(flowing.database, db_schema, state="succeeded")] == [workflow.id]
    assert list_workflows(flowing.database, db_schema, state="running") == []
    assert main(["workflows", "list", "--database-url", database_url, "--schema", db_schema]) == 0
    assert f"{workflow.id}  succeeded  4 of 4" in capsys.readouterr().out
    capsys.readouterr()
    total_id = status.steps[4].message_id
    assert main(["jobs", "show", total_id, "--database-url", database_url, "--schema", db_schema]) == 0
    assert f"{workflow.id} (succeeded): stage 3 of 4, step 1, done" in capsys.readouterr().out


def test_a_chain_with_a_dead_middle_step_resumes_after_its_dead_letter_is_replayed(
    flowing: Any, backed_queue: str, backed_worker: dramatiq.Worker, db_schema: str
) -> None:
    broken = [True]
    finished: list[str] = []

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def first() -> str:
        return "a"

    @dramatiq.actor(queue_name=backed_queue, broker=flowing, max_retries=0)
    def middle(previous: str) -> str:
        if broken[0]:
            raise RuntimeError("the middle step fails until it is fixed")
        return previous + "b"

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def last(previous: str) -> None:
        finished.append(previous + "c")

    workflow = Workflow([first.message(), middle.message(), last.message()], if_step_dies="wait", broker=flowing)
    with flowing.transaction():
        workflow.run()
    backed_worker.start()
    wait_for(
        lambda: workflow_status(flowing.database, db_schema, workflow.id).waiting_for_replay,
        timeout_ms=30_000,
        message="the middle step never died",
    )
    store = PostgresDeadLetterStore.from_broker(flowing)
    dead = store.list().items
    assert [d.actor_name for d in dead] == ["middle"]
    assert finished == [] and _state(flowing, db_schema, workflow.id) == "running"

    broken[0] = False
    assert store.replay(ids=[dead[0].id]).replayed == 1
    wait_for(lambda: finished, timeout_ms=30_000, message="the replayed step did not resume the workflow")
    wait_for(lambda: _state(flowing, db_schema, workflow.id) == "succeeded", timeout_ms=10_000)
    assert finished == ["abc"]


@postgres_only
def test_a_dead_step_fails_the_workflow_or_is_skipped_per_policy(
    flowing: Any, backed_queue: str, backed_worker: dramatiq.Worker, db_schema: str
) -> None:
    ran: list[Any] = []

    @dramatiq.actor(queue_name=backed_queue, broker=flowing, max_retries=0)
    def child(n: int) -> int:
        if n == 1:
            raise RuntimeError("child 1 fails for good")
        return n

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def after(label: str, results: Any = None) -> None:
        ran.append((label, results))

    failing = Workflow(
        [Group([child.message(n) for n in range(3)]), after.message("fail:next")],
        on_failure=after.message("fail:on_failure"),
        broker=flowing,
    )
    skipping = Workflow(
        [Group([child.message(n) for n in range(3)]), after.message("skip:next")], if_step_dies="skip", broker=flowing
    )
    with flowing.transaction():
        failing.run()
        skipping.run()
    backed_worker.start()
    wait_for(lambda: len(ran) == 2, timeout_ms=30_000, message=lambda: f"both workflows did not finish: {ran}")
    assert sorted(ran, key=str) == [("fail:on_failure", None), ("skip:next", [0, None, 2])]
    wait_for(lambda: _state(flowing, db_schema, skipping.id) == "succeeded", timeout_ms=10_000)
    failed = workflow_status(flowing.database, db_schema, failing.id)
    assert failed.state == "failed" and "died" in (failed.error or "")
    assert failed.steps[-1].state == "cancelled", "a step after a failed stage must never be sent"


@postgres_only
def test_a_cancelled_workflow_sends_no_further_step(
    flowing: Any, backed_queue: str, db_schema: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def step(n: int, previous: Any = None) -> int:
        return n

    workflow = Workflow([step.message(1), step.message(2)], broker=flowing)
    with flowing.transaction():
        workflow.run()
    result = cancel_workflow(flowing.database, db_schema, workflow.id, by="alice", reason="wrong order")
    assert (result.changed, result.state, result.never_sent) == (True, "cancelled", 1)
    assert [job.outcome for job in result.jobs] == ["queue" if isinstance(flowing, PostgresBroker) else "outbox"]
    again = cancel_workflow(flowing.database, db_schema, workflow.id, by="bob")
    assert (again.changed, again.state) == (False, "cancelled")
    cli = ["--database-url", database_url, "--schema", db_schema, "--yes", "--by", "bob"]
    assert main(["workflows", "cancel", workflow.id, *cli]) == 0
    assert "already cancelled; nothing changed" in capsys.readouterr().out
    assert main(["workflows", "cancel", "no-such-workflow", *cli]) == 7

    # A step that was running when the workflow was cancelled finishes, and sends nothing more.
    workflows = next(m for m in flowing.middleware if isinstance(m, Workflows))
    first = dramatiq.broker.MessageProxy(workflow.stages[0][1][0])
    assert workflows.finish(flowing, first, dead=False, result=1, conn=None) == "duplicate"
    status = workflow_status(flowing.database, db_schema, workflow.id)
    assert (status.state, status.cancelled_by, [s.state for s in status.steps]) == (
        "cancelled",
        "alice",
        ["cancelled", "cancelled"],
    )


@postgres_only
def test_a_redelivered_step_neither_counts_twice_nor_sends_the_next_step_twice(
    flowing: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def step(n: int, previous: Any = None) -> int:
        return n

    workflow = Workflow([Group([step.message(1), step.message(2)]), step.message(3)], broker=flowing)
    with flowing.transaction():
        workflow.run()
    workflows = next(m for m in flowing.middleware if isinstance(m, Workflows))
    one, two = (dramatiq.broker.MessageProxy(m) for m in workflow.stages[0][1])
    assert workflows.finish(flowing, one, dead=False, result=1, conn=None) == "counted"
    assert workflows.finish(flowing, one, dead=False, result=1, conn=None) == "duplicate"
    assert workflows.finish(flowing, one, dead=True, result=None, conn=None) == "duplicate"
    assert workflows.finish(flowing, two, dead=False, result=2, conn=None) == "advance"
    assert workflows.finish(flowing, two, dead=False, result=2, conn=None) == "duplicate"
    table = "queue" if isinstance(flowing, PostgresBroker) else "outbox"
    third = workflow.stages[1][1][0].message_id
    rows = db.execute(
        psycopg.sql.SQL("SELECT body FROM {} WHERE message_id = %s").format(psycopg.sql.Identifier(db_schema, table)),
        (third,),
    ).fetchall()
    assert len(rows) == 1, "the next step was sent twice (or not at all)"
    assert dramatiq.Message.decode(bytes(rows[0][0])).args == (3, [1, 2])


@postgres_only
def test_bad_input_is_refused_before_anything_is_written(
    flowing: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def step(n: int, previous: Any = None) -> Any:
        return "x" * 70_000 if n == 9 else n

    with pytest.raises(ConfigurationError, match="not declared on this broker"):
        Workflow([dramatiq.Message(backed_queue, "nobody", (), {}, {})], broker=flowing)
    with pytest.raises(ConfigurationError, match="a workflow's step must be a message"):
        Workflow([step], broker=flowing)  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="an empty group at step 2"):
        Workflow([step.message(1), Group([])], broker=flowing)
    with pytest.raises(ConfigurationError, match="a chain or group inside a group is not supported"):
        Workflow([Group([dramatiq.pipeline([step.message(1)], broker=flowing)])], broker=flowing)  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="at least one step"):
        Workflow([], broker=flowing)
    twice = step.message(1)
    with pytest.raises(ConfigurationError, match="in the workflow twice"):
        Workflow([twice, twice], broker=flowing)
    with pytest.raises(ConfigurationError, match="if_step_dies must be one of 'fail', 'skip', 'wait', got 'ignore'"):
        Workflow([step.message(1)], if_step_dies="ignore", broker=flowing)  # type: ignore[arg-type]
    with pytest.raises(NotBound, match="wrap run\\(\\) in broker.transaction"):
        Workflow([step.message(1)], broker=flowing).run()
    count = db.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {}").format(psycopg.sql.Identifier(db_schema, "workflows"))
    )
    assert count.fetchone() == (0,)

    # A result too large for the next step fails the workflow with the fix; nothing more is sent.
    big = Workflow([step.message(9), step.message(10)], broker=flowing)
    with flowing.transaction():
        big.run()
    with pytest.raises(ConfigurationError, match="exists already; pass a new id"), flowing.transaction():
        big.run()
    workflows = next(m for m in flowing.middleware if isinstance(m, Workflows))
    first = dramatiq.broker.MessageProxy(big.stages[0][1][0])
    assert workflows.finish(flowing, first, dead=False, result="x" * 70_000, conn=None) == "failed"
    status = workflow_status(flowing.database, db_schema, big.id)
    assert status.state == "failed" and "over the limit of 65536; store the data in a table" in (status.error or "")
    assert status.steps[1].state == "cancelled"


def test_one_trace_per_workflow_and_the_join_step_links_to_each_child(
    database_url: str, db_schema: str, otel: Otel
) -> None:
    tracing = Tracing(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    broker = PostgresBroker(
        database=database_url,
        schema=db_schema,
        middleware=build_middleware(middleware=[tracing, Idempotency(), Workflows()]),
    )
    dramatiq.set_broker(broker)
    joined: list[Any] = []

    @dramatiq.actor(queue_name="traced", broker=broker)
    def child(n: int) -> int:
        return n

    @dramatiq.actor(queue_name="traced", broker=broker)
    def join(results: list[int]) -> None:
        joined.append(results)

    workflow = Workflow([Group([child.message(1), child.message(2)]), join.message()], broker=broker)
    with otel.tracer_provider.get_tracer("test").start_as_current_span("request") as request, broker.transaction():
        workflow.run()
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        wait_for(lambda: joined, timeout_ms=30_000, message="the join step never ran")
        wait_for(lambda: len(otel.spans("process traced")) == 3, timeout_ms=10_000)
    finally:
        worker.stop()
        broker.close()
    spans = otel.spans("process traced")
    assert {s.context.trace_id for s in spans} == {request.get_span_context().trace_id}, "not one trace"
    (join_span,) = (s for s in spans if s.attributes["dramatiq.actor.name"] == "join")
    children = {s.context.span_id for s in spans if s.attributes["dramatiq.actor.name"] == "child"}
    linked = {link.context.span_id for link in join_span.links if link.attributes[LINK_ROLE] == "workflow_child"}
    assert linked == children


def _two_steps_running(flowing: Any, queue: str) -> tuple[Workflow, Workflows, dramatiq.broker.MessageProxy]:
    """A workflow of two steps, run; its middleware and its first step as a worker would hold it."""

    @dramatiq.actor(queue_name=queue, broker=flowing)
    def step(n: int, previous: Any = None) -> int:
        return n

    workflow = Workflow([step.message(1), step.message(2)], broker=flowing)
    with flowing.transaction():
        workflow.run()
    workflows = next(m for m in flowing.middleware if isinstance(m, Workflows))
    return workflow, workflows, dramatiq.broker.MessageProxy(workflow.stages[0][1][0])


@postgres_only
def test_a_cancel_waits_for_a_step_sending_the_next_stage_then_cancels_that_stage(
    flowing: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    workflow, workflows, first = _two_steps_running(flowing, backed_queue)
    second = workflow.stages[1][1][0].message_id
    results: list[Any] = []
    with flowing.database.connection() as job, job.transaction():
        # The first step finishes its stage in its job's transaction, which is still open.
        assert workflows.finish(flowing, first, dead=False, result=1, conn=job) == "advance"
        canceller = threading.Thread(
            target=lambda: results.append(cancel_workflow(flowing.database, db_schema, workflow.id, by="alice"))
        )
        canceller.start()
        wait_for(
            lambda: (
                db.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    (f'%Cancel a running workflow%"{db_schema}".workflows%',),
                ).fetchone()
                == (1,)
            ),
            message="the cancel did not wait for the workflow's row",
        )
        assert not results
    canceller.join(timeout=30)
    (result,) = results
    assert [(job.message_id, job.outcome) for job in result.jobs] == [(second, "queue")]
    status = workflow_status(flowing.database, db_schema, workflow.id)
    assert (status.state, [s.state for s in status.steps]) == ("cancelled", ["done", "cancelled"])
    left = db.execute(
        psycopg.sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(
            psycopg.sql.Identifier(db_schema, "queue")
        ),
        (second,),
    ).fetchone()
    assert left == (0,), "the next stage's message was left to run after the cancel"


@postgres_only
def test_a_cancel_does_not_wait_for_a_step_in_the_middle_of_finishing_and_that_step_sends_nothing(
    flowing: Any, backed_queue: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    workflow, workflows, first = _two_steps_running(flowing, backed_queue)
    results: list[Any] = []
    with flowing.database.connection() as job, job.transaction():
        # The step's finish has taken its own row's lock (as the finish's first statement does);
        # waiting for it here while holding the workflow's row would deadlock with the finish.
        job.execute(
            psycopg.sql.SQL("SELECT 1 FROM {} WHERE message_id = %s FOR UPDATE").format(
                psycopg.sql.Identifier(db_schema, "workflow_steps")
            ),
            (first.message_id,),
        )
        canceller = threading.Thread(
            target=lambda: results.append(cancel_workflow(flowing.database, db_schema, workflow.id, by="alice"))
        )
        canceller.start()
        wait_for(lambda: results, message="the cancel waited for the finishing step's row")
        assert workflows.finish(flowing, first, dead=False, result=1, conn=job) == "stopped"
    canceller.join(timeout=30)
    assert (results[0].changed, results[0].never_sent, results[0].jobs) == (True, 1, ())
    status = workflow_status(flowing.database, db_schema, workflow.id)
    assert (status.state, [s.state for s in status.steps]) == ("cancelled", ["done", "cancelled"])


@postgres_only
def test_children_finishing_at_once_on_eight_threads_send_the_join_step_once_with_every_result(
    flowing: Any, backed_queue: str, db_schema: str
) -> None:
    joined: list[list[int]] = []

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def child(n: int) -> int:
        return n * n

    @dramatiq.actor(queue_name=backed_queue, broker=flowing)
    def join(squares: list[int]) -> None:
        joined.append(squares)

    workflow = Workflow([Group([child.message(n) for n in range(40)]), join.message()], broker=flowing)
    with flowing.transaction():
        workflow.run()
    worker = dramatiq.Worker(flowing, worker_timeout=20, worker_threads=8)
    worker.start()
    try:
        wait_for(lambda: _state(flowing, db_schema, workflow.id) == "succeeded", timeout_ms=30_000)
    finally:
        worker.stop()
    assert joined == [[n * n for n in range(40)]], "the join step ran twice, or without every child's result"
