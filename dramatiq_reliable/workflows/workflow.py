"""Workflows: a chain of steps where a step may be a group; each result feeds the next step.

**Shape.**  ``Workflow([a.message(x), Group([b.message(1), b.message(2)]), c.message()])`` runs
``a``, then both ``b`` at once, then ``c``.  Each stage's result is appended to the next stage's
arguments, as Dramatiq's ``pipeline`` does: a step's return value after a single step, the list
of its children's return values (in the order given) after a group.  A message with the option
``pipe_ignore=True`` gets nothing appended, as in Dramatiq.  ``dramatiq.pipeline`` and
``dramatiq.group`` objects are accepted in the list (a pipeline is flattened into steps, a group
of messages becomes a :class:`Group`); a pipeline or a group *inside* a group is refused: a
group joins into one step here, it does not run chains side by side (run one workflow each).

**Exactly once.**  :meth:`Workflow.run` writes the workflow, every step and the first stage's
messages in the caller's transaction.  The :class:`Workflows` middleware marks each step done in
the step's own job transaction (with ``Idempotency`` in transactional mode: the one that commits
the actor's writes and its key) and, when that step finishes its stage, sends the next stage's
messages in that same transaction.  A crash before the commit loses nothing; a redelivered step
finds itself counted and sends nothing.  With no job transaction (no ``Idempotency``, or its
record mode) the mark is a transaction of its own after the actor returns, and it fails closed:
tried again while the worker holds the message, then the message is failed into the dead
letters instead of acked (see ``_failclosed``), so an outage never leaves the workflow waiting
for a step that ran.

**Results** are stored as JSON (``jsonb``) and must be small: at most :data:`MAX_RESULT_BYTES`
encoded.  A result that is not JSON or is larger fails the workflow with an error that says so
(the step's own writes stay committed: it did run).  Return an id and keep the data in your
tables.

**Dead steps** (``if_step_dies``): ``"fail"`` fails the workflow (its unsent steps are never
sent, ``on_failure`` is sent if given); ``"skip"`` counts the step as finished, its result
``None``; ``"wait"`` holds its stage until the step's dead letter is replayed, and the replay,
once it succeeds, resumes the workflow.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name
from dramatiq.composition import group as dramatiq_group
from dramatiq.composition import pipeline as dramatiq_pipeline
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from .. import _sql
from .._checks import check_choice, check_ms, check_text
from .._util import first_line, redact
from ..binding import ambient_connection, bind, bound_connection, check_joinable
from ..database import Database
from ..errors import ConfigurationError, DatabaseUnavailable, NotBound
from ..schema import WORKFLOW_VERSION, ensure_ready
from ._failclosed import DEFAULT_WRITE_TIMEOUT_MS, FailedClosed, dead_unrecorded, left_to_commit, write_until
from .batch import _declared, _target

__all__ = ["MAX_RESULT_BYTES", "WORKFLOW_LINKS_OPTION", "WORKFLOW_OPTION", "Group", "Workflow", "Workflows"]

logger = logging.getLogger("dramatiq_reliable.workflows.workflow")

#: The message option naming the workflow a step belongs to (retries and replays keep it).
WORKFLOW_OPTION = "workflow_id"
#: The W3C traceparents of the previous stage's runs, set on a step sent after a group: the
#: ``Tracing`` middleware adds a span link per child.
WORKFLOW_LINKS_OPTION = "workflow_links"
#: The largest result a step may hand to the next one (JSON, UTF-8 bytes).  Results live in a
#: row read whenever the next stage is sent; a megabyte there would make every read slow.
MAX_RESULT_BYTES = 64 * 1024
#: The most steps one workflow may have: every step is a row written by ``run()``.  A fan-out
#: of more children is a :class:`~dramatiq_reliable.workflows.Batch`, whose counter is sharded.
MAX_STEPS = 1000

#: The most span links a step after a group carries (OpenTelemetry's SDK keeps 128 by default).
MAX_LINKS = 128

IfStepDies = Literal["fail", "skip", "wait"]


class Group:
    """Steps run at the same time; the stage after them gets the list of their results.

    >>> Group([resize.message(photo, size) for size in (64, 256)])  # doctest: +SKIP
    """

    def __init__(self, messages: Iterable[Message[Any]]) -> None:
        self.messages = list(messages)

    def __repr__(self) -> str:
        return f"Group({self.messages!r})"


def _stages(broker: Broker, steps: object) -> list[tuple[bool, list[Message[Any]]]]:
    if isinstance(steps, dramatiq_pipeline):
        steps = list(steps.messages)
    if isinstance(steps, (str, bytes, Message)) or not isinstance(steps, Iterable):
        raise ConfigurationError(
            f"a workflow's steps must be a list, got {steps!r}; pass [a.message(...), Group([...]), ...]"
        )
    stages: list[tuple[bool, list[Message[Any]]]] = []
    for step in steps:
        if isinstance(step, dramatiq_pipeline):
            stages.extend((False, [_declared(broker, m, "a workflow's step")]) for m in step.messages)
        elif isinstance(step, (Group, dramatiq_group)):
            children = step.messages if isinstance(step, Group) else step.children
            if not children:
                raise ConfigurationError(
                    f"an empty group at step {len(stages) + 1}; a group joins its children's results into the next "
                    "step, so give it at least one message (or leave the group out)"
                )
            for child in children:
                if isinstance(child, (Group, dramatiq_group, dramatiq_pipeline)):
                    raise ConfigurationError(
                        f"a group's child must be a message, got {type(child).__name__}; a chain or group inside a "
                        "group is not supported: run it as a workflow of its own"
                    )
            stages.append((True, [_declared(broker, m, "a group's child") for m in children]))
        else:
            stages.append((False, [_declared(broker, step, "a workflow's step")]))
    if not stages:
        raise ConfigurationError("a workflow needs at least one step; pass [a.message(...), ...]")
    count = sum(len(messages) for _, messages in stages)
    if count > MAX_STEPS:
        raise ConfigurationError(
            f"a workflow of {count} steps is over the limit of {MAX_STEPS}; fan out that many jobs with a Batch "
            "(its callback is the join) and chain the batch's callback"
        )
    seen: set[str] = set()
    for _, messages in stages:
        for message in messages:
            if message.message_id in seen:
                raise ConfigurationError(
                    f"message {message.message_id!r} ({message.actor_name}) is in the workflow twice; build one "
                    "message per step (actor.message(...) each time)"
                )
            seen.add(message.message_id)
    return stages


class Workflow:
    """A chain of steps, where a step may be a :class:`Group`; each stage's result feeds the next.

    Parameters:
      steps: messages of declared actors and groups of them, in order (see the module).
      if_step_dies: ``"fail"`` (default), ``"skip"`` or ``"wait"`` (for a replay).
      on_failure: ``actor.message(...)`` sent once when the workflow fails; ``None`` sends nothing.
      broker: default ``dramatiq.get_broker()``; an ``OutboxBroker`` or a ``PostgresBroker``.
      id: the workflow's id (default a new UUID); its state is read by it (``workflow_status``).

    >>> with broker.transaction():  # doctest: +SKIP
    ...     Workflow([fetch.message(url), Group([resize.message(64)]), publish.message()]).run()
    """

    def __init__(
        self,
        steps: Sequence[Message[Any] | Group] | dramatiq_pipeline,
        *,
        if_step_dies: IfStepDies = "fail",
        on_failure: Message[Any] | None = None,
        broker: Broker | None = None,
        id: str | None = None,
    ) -> None:
        self.broker = broker if broker is not None else dramatiq.get_broker()
        self.if_step_dies: IfStepDies = check_choice(
            "if_step_dies",
            if_step_dies,
            ("fail", "skip", "wait"),
            fix="'fail' stops the workflow, 'skip' goes on without the step, 'wait' waits for its replay",
        )
        self.on_failure = None if on_failure is None else _declared(self.broker, on_failure, "on_failure")
        self.id = (
            str(uuid.uuid4())
            if id is None
            else check_text("id", id, max_chars=200, fix="pass a short printable id, or none for a UUID")
        )
        self.stages = [
            (is_group, [self._tagged(m) for m in messages]) for is_group, messages in _stages(self.broker, steps)
        ]
        self._database, self._schema, _ = _target(self.broker, "Workflow")

    def _tagged(self, message: Message[Any]) -> Message[Any]:
        options = {k: v for k, v in message.options.items() if k != "pipe_target"}
        return message.copy(options={**options, WORKFLOW_OPTION: self.id})

    def run(self) -> list[Message[Any]]:
        """Write the workflow and send its first stage, in the caller's transaction; the messages sent.

        Raises ``NotBound`` with nothing bound (the first step could otherwise run, and finish,
        before the workflow's rows exist), ``SchemaNotReady`` before migration 17 and
        ``ConfigurationError`` for an id used before.
        """
        conn = bound_connection() or ambient_connection(self._database)
        if conn is None:
            raise NotBound(
                f"running workflow {self.id!r} outside a transaction; its first step could run before the workflow "
                "exists: wrap run() in broker.transaction() (or bind(conn))"
            )
        check_joinable(conn, self._database, actor_name=self.stages[0][1][0].actor_name)
        failure = self.on_failure
        try:
            ensure_ready(conn, schema=self._schema, required=WORKFLOW_VERSION, feature="workflows")
            cur = conn.cursor(row_factory=dict_row)
            created = cur.execute(
                _sql.query("workflow_create", self._schema),
                {
                    "id": self.id,
                    "if_step_dies": self.if_step_dies,
                    "stages": len(self.stages),
                    "failure_message_id": None if failure is None else failure.message_id,
                    "failure_actor": None if failure is None else failure.actor_name,
                    "failure_queue": None if failure is None else q_name(failure.queue_name),
                    "failure_body": None if failure is None else failure.encode(),
                },
            ).fetchone()
            if created is None:
                raise ConfigurationError(f"workflow {self.id!r} exists already; pass a new id (or none for a UUID)")
            for stage, (is_group, messages) in enumerate(self.stages):
                cur.execute(
                    _sql.query("workflow_stage_insert", self._schema),
                    {"workflow_id": self.id, "stage": stage, "is_group": is_group, "pending": len(messages)},
                )
                cur.executemany(
                    _sql.query("workflow_step_insert", self._schema),
                    [
                        {
                            "workflow_id": self.id,
                            "stage": stage,
                            "position": position,
                            "message_id": m.message_id,
                            "actor_name": m.actor_name,
                            "queue_name": q_name(m.queue_name),
                            "body": m.encode(),
                            "state": "sent" if stage == 0 else "waiting",
                        }
                        for position, m in enumerate(messages)
                    ],
                )
        except psycopg.Error as error:
            raise DatabaseUnavailable(
                f"workflow {self.id!r}: {type(error).__name__}: {redact(first_line(error))}; the transaction is "
                "aborted, roll it back and retry (run 'dramatiq-reliable migrate' if workflows are missing)"
            ) from error
        with bind(conn):
            return [self.broker.enqueue(m) for m in self.stages[0][1]]


def _traceparent() -> str | None:
    """The current span's W3C traceparent (the step's processing span), for the next stage's links."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


