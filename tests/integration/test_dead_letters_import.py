"""``dead-letters import-xq`` against real RabbitMQ queues: what only .XQ held reaches the table, once."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pika
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.common import xq_name
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.dead_letters import DeadLetters, PostgresDeadLetterStore

pytestmark = pytest.mark.integration

TRACEBACK = 'Traceback (most recent call last):\n  File "app/tasks.py", line 9, in charge\nValueError: card declined\n'


def _message(queue_name: str, **options: Any) -> Message[Any]:
    return Message(queue_name=queue_name, actor_name="charge", args=(1,), kwargs={}, options=options)


def _rows(db: psycopg.Connection[Any], db_schema: str) -> list[dict[str, Any]]:
    cursor = db.cursor(row_factory=psycopg.rows.dict_row)
    return cursor.execute(
        sql.SQL("SELECT * FROM {}.dead_letters ORDER BY id").format(sql.Identifier(db_schema))
    ).fetchall()


def _import(database_url: str, rabbitmq_url: str, db_schema: str, *queues: str) -> tuple[int, dict[str, Any]]:
    argv = ["dead-letters", "import-xq", "--database-url", database_url, "--schema", db_schema]
    argv += ["--rabbitmq-url", rabbitmq_url, "--json"] + [part for name in queues for part in ("--queue", name)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, json.loads(out.getvalue())


def test_import_moves_what_only_the_xq_holds_once_and_acks_what_is_already_stored(
    broker: OutboxBroker, database_url, rabbitmq_url, queue_name, rabbit, db, db_schema
):
    broker.declare_queue(queue_name, ensure=True)  # the queue with its .DQ and .XQ, as a worker declares them
    lost = _message(queue_name, retries=3, traceback=TRACEBACK, max_retries=3)
    captured = _message(queue_name, retries=1)
    proxy = MessageProxy(captured)
    try:
        raise KeyError("x")
    except KeyError as error:
        proxy.stuff_exception(error)
    proxy.fail()
    assert DeadLetters().capture(broker, proxy) is not None  # its capture worked: it is in both places
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    channel = connection.channel()
    for body in (lost.encode(), captured.encode(), b"not a dramatiq message", lost.encode()):
        channel.basic_publish(exchange="", routing_key=xq_name(queue_name), body=body)
    connection.close()

    check = ["status", "--check", "--queue", queue_name, "--max-xq-unstored", "0", "--json"]
    check += ["--database-url", database_url, "--schema", db_schema, "--rabbitmq-url", rabbitmq_url]
    status = io.StringIO()
    with contextlib.redirect_stdout(status), contextlib.redirect_stderr(io.StringIO()):
        assert main(check) == ExitCode.CHECK_FAILED
    [entry] = [item for item in json.loads(status.getvalue())["queues"] if item["queue"] == queue_name]
    assert entry["xq"] == 4 and entry["xq_unstored"] == 3  # both copies of the lost one, and the unreadable body
    assert rabbit.count(xq_name(queue_name)) == 4  # the check put back what it read

    code, result = _import(database_url, rabbitmq_url, db_schema, queue_name)
    assert code == ExitCode.REFUSED, result  # the unreadable body was left in .XQ
    assert result == {
        "imported": {queue_name: 1},
        "already_stored": {queue_name: 2},  # the captured one, and the second copy of the lost one
        "unreadable": {queue_name: 1},
    }
    rows = _rows(db, db_schema)
    assert [row["message_id"] for row in rows] == [captured.message_id, lost.message_id]
    imported = rows[1]
    assert imported["reason"] == "imported_from_xq" and imported["attempts"] == 3
    assert (imported["error_type"], imported["error_message"]) == ("ValueError", "card declined")
    assert imported["message"]["args"] == [1] and imported["traceback"] == TRACEBACK
    assert rabbit.count(xq_name(queue_name)) == 1
    status = io.StringIO()
    with contextlib.redirect_stdout(status), contextlib.redirect_stderr(io.StringIO()):
        main(check)
    [entry] = [item for item in json.loads(status.getvalue())["queues"] if item["queue"] == queue_name]
    assert entry["xq_unstored"] == 1

    # Re-running stores nothing twice.
    code, again = _import(database_url, rabbitmq_url, db_schema, queue_name)
    assert again["imported"] == {queue_name: 0} and again["unreadable"] == {queue_name: 1}
    assert len(_rows(db, db_schema)) == 2


def test_a_replayed_message_that_died_again_without_a_row_is_imported_as_a_new_death(
    broker: OutboxBroker, database_url, rabbitmq_url, queue_name, db, db_schema
):
    broker.declare_queue(queue_name, ensure=True)
    first = _message(queue_name)
    proxy = MessageProxy(first)
    proxy.stuff_exception(ValueError("first death"))
    proxy.fail()
    stored = DeadLetters().capture(broker, proxy)
    assert stored is not None
    assert PostgresDeadLetterStore.from_broker(broker).replay(ids=[stored.id]).replayed == 1
    again = Message(**{**first.asdict(), "args": (1,), "options": {"replay_of": {"dead_letter_id": stored.id}}})
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    connection.channel().basic_publish(exchange="", routing_key=xq_name(queue_name), body=again.encode())
    connection.close()

    code, result = _import(database_url, rabbitmq_url, db_schema, queue_name)
    assert code == ExitCode.OK and result["imported"] == {queue_name: 1}
    assert [row["message_id"] for row in _rows(db, db_schema)] == [first.message_id, first.message_id]
