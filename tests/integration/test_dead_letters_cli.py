"""The ``dead-letters`` command against a real Postgres: tables, filters, --json, prompts, exit codes."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import capture_dead_letter, deployed_as

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.cli.dead_letters import NOT_FOUND, REFUSED
from dramatiq_reliable.dead_letters import DeadLetter

pytestmark = pytest.mark.integration


def _capture(
    broker: OutboxBroker,
    *,
    actor_name: str = "send_email",
    queue_name: str = "default",
    error: BaseException | None = None,
    sent_days_ago: float = 0,
    options: dict[str, Any] | None = None,
) -> DeadLetter:
    return capture_dead_letter(
        broker,
        actor_name=actor_name,
        queue_name=queue_name,
        error=error,
        sent_days_ago=sent_days_ago,
        options=options,
    )


@pytest.fixture
def run(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run the command on the test's schema; return (exit code, stdout, stderr)."""
    deployed_as(database_url, db_schema, "outbox")  # an OutboxBroker deployment: replays and runs go there

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", database_url, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _states(db: psycopg.Connection[Any], db_schema: str) -> dict[int, str]:
    rows = db.execute(sql.SQL("SELECT id, state FROM {}.dead_letters").format(sql.Identifier(db_schema))).fetchall()
    return dict(rows)


def _outbox_count(db: psycopg.Connection[Any], db_schema: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}.outbox").format(sql.Identifier(db_schema))).fetchone()
    return int(row[0]) if row else 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_list_prints_a_readable_table_filters_it_and_gives_scripts_json(broker, run):
    declined = _capture(broker, actor_name="charge_card", queue_name="payments")
    other = _capture(broker, actor_name="send_email", error=KeyError("template"))

    code, out, _ = run("dead-letters", "list")
    assert code == ExitCode.OK
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "AGE", "ACTOR", "QUEUE", "ATTEMPTS", "REASON", "ERROR"]
    assert rows[0].split()[0] == str(other.id) and "KeyError: 'template'" in rows[0]
    assert "charge_card" in rows[1] and "payments" in rows[1] and "ValueError: card declined" in rows[1]

    code, out, _ = run("dead-letters", "list", "--actor", "charge_card", "--json")
    assert code == ExitCode.OK
    listing = json.loads(out)
    assert [item["id"] for item in listing["dead_letters"]] == [declined.id]
    assert listing["dead_letters"][0]["error_type"] == "ValueError" and listing["next_cursor"] is None

    for flags in (["--error-type", "KeyError"], ["--queue", "default"], ["--fingerprint", other.fingerprint]):
        code, out, _ = run("dead-letters", "list", *flags, "--json")
        assert [item["id"] for item in json.loads(out)["dead_letters"]] == [other.id], flags
    code, out, _ = run("dead-letters", "list", "--since", "1h", "--until", "2099-01-01", "--json")
    assert len(json.loads(out)["dead_letters"]) == 2
    code, out, _ = run("dead-letters", "list", "--until", "1h")
    assert code == ExitCode.OK and out.startswith("no dead letters waiting (state: dead; filter: until=")

    code, out, err = run("dead-letters", "list", "--limit", "1")
    assert len(out.splitlines()) == 2 and "--cursor" in err
    cursor = err.split("--cursor")[1].split()[0]
    code, out, _ = run("dead-letters", "list", "--limit", "1", "--cursor", cursor, "--json")
    assert [item["id"] for item in json.loads(out)["dead_letters"]] == [declined.id]


def test_show_prints_the_whole_story_and_an_unknown_id_is_not_found(broker, run):
    stored = _capture(broker, actor_name="charge_card")
    code, out, _ = run("dead-letters", "show", str(stored.id))
    assert code == ExitCode.OK
    assert f"dead letter {stored.id} (dead)" in out and "ValueError: card declined" in out
    assert "Traceback (most recent call last)" in out and "args: [42]" in out
    code, out, _ = run("dead-letters", "show", str(stored.id), "--json")
    assert json.loads(out)["traceback"].startswith("Traceback")

    code, out, err = run("dead-letters", "show", "999999")
    assert code == NOT_FOUND == 7
    assert "dead letter 999999 not found" in err and out == ""