#: A NUL escaped by ``json.dumps`` (``\\u0000`` not preceded by an odd run of backslashes).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _result_json(result: Any) -> tuple[Jsonb | None, str | None]:
    """The result as ``jsonb``, or the error that fails the workflow when it cannot be stored."""
    try:
        text = json.dumps(result, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        return None, f"a step's result is not JSON ({error}); return ids, numbers, strings, lists or dicts"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None, "a step's result holds a lone surrogate, which Postgres cannot store; return valid text"
    if size > MAX_RESULT_BYTES:
        return None, (
            f"a step's result is {size} bytes of JSON, over the limit of {MAX_RESULT_BYTES}; store the data in a table "
            "and return its id"
        )
    if _NUL.search(text):
        return None, "a step's result holds a NUL character, which Postgres cannot store; strip it from the result"
    return Jsonb(result), None


class Workflows(Middleware):
    """Mark each finished step of a :class:`Workflow` and send the next stage after its last step.

    Add it after ``Idempotency``, as :class:`~dramatiq_reliable.workflows.Batches`: after-hooks
    run in reverse, so it then writes inside the step's job transaction, before its commit.  A
    step run with no transaction bound is marked in a transaction of its own right after the
    actor returns (exactly once still; a crash between the actor's commit and the mark runs
    that step again on redelivery).  That mark fails closed: it is tried again for up to
    ``write_timeout_ms`` while the worker holds the message, then the message is failed into
    the dead letters (not acked, not marked dead); its replay marks it and sends the next stage.

    Parameters:
      write_timeout_ms: how long a mark on a connection of its own is tried again before the
        step's message is failed; default 30 s.

    >>> broker.add_middleware(Workflows())  # doctest: +SKIP
    """

    def __init__(self, *, write_timeout_ms: int = DEFAULT_WRITE_TIMEOUT_MS) -> None:
        self.write_timeout_ms = check_ms(
            "write_timeout_ms", write_timeout_ms, minimum=1, fix="e.g. 30_000; past it the step's message is failed"
        )
        self._targets: dict[int, tuple[Database, str, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._failed_closed = FailedClosed()

    def _target_of(self, broker: Broker) -> tuple[Database, str, dict[str, str]]:
        with self._lock:
            if id(broker) not in self._targets:
                self._targets[id(broker)] = _target(broker, "Workflows")
            return self._targets[id(broker)]

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        # A message another hook failed without raising is nacked: its after_nack marks it dead.
        if exception is None and not message.failed and WORKFLOW_OPTION in message.options:
            conn = bound_connection()
            what = f"workflow {message.options[WORKFLOW_OPTION]!r}"
            if conn is not None:
                try:
                    self.finish(broker, message, dead=False, result=result, conn=conn)
                except Exception as error:
                    if left_to_commit(conn):
                        raise  # the job's commit fails, and it is retried or dead-lettered
                    # The job would commit its mark without the next stage (a send refused by a
                    # before_enqueue hook): fail it, and Idempotency rolls it back.
                    self._failed_closed.fail(message, error, what=what, timeout_ms=None)
                return
            try:
                self.finish(broker, message, dead=False, result=result, conn=None)
            except Exception as error:
                # Dramatiq would log this and ack the message: the workflow would wait for ever.
                self._failed_closed.fail(message, error, what=what, timeout_ms=self.write_timeout_ms)

    def after_nack(self, broker: Broker, message: MessageProxy) -> None:
        # The worker gave up on it: its job transaction rolled back, so the death is recorded alone.
        if WORKFLOW_OPTION in message.options and not self._failed_closed.take(message):
            try:
                self.finish(broker, message, dead=True, result=None, conn=None)
            except Exception as error:
                # Nacked already: nothing to fail.  The workflow waits for it until its dead letter is replayed.
                dead_unrecorded(message, error, what=f"workflow {message.options[WORKFLOW_OPTION]!r}")

    def finish(
        self,
        broker: Broker,
        message: MessageProxy | Message[Any],
        *,
        dead: bool,
        result: Any,
        conn: psycopg.Connection[Any] | None,
    ) -> str:
        """Mark the step of ``message`` finished in ``conn``'s transaction (or one of its own); the status.

        In one of its own, the whole transaction (mark and next stage) is tried again for up to
        ``write_timeout_ms``: a second try finds the mark and sends nothing twice.
        """
        database, _, _ = self._target_of(broker)
        if conn is not None:
            # In the job's transaction: a failure aborts it, so the job's commit fails and it is retried.
            return self._finish_in(broker, conn, message, dead=dead, result=result)

        def write() -> str:
            with database.connection() as own, own.transaction(), bind(own):
                return self._finish_in(broker, own, message, dead=dead, result=result)

        what = f"workflow {message.options[WORKFLOW_OPTION]!r}: marking step {message.message_id!r}"
        return write_until(write, timeout_ms=self.write_timeout_ms, what=what)

    def _finish_in(
        self, broker: Broker, conn: psycopg.Connection[Any], message: Any, *, dead: bool, result: Any
    ) -> str:
        _, schema, resend = self._target_of(broker)
        workflow_id = str(message.options[WORKFLOW_OPTION])
        stored, error = (None, None) if dead else _result_json(result)
        if error is not None:
            logger.error("workflow %s: step %s (%s): %s", workflow_id, message.message_id, message.actor_name, error)
        cur = conn.cursor(row_factory=dict_row)
        row = cur.execute(
            _sql.rendered("workflow_step_finish", schema),
            {
                "workflow_id": workflow_id,
                "message_id": message.message_id,
                "dead": dead,
                "result": stored,
                "error": error,
                "traceparent": _traceparent(),
                **resend,
            },
        ).fetchone()
        assert row is not None
        status = str(row["status"])
        logger.debug("workflow %s: step %s -> %s", workflow_id, message.message_id, status)
        if status == "advance":
            with bind(conn):
                self._send_stage(broker, cur, schema, workflow_id, int(row["next_stage"]))
        return status

    def _send_stage(
        self, broker: Broker, cur: psycopg.Cursor[dict[str, Any]], schema: str, workflow_id: str, stage: int
    ) -> None:
        rows = cur.execute(
            _sql.rendered("workflow_stage_feed", schema), {"workflow_id": workflow_id, "stage": stage}
        ).fetchall()
        previous = [r for r in rows if r["stage"] == stage - 1]
        results = [r["result"] for r in previous]
        value: Any = results if previous[0]["is_group"] else results[0]
        links = [r["traceparent"] for r in previous if r["traceparent"]] if previous[0]["is_group"] else []
        del links[MAX_LINKS:]
        for row in rows:
            if row["stage"] != stage:
                continue
            template = Message.decode(bytes(row["body"]))
            args = template.args if template.options.get("pipe_ignore") else (*template.args, value)
            options = dict(template.options)
            if links:
                options[WORKFLOW_LINKS_OPTION] = links
            broker.enqueue(template.copy(args=args, options=options))

    def before_worker_boot(self, broker: Broker, worker: Any) -> None:
        names = [type(m).__name__ for m in broker.middleware]
        if (
            "Idempotency" in names
            and self in broker.middleware
            and names.index("Idempotency") > names.index("Workflows")
        ):
            logger.warning(
                "Workflows comes before Idempotency in the middleware list, so steps are marked (and the next stage "
                "sent) after their job commits; add Workflows after Idempotency"
            )
