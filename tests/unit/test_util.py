"""The private helpers every module shares."""

from __future__ import annotations

import pytest

from dramatiq_reliable._util import format_age, redact, type_name
from dramatiq_reliable.errors import Unrecoverable


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://guest:***@127.0.0.1:5672/%2F"),
        (
            'missing "=" after "app:s3 cret@db/x" in connection info string',
            'missing "=" after "app:***@db/x" in connection info string',
        ),
        ("host=db password=hunter2 user=x", "host=db password=*** user=x"),
        ("password='a b' dbname=x", "password=*** dbname=x"),
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ("at 12:30@ noon", "at 12:30@ noon"),
    ],
)
def test_redact_masks_every_password_of_a_connection_string(text, expected):
    assert redact(text) == expected


def test_type_names_are_stable_and_public_for_our_errors():
    assert type_name(ValueError) == "ValueError"
    assert type_name(Unrecoverable) == "dramatiq_reliable.Unrecoverable"


def test_ages_keep_two_units_before_switching():
    assert [format_age(s) for s in (None, 4.24, 75, 600, 7200, 200_000)] == ["-", "4.2s", "75s", "10m", "2.0h", "2.3d"]


def test_a_rendered_query_is_the_composed_query_as_bytes_and_stays_composed_for_a_non_ascii_schema():
    from psycopg import sql

    from dramatiq_reliable import _sql

    rendered = _sql.rendered("idempotency_claim", 'odd "schema"')
    assert rendered == _sql.query("idempotency_claim", 'odd "schema"').as_bytes(None)
    assert b'"odd ""schema"""' in rendered
    assert isinstance(_sql.rendered("idempotency_claim", "schéma"), sql.Composed)