def test_show_prints_the_traceback_once_though_dramatiq_keeps_a_copy_in_the_options(broker, run):
    # Dramatiq's Retries stores the last traceback in the message options; show prints it below.
    stored = _capture(broker, options={"traceback": "Traceback (most recent call last):\n  ...\nValueError: x\n"})
    code, out, _ = run("dead-letters", "show", str(stored.id))
    assert code == ExitCode.OK
    assert out.count("Traceback (most recent call last)") == 1
    assert 'options: {"retries": 3}' in out


def test_an_empty_listing_says_what_it_filtered_and_what_the_other_states_hold(broker, run):
    kept = _capture(broker, actor_name="charge_card")
    code, out, _ = run("dead-letters", "discard", str(kept.id))
    assert code == ExitCode.OK
    code, out, _ = run("dead-letters", "list")
    assert code == ExitCode.OK
    assert out == "no dead letters waiting (state: dead); 1 replayed or discarded: see them with --state all\n"
    code, out, _ = run("dead-letters", "list", "--state", "replayed", "--actor", "charge_card")
    assert out == (
        "no replayed dead letters (state: replayed; filter: actor_name='charge_card'); "
        "1 in other states: see them with --state all\n"
    )
    code, out, _ = run("dead-letters", "list", "--state", "all")
    assert str(kept.id) in out and "discarded" in out


def test_stats_shows_one_row_per_bug(broker, run):
    for _ in range(3):
        _capture(broker, actor_name="charge_card")
    _capture(broker, actor_name="render", error=KeyError("template"))
    code, out, err = run("dead-letters", "stats")
    assert code == ExitCode.OK
    header, first, second = out.splitlines()
    assert header.split()[:3] == ["COUNT", "FINGERPRINT", "ERROR"]
    assert first.split()[0] == "3" and "ValueError" in first and second.split()[0] == "1"
    assert "4 dead letters in 2 group(s)" in err
    code, out, _ = run("dead-letters", "stats", "--actor", "render", "--json")
    stats = json.loads(out)
    assert stats["total"] == 1 and stats["groups"][0]["error_type"] == "KeyError"


def test_replay_by_id_reports_each_outcome_with_its_exit_code(broker, run, db, db_schema):
    fresh = _capture(broker)
    old = _capture(broker, sent_days_ago=21)

    code, out, _ = run("dead-letters", "replay", str(fresh.id))
    assert code == ExitCode.OK and "replayed 1 dead letter(s)" in out
    code, out, _ = run("dead-letters", "replay", str(fresh.id), "--json")
    assert code == REFUSED == 8
    assert json.loads(out) == {"replayed": 0, "too_old": 0, "problems": {str(fresh.id): "already replayed"}}
    code, out, _ = run("dead-letters", "replay", "999999")
    assert code == NOT_FOUND and "999999: not found" in out
    code, out, _ = run("dead-letters", "replay", str(old.id))
    assert code == REFUSED and "pass force" in out
    code, out, _ = run("dead-letters", "replay", str(old.id), "--force", "--to-queue", "repair", "--delay", "1m")
    assert code == ExitCode.OK
    assert _states(db, db_schema) == {fresh.id: "replayed", old.id: "replayed"}
    assert _outbox_count(db, db_schema) == 2


