"""``dramatiq-reliable jobs show|list`` against a real Postgres: states, keys, --json and exit 7."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable.cli import ExitCode, main

pytestmark = pytest.mark.integration


@pytest.fixture
def run(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run a command on the test's schema in-process; return (exit code, stdout, stderr)."""

    def invoke(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", database_url, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _queued(db: psycopg.Connection[Any], schema: str, actor: str, *, due_in_s: int = 0) -> str:
    message_id = str(uuid.uuid4())
    db.execute(
        sql.SQL(
            "INSERT INTO {} (queue_name, message_id, actor_name, body, available_at) "
            "VALUES ('mail', %s, %s, '\\x7b7d', now() + make_interval(secs => %s))"
        ).format(sql.Identifier(schema, "queue")),
        (message_id, actor, due_in_s),
    )
    return message_id


def _failed(db: psycopg.Connection[Any], schema: str, message_id: str, actor: str) -> None:
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, attempts, max_retries, outcome, reason, error_type, "
            "error_message, error_where, next_due_at, trace_id, expires_at) VALUES (%s, 'mail', %s, 2, 5, 'retry', "
            "'transient', 'ConnectionResetError', 'smtp down', 'app/mail.py:12 in send', now() + interval '1 minute', "
            "'4bf92f3577b34da6a3ce929d0e0e4736', now() + interval '1 day')"
        ).format(sql.Identifier(schema, "job_attempts")),
        (message_id, actor),
    )


def test_show_tells_a_waiting_job_and_a_retrying_one(run: Any, db: psycopg.Connection[Any], db_schema: str) -> None:
    waiting = _queued(db, db_schema, "send_email")
    code, out, err = run("jobs", "show", waiting)
    assert code == ExitCode.OK, err
    assert re.search(r"^state +waiting$", out, re.M) and re.search(r"^actor +send_email$", out, re.M)

    retrying = _queued(db, db_schema, "send_email", due_in_s=60)
    _failed(db, db_schema, retrying, "send_email")
    code, out, err = run("jobs", "show", retrying)
    assert code == ExitCode.OK, err
    assert re.search(r"^state +retrying$", out, re.M)
    assert "2 failed (max retries 5)" in out
    assert "ConnectionResetError: smtp down" in out
    assert "app/mail.py:12 in send" in out
    assert "4bf92f3577b34da6a3ce929d0e0e4736" in out

    code, out, _ = run("jobs", "show", retrying, "--json")
    shown = json.loads(out)
    assert code == ExitCode.OK
    assert shown["state"] == "retrying" and shown["attempts"] == 2 and shown["next_due_at"]
    assert shown["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_show_finds_a_done_job_by_its_idempotency_key(run: Any, db: psycopg.Connection[Any], db_schema: str) -> None:
    message_id = str(uuid.uuid4())
    db.execute(
        sql.SQL(
            "INSERT INTO {} (actor_name, job_key, payload_hash, message_id, expires_at) "
            "VALUES ('invoice', 'invoice-42', '\\x00', %s, now() + interval '1 day')"
        ).format(sql.Identifier(db_schema, "processed_jobs")),
        (message_id,),
    )
    code, out, _ = run("jobs", "show", "invoice-42", "--json")
    assert code == ExitCode.OK
    assert json.loads(out)["state"] == "done" and json.loads(out)["message_id"] == message_id


def test_an_unknown_id_exits_7_with_one_line_that_names_the_fix(run: Any) -> None:
    code, out, err = run("jobs", "show", "no-such-job")
    assert code == ExitCode.NOT_FOUND == 7
    assert out == ""
    assert "no job 'no-such-job'" in err and "purged by retention" in err
    assert err.count("\n") == 1


def test_list_filters_by_state_actor_and_queue(
    run: Any, db: psycopg.Connection[Any], db_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The table fits the terminal: a wide one, whatever runs the tests (a pipe, a narrow pane).
    monkeypatch.setenv("COLUMNS", "200")
    waiting = _queued(db, db_schema, "send_email")
    retrying = _queued(db, db_schema, "charge", due_in_s=60)
    _failed(db, db_schema, retrying, "charge")

    code, out, _ = run("jobs", "list", "--state", "retrying", "--json")
    assert code == ExitCode.OK
    assert [row["message_id"] for row in json.loads(out)] == [retrying]
    code, out, _ = run("jobs", "list", "--state", "waiting", "--actor", "send_email", "--json")
    assert [row["message_id"] for row in json.loads(out)] == [waiting]
    code, out, _ = run("jobs", "list", "--state", "waiting", "--queue", "other", "--json")
    assert json.loads(out) == []
    code, out, _ = run("jobs", "list", "--state", "retrying")
    assert code == ExitCode.OK and retrying in out and "ConnectionResetError: smtp down" in out
    code, out, _ = run("jobs", "list", "--state", "dead")
    assert (code, out) == (ExitCode.OK, "no dead jobs\n")


def test_a_job_given_up_without_dead_letters_is_dead_until_it_is_sent_again(
    run: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    """No DeadLetters middleware: the failure record that gave up outranks the old published row."""
    message_id = str(uuid.uuid4())
    outbox = sql.SQL(
        "INSERT INTO {} (message_id, queue_name, actor_name, body, created_at, published_at) "
        "VALUES (%s, 'mail', 'send_email', '\\x7b7d', now() - make_interval(secs => %s), now())"
    ).format(sql.Identifier(db_schema, "outbox"))
    db.execute(outbox, (message_id, 60))
    _failed(db, db_schema, message_id, "send_email")
    db.execute(
        sql.SQL("UPDATE {} SET outcome = 'exhausted', next_due_at = NULL").format(
            sql.Identifier(db_schema, "job_attempts")
        )
    )
    code, out, _ = run("jobs", "show", message_id, "--json")
    shown = json.loads(out)
    assert (code, shown["state"], shown["attempts"], shown["next_due_at"]) == (ExitCode.OK, "dead", 2, None)
    assert "no dead letter is stored" in shown["detail"]
    # Sent again by hand (a replay): the new row is newer news than the failure.
    db.execute(outbox, (message_id, -1))
    code, out, _ = run("jobs", "show", message_id, "--json")
    assert json.loads(out)["state"] == "published_no_news"
