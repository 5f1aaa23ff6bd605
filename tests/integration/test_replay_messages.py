"""``dead-letters replay`` says where the messages went: the outbox and its relay, or the Postgres queue table and its workers."""

from __future__ import annotations

import io
from typing import Any

import pytest
from psycopg import sql
from support import capture_dead_letter, deployed_as

from dramatiq_reliable.cli import ExitCode, main

pytestmark = pytest.mark.integration


@pytest.fixture
def replay(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """``replay(*args)``: ``dead-letters replay`` on the test's schema; (exit code, stdout, stderr)."""
    deployed_as(database_url, db_schema, "outbox")  # an OutboxBroker deployment: replays and runs go there

    def invoke(*args: str) -> tuple[int, str, str]:
        code = main(["dead-letters", "replay", "--database-url", database_url, "--schema", db_schema, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _count(db: Any, db_schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}.{}").format(sql.Identifier(db_schema), sql.Identifier(table)))
    return int(row.fetchone()[0])


def test_a_replay_onto_the_postgres_queues_says_so_and_names_no_relay(replay, pg_broker, db, db_schema):
    # Before: "replayed 1 dead letter(s) to their queues through the outbox; the relay publishes them".
    item = capture_dead_letter(pg_broker, queue_name="pg_mail")
    code, out, err = replay(str(item.id), "--to", "queue")
    assert (code, err) == (ExitCode.OK, "")
    assert out == (
        "replayed 1 dead letter(s) to their Postgres queues; PostgresBroker workers take them from the queue table\n"
    )
    assert (_count(db, db_schema, "queue"), _count(db, db_schema, "outbox")) == (1, 0)


def test_a_delayed_replay_to_another_postgres_queue_says_which_and_when(replay, pg_broker):
    capture_dead_letter(pg_broker, queue_name="pg_mail")
    code, out, _ = replay("--all", "--yes", "--to", "queue", "--to-queue", "pg_other", "--delay", "10m")
    assert code == ExitCode.OK
    assert out == (
        "replayed 1 dead letter(s) to Postgres queue 'pg_other', due in 10m; "
        "PostgresBroker workers take them from the queue table\n"
    )


def test_a_replay_through_the_outbox_says_the_relay_publishes_it(replay, broker, db, db_schema):
    item = capture_dead_letter(broker, queue_name="mail")
    code, out, _ = replay(str(item.id))
    assert code == ExitCode.OK
    assert out == "replayed 1 dead letter(s) to their queues through the outbox; the relay publishes them\n"
    assert (_count(db, db_schema, "queue"), _count(db, db_schema, "outbox")) == (0, 1)


@pytest.mark.parametrize(("to", "path"), [("queue", "onto the Postgres queues"), ("outbox", "through the outbox")])
def test_the_confirmation_of_a_bulk_replay_names_the_way_it_takes(replay, pg_broker, monkeypatch, to, path):
    capture_dead_letter(pg_broker, queue_name="pg_mail")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal("n\n"))
    code, _out, err = replay("--all", "--to", to)
    assert code == ExitCode.ABORTED
    assert f"replay 1 dead letter(s) (all) {path}? [y/N]" in err


@pytest.fixture
def bare_replay(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """``dead-letters replay`` on the test's schema, which no deployment has sent through yet."""

    def invoke(*args: str) -> tuple[int, str, str]:
        code = main(["dead-letters", "replay", "--database-url", database_url, "--schema", db_schema, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _outbox_rows(db: Any, schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}.outbox").format(sql.Identifier(schema))
    return int(db.execute(query).fetchone()[0])


def test_a_replay_without_to_goes_where_the_deployment_sends(
    bare_replay: Any, pg_broker: Any, database_url: str, db_schema: str, db: Any
) -> None:
    """A PostgresBroker deployment's replay goes into its queue table without --to: once it went
    into the outbox by default, where no relay would ever publish it."""
    letter = capture_dead_letter(pg_broker, queue_name="mail")
    deployed_as(database_url, db_schema, "queue")
    code, out, err = bare_replay(str(letter.id))
    assert (code, err) == (0, "")
    assert "to their Postgres queues" in out
    assert _outbox_rows(db, db_schema) == 0


def test_a_replay_refuses_to_guess_when_the_schema_cannot_tell(
    bare_replay: Any, pg_broker: Any, database_url: str, db_schema: str, db: Any
) -> None:
    letter = capture_dead_letter(pg_broker, queue_name="mail")
    code, out, err = bare_replay(str(letter.id))  # nothing sent through either table yet
    assert (code, out) == (2, "")
    assert "cannot tell where replays go" in err and "--to outbox" in err and "--to queue" in err
    deployed_as(database_url, db_schema, "queue")
    deployed_as(database_url, db_schema, "outbox")  # both: a move from one broker to the other
    code, out, err = bare_replay(str(letter.id))
    assert code == 2 and "both in use" in err
    code, out, err = bare_replay(str(letter.id), "--to", "outbox")
    assert code == 0 and _outbox_rows(db, db_schema) == 1
