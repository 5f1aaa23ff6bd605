"""Dead letters of messages Postgres cannot store as they are: kept in a readable, escaped form."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from psycopg import sql
from support import capture_dead_letter

from dramatiq_reliable import ConfigurationError, OutboxBroker, PostgresDeadLetterStore
from dramatiq_reliable.dead_letters import DeadLetterFilter, DeadLetters

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


# -- the store's entry points refuse hostile arguments with our own errors --------------------------

BIGINT_MAX = 2**63 - 1


@pytest.fixture
def store(broker: OutboxBroker) -> Any:
    with PostgresDeadLetterStore.from_broker(broker) as dead_letter_store:
        yield dead_letter_store


@pytest.fixture
def stored(broker: OutboxBroker) -> Any:
    """One dead letter in the test's schema."""
    return capture_dead_letter(broker, queue_name="hostile_q")


@pytest.mark.parametrize(
    "cursor",
    [
        "99999999999999999999.1",  # microseconds past year 9999
        "-99999999999999999999.1",  # before year 1
        f"1700000000000000.{2**63}",  # an id past bigint
        f"1700000000000000.{2**70}",
        "1700000000000000.-1",
        "1_700_000.1",  # int() would take these
        " 17.1 ",
        "\u0661\u0667\u0660\u0660.\u0661",
        "17.1.1",
        "nan.1",
        "",
        "x" * 10_000,
        "a\x00b",
        "\ud800",
    ],
)
def test_a_cursor_no_listing_returned_is_refused_with_a_configuration_error(store, stored, cursor):
    with pytest.raises(ConfigurationError, match="pass next_cursor unchanged") as raised:
        store.list(cursor=cursor)
    assert len(str(raised.value)) < 300


def test_a_cursor_a_listing_returned_still_pages(store, broker):
    rows = [capture_dead_letter(broker, queue_name="hostile_q") for _ in range(3)]
    first = store.list(limit=2)
    assert first.next_cursor is not None
    rest = store.list(limit=2, cursor=first.next_cursor)
    assert {item.id for item in first.items + rest.items} == {row.id for row in rows}


@pytest.mark.parametrize("dead_letter_id", [2**63, 2**64, 2**100, 0, -1, True, "1", 1.0])
def test_an_id_outside_bigint_or_not_an_int_is_refused_by_every_entry_point(store, stored, dead_letter_id):
    calls = {
        "get": lambda: store.get(dead_letter_id),
        "count": lambda: store.count(ids=[dead_letter_id]),
        "replay_preview": lambda: store.replay_preview(ids=[dead_letter_id]),
        "replay": lambda: store.replay(ids=[dead_letter_id]),
        "discard": lambda: store.discard(ids=[dead_letter_id]),
    }
    for call in calls.values():
        with pytest.raises(ConfigurationError, match=f"a dead letter id must be an int from 1 to {BIGINT_MAX}"):
            call()
    assert store.get(stored.id) is not None and store.get(BIGINT_MAX) is None


@pytest.mark.parametrize(
    "value", ["a\x00b", "\ud800", "x" * 501, ""], ids=["nul", "lone-surrogate", "too-long", "empty"]
)
@pytest.mark.parametrize("field", ["actor_name", "queue_name", "error_type", "fingerprint"])
def test_a_filter_value_no_dead_letter_can_have_is_refused_before_any_query(field, value):
    with pytest.raises(ConfigurationError, match=f"filter {field} must be") as raised:
        DeadLetterFilter(**{field: value})
    assert len(str(raised.value)) < 300


@pytest.mark.parametrize("queue_name", ["a\x00b", "\ud800", "q" * 300, "", 5])
def test_a_replay_to_a_queue_name_that_cannot_be_one_is_refused_and_replays_nothing(store, stored, db, queue_name):
    with pytest.raises(ConfigurationError, match="queue_name"):
        store.replay(ids=[stored.id], queue_name=queue_name)
    assert store.get(stored.id).state == "dead"


@pytest.mark.parametrize("by", ["ops\x00ann", "ops\ud800"])
def test_who_acts_is_stored_readably_even_with_a_nul_or_a_lone_surrogate(store, broker, db, by):
    replayed, discarded = (capture_dead_letter(broker, queue_name="hostile_q") for _ in range(2))
    assert store.replay(ids=[replayed.id], by=by).replayed == 1
    assert store.discard(ids=[discarded.id], by=by, note="why\x00not\udfff").discarded == 1
    escaped = by.replace("\x00", "\\x00").replace("\ud800", "\\ud800")
    assert store.get(replayed.id).handled_by == escaped
    handled = store.get(discarded.id)
    assert (handled.handled_by, handled.note) == (escaped, "why\\x00not\\udfff")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda store: store.list(limit=10**30), "limit must be an int from 1 to 10000"),
        (lambda store: store.list(limit=True), "limit must be an int from 1 to 10000"),
        (lambda store: store.stats(limit=0), "limit must be an int from 1 to 10000"),
        (lambda store: store.list(state="lost"), "state must be"),
        (lambda store: store.replay(where=DeadLetterFilter(), delay_ms=10**30), "delay_ms"),
        (lambda store: store.replay(where=DeadLetterFilter(), max_age_ms=10**30), "max_age_ms"),
        (lambda store: store.replay(where=DeadLetterFilter(), force="yes"), "force must be True or False"),
        (lambda store: store.purge(older_than_ms=10**30), "older_than_ms"),
        (lambda store: store.purge(batch=10**30), "batch"),
        (lambda store: store.count(ids="12"), "ids must be"),
    ],
)
def test_hostile_numbers_and_types_get_our_error_never_a_driver_error_or_overflow(store, stored, call, match):
    with pytest.raises(ConfigurationError, match=match):
        call(store)