def test_bulk_replay_asks_first_and_refuses_without_a_terminal_or_yes(broker, run, db, db_schema, monkeypatch):
    stored = [_capture(broker, actor_name="charge_card") for _ in range(3)]
    spared = _capture(broker, actor_name="render")

    code, _, err = run("dead-letters", "replay", "--actor", "charge_card")  # pytest's stdin is no terminal
    assert code == ExitCode.ABORTED == 6
    assert "refusing to replay 3 dead letter(s) without confirmation" in err and "--yes" in err
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    code, _, err = run("dead-letters", "replay", "--actor", "charge_card")
    assert code == ExitCode.ABORTED and "replay 3 dead letter(s) (actor_name='charge_card')" in err
    assert set(_states(db, db_schema).values()) == {"dead"}

    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code, out, _ = run("dead-letters", "replay", "--actor", "charge_card")
    assert code == ExitCode.OK and "replayed 3 dead letter(s)" in out
    assert _states(db, db_schema) == {**{item.id: "replayed" for item in stored}, spared.id: "dead"}

    code, out, _ = run("dead-letters", "replay", "--all", "--yes", "--json")
    assert code == ExitCode.OK and json.loads(out)["replayed"] == 1
    code, out, _ = run("dead-letters", "replay", "--all", "--yes")
    assert code == ExitCode.OK and "no dead letters to replay" in out


def test_bulk_replay_leaves_old_jobs_and_says_how_to_replay_them(broker, run):
    _capture(broker)
    _capture(broker, sent_days_ago=10)
    code, out, _ = run("dead-letters", "replay", "--all", "--yes", "--max-age", "7d")
    assert code == REFUSED
    assert "replayed 1 dead letter(s)" in out and "1 first sent more than 7.0d ago stayed dead" in out
    code, out, _ = run("dead-letters", "replay", "--all", "--yes", "--force", "--json")
    assert code == ExitCode.OK and json.loads(out)["replayed"] == 1


def test_replay_and_discard_need_ids_a_filter_or_all(broker, run):
    for action in ("replay", "discard"):
        code, _, err = run("dead-letters", action)
        assert code == ExitCode.USAGE and "--all" in err


def test_discard_then_purge(broker, run, db, db_schema):
    keep = _capture(broker, actor_name="charge_card")
    drop = _capture(broker, actor_name="welcome_email")
    code, out, _ = run("dead-letters", "discard", "--actor", "welcome_email", "--reason", "too late now", "--yes")
    assert code == ExitCode.OK and "discarded 1" in out
    code, out, _ = run("dead-letters", "show", str(drop.id), "--json")
    assert json.loads(out)["note"] == "too late now" and json.loads(out)["state"] == "discarded"
    code, out, _ = run("dead-letters", "discard", str(drop.id))
    assert code == REFUSED and "already discarded" in out
    code, out, _ = run("dead-letters", "purge", "--json")
    assert code == ExitCode.OK and json.loads(out) == {"deleted": 1, "dead": 0, "handled": 1}
    assert _states(db, db_schema) == {keep.id: "dead"}


def test_a_missing_schema_and_an_unreachable_database_have_their_own_exit_codes(
    database_url, unmigrated_schema, capsys
):
    code = main(["dead-letters", "list", "--database-url", database_url, "--schema", unmigrated_schema])
    assert code == ExitCode.SCHEMA and "dramatiq-reliable migrate" in capsys.readouterr().err

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    secret = f"postgresql://postgres:s3cret-password@127.0.0.1:{port}/postgres"
    code = main(["dead-letters", "list", "--database-url", secret])
    err = capsys.readouterr().err
    assert code == ExitCode.UNAVAILABLE and "cannot reach Postgres" in err
    assert "s3cret" not in err


def test_the_module_runs_as_a_command_with_the_same_exit_codes(broker, database_url, db_schema):
    _capture(broker)
    deployed_as(database_url, db_schema, "outbox")
    base = [sys.executable, "-m", "dramatiq_reliable"]
    common = ["--database-url", database_url, "--schema", db_schema]
    listing = subprocess.run(
        [*base, "dead-letters", "list", "--json", *common], capture_output=True, text=True, timeout=60, check=False
    )
    assert listing.returncode == 0, listing.stderr
    assert len(json.loads(listing.stdout)["dead_letters"]) == 1
    refused = subprocess.run(
        [*base, "dead-letters", "replay", "--all", *common],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == ExitCode.ABORTED
    assert "pass --yes" in refused.stderr and database_url not in refused.stderr + refused.stdout
