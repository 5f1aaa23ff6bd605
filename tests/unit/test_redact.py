"""Passwords never reach a message: malformed DSNs that psycopg echoes, and prose left alone."""

from __future__ import annotations

import psycopg
import pytest

from dramatiq_reliable._util import redact


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('missing "=" after "postgresql//u:s3cret@h/db"', 'missing "=" after "postgresql//u:***@h/db"'),
        ("postgresql://u:pa ss@host/db", "postgresql://u:***@host/db"),
        ("note: word:thing@example is fine", "note: word:***@example is fine"),
        ("the relay stopped: see the log", "the relay stopped: see the log"),
    ],
)
def test_redact_masks_passwords_without_swallowing_prose(text, expected):
    assert redact(text) == expected


@pytest.mark.parametrize(
    "url", ["u:s3cret@127.0.0.1:1/db", "postgresql://u:s3 cret@127.0.0.1:1/db", "postgresql//u:s3cret@h/db"]
)
def test_psycopg_errors_for_malformed_urls_are_redacted(url):
    with pytest.raises(psycopg.Error) as caught:
        psycopg.connect(url, connect_timeout=1)
    assert "s3cret" not in redact(str(caught.value)) and "s3 cret" not in redact(str(caught.value))
