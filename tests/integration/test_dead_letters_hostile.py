"""Dead letters of messages Postgres cannot store as they are: kept in a readable, escaped form."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.dead_letters import DeadLetters

pytestmark = pytest.mark.integration


def _dies(broker: OutboxBroker, message: Message[Any], error: BaseException) -> MessageProxy:
    proxy = MessageProxy(message)
    try:
        raise error
    except BaseException as raised:
        proxy.stuff_exception(raised)
    proxy.fail()
    return proxy


def _row(db: psycopg.Connection[Any], db_schema: str) -> dict[str, Any]:
    cursor = db.cursor(row_factory=psycopg.rows.dict_row)
    [row] = cursor.execute(sql.SQL("SELECT * FROM {}.dead_letters").format(sql.Identifier(db_schema))).fetchall()
    return row


def test_nul_in_the_actor_name_message_id_and_queue_is_stored_escaped(broker, db, db_schema, caplog):
    message = Message(
        queue_name="orders\x00x", actor_name="charge\x00card", args=(1,), kwargs={}, options={}, message_id="m\x00-1"
    )
    stored = DeadLetters().capture(broker, _dies(broker, message, ValueError("bad\x00byte")))
    assert stored is not None
    row = _row(db, db_schema)
    assert (row["actor_name"], row["message_id"], row["queue_name"]) == ("charge\\x00card", "m\\x00-1", "orders\\x00x")
    assert row["error_message"] == "bad\\x00byte"
    assert "readable copy" in caplog.text


def test_lone_surrogates_in_args_kwargs_options_and_the_traceback_are_stored_escaped(broker, db, db_schema):
    message = Message(
        queue_name="orders",
        actor_name="charge",
        args=("\ud800x",),
        kwargs={"note\udfff": "\udc80"},
        options={"tag": "\ud83d"},
    )
    stored = DeadLetters().capture(broker, _dies(broker, message, ValueError("name '\ud800x' is unknown")))
    assert stored is not None
    row = _row(db, db_schema)
    assert row["message"]["args"] == ["\\ud800x"]
    assert row["message"]["kwargs"] == {"note\\udfff": "\\udc80"}
    assert row["message"]["options"]["tag"] == "\\ud83d"
    assert row["error_message"] == "name '\\ud800x' is unknown"
    assert "\\ud800x" in row["traceback"]
    # An astral character is an ordinary character, not a lone surrogate: kept exactly.
    emoji = Message(queue_name="q", actor_name="a", args=("\U0001f600",), kwargs={}, options={})
    kept = DeadLetters().capture(broker, _dies(broker, emoji, ValueError("x")))
    assert kept is not None and kept.message is not None and kept.message["args"] == ["\U0001f600"]
