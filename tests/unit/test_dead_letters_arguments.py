"""The dead letters' argument rules without a database: the page cursor, filter values, ids, text.

Whatever a caller (or the web page, passing on a query string) hands in, the store answers with a
``ConfigurationError`` that names the fix, before any SQL: never ``OverflowError``, never a
driver error.  The in-memory store shares the rules, so unit tests see what production does.
"""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable._checks import check_text
from dramatiq_reliable.dead_letters import DeadLetterFilter
from dramatiq_reliable.dead_letters.cursor import decode_cursor, encode_cursor
from dramatiq_reliable.dead_letters.validators import check_id, check_ids
from dramatiq_reliable.testing import InMemoryDeadLetterStore

UTC = datetime.timezone.utc
BIGINT_MAX = 2**63 - 1


@given(
    st.datetimes(
        min_value=datetime.datetime(1, 1, 1), max_value=datetime.datetime(9999, 12, 31, 23, 59), timezones=st.just(UTC)
    ),
    st.integers(min_value=1, max_value=BIGINT_MAX),
)
def test_every_cursor_a_listing_can_return_decodes_to_what_it_encoded(moment, dead_letter_id):
    assert decode_cursor(encode_cursor(moment, dead_letter_id)) == (moment, dead_letter_id)


@given(st.text(max_size=80) | st.from_regex(r"-?[0-9]{1,30}\.-?[0-9]{1,30}", fullmatch=True))
def test_any_other_text_decodes_within_range_or_is_refused_with_our_error(text):
    refused = None
    try:
        moment, dead_letter_id = decode_cursor(text)
    except ConfigurationError as error:
        refused = str(error)
    if refused is not None:
        assert "pass next_cursor unchanged" in refused and len(refused) < 300
    else:
        assert moment is not None and moment.tzinfo is not None
        assert dead_letter_id is not None and 1 <= dead_letter_id <= BIGINT_MAX


@pytest.mark.parametrize(
    "cursor",
    [
        "99999999999999999999.1",
        "-99999999999999999999.1",
        f"0.{2**63}",
        "0.0",
        "1_0.1",
        "\u0661.\u0661",
        " 1.1",
        "1.1\n",
        12,
    ],
)
def test_a_cursor_out_of_range_or_in_another_spelling_is_refused(cursor):
    with pytest.raises(ConfigurationError, match="pass next_cursor unchanged"):
        decode_cursor(cursor)


def test_the_in_memory_store_refuses_what_the_postgres_store_refuses():
    store = InMemoryDeadLetterStore()
    with pytest.raises(ConfigurationError, match="pass next_cursor unchanged"):
        store.list(cursor="99999999999999999999.1")
    with pytest.raises(ConfigurationError, match="limit must be an int from 1 to 10000"):
        store.list(limit=10**30)
    with pytest.raises(ConfigurationError, match="state must be"):
        store.count(state="lost")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="a dead letter id must be"):
        store.get(2**63)
    assert store.list(cursor=None).items == ()


@pytest.mark.parametrize("value", [0, -1, 2**63, True, 1.0, "1", None])
def test_a_dead_letter_id_is_an_int_within_bigint(value):
    with pytest.raises(ConfigurationError, match=f"a dead letter id must be an int from 1 to {BIGINT_MAX}"):
        check_id(value)
    assert check_id(BIGINT_MAX) == BIGINT_MAX
    with pytest.raises(ConfigurationError, match="ids must be a sequence"):
        check_ids("12")  # type: ignore[arg-type]
    assert check_ids([3, 1, 3]) == [1, 3]


@pytest.mark.parametrize("field", ["actor_name", "queue_name", "error_type", "fingerprint"])
@pytest.mark.parametrize("value", ["a\x00b", "\udfff", "x" * 501, "", 7])
def test_a_filter_value_postgres_cannot_hold_or_no_row_can_have_is_refused(field, value):
    with pytest.raises(ConfigurationError, match=f"filter {field} must be"):
        DeadLetterFilter(**{field: value})


def test_a_filter_value_of_the_longest_stored_length_is_fine():
    assert DeadLetterFilter(actor_name="a" * 500).actor_name == "a" * 500


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("", "must be a non-empty string"),
        (5, "must be a non-empty string"),
        ("a\x00b", "holds a NUL"),
        ("a\ud800b", "holds a lone surrogate"),
        ("x" * 11, "at most 10 characters"),
    ],
)
def test_check_text_refuses_what_postgres_text_cannot_hold_and_shows_the_value_shortened(value, match):
    with pytest.raises(ConfigurationError, match=match) as raised:
        check_text("label", value, max_chars=10, fix="e.g. 'ok'")
    assert str(raised.value).startswith("label ") and str(raised.value).endswith("; e.g. 'ok'")
    assert check_text("label", "fine", max_chars=10) == "fine"
    assert check_text("label", None, max_chars=10, allow_none=True) is None


def test_check_text_shortens_a_long_value_in_its_message():
    with pytest.raises(ConfigurationError) as raised:
        check_text("label", "y" * 100_000, max_chars=10)
    assert len(str(raised.value)) < 200
