"""What a newcomer sees first: fast, one-line failures, errors that name the server, clean
output with no log lines mixed in, counted nouns, and a relay whose log shows it working."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from support_cli import Terminal

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.dead_letters import DeadLetters
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def run(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run a command on the test's schema in-process; return (exit code, stdout, stderr)."""

    def invoke(*argv: str, database: str = database_url) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", database, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _actor(broker: OutboxBroker, queue_name: str) -> dramatiq.Actor[Any, Any]:
    return dramatiq.actor(lambda *a: None, actor_name=f"{queue_name}_task", queue_name=queue_name, broker=broker)


@pytest.mark.parametrize(
    "command",
    [["outbox", "stats"], ["outbox", "purge"], ["idempotency", "purge"], ["dead-letters", "list"], ["relay", "--once"]],
    ids=" ".join,
)
def test_with_postgres_down_a_command_fails_at_once_in_one_line(run, command):
    # Before: 'outbox stats' waited out the pool's 10 s and printed 8 pool warnings first.
    secret = f"postgresql://app:hunter2@127.0.0.1:{_closed_port()}/app"
    started = time.monotonic()
    code, out, err = run(*command, database=secret)
    elapsed = time.monotonic() - started
    assert code == ExitCode.UNAVAILABLE
    assert elapsed < 3, f"took {elapsed:.1f}s"
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("dramatiq-reliable: error: cannot reach Postgres: ")
    assert "hunter2" not in err and "psycopg.pool" not in err


def test_status_with_postgres_down_says_so_first_not_that_no_queue_was_found(run):
    code, out, err = run("status", "--skip-rabbitmq", database=f"postgresql://app@127.0.0.1:{_closed_port()}/app")
    assert code == ExitCode.UNAVAILABLE
    assert out == "" and "no queues found" not in err
    assert err.startswith("dramatiq-reliable: error: cannot reach Postgres: ")


def test_a_rabbitmq_error_names_host_and_port_once_and_never_the_password(run, queue_name):
    port = _closed_port()
    code, _out, err = run("status", "--queue", queue_name, "--rabbitmq-url", f"amqp://app:hunter2@127.0.0.1:{port}/%2F")
    assert code == ExitCode.UNAVAILABLE
    assert err == f"dramatiq-reliable: error: cannot reach RabbitMQ at 127.0.0.1:{port}: connection refused\n"


def test_relay_once_says_why_rabbitmq_is_unreachable_once_then_publishes_and_counts_right(
    run, broker, queue_name, rabbitmq_url, rabbit
):
    _actor(broker, queue_name).send()
    port = _closed_port()
    code, out, err = run("relay", "--once", "--rabbitmq-url", f"amqp://app:hunter2@127.0.0.1:{port}/%2F")
    assert code == ExitCode.UNAVAILABLE and out == ""
    assert err == f"dramatiq-reliable: error: cannot reach RabbitMQ at 127.0.0.1:{port}: connection refused\n"
    code, out, err = run("relay", "--once", "--rabbitmq-url", rabbitmq_url)
    assert (code, out, err) == (ExitCode.OK, "published 1 row\n", "")
    wait_for(lambda: rabbit.count(queue_name) == 1)


def test_outbox_stats_counts_its_rows_in_words(run, broker, queue_name):
    task = _actor(broker, queue_name)
    task.send()
    task.send_with_options(delay=600_000)
    code, out, _ = run("outbox", "stats")
    assert code == ExitCode.OK
    lines = out.splitlines()
    assert lines[:2] == [
        "backlog    1 row due, waiting for the relay",
        "failing    0 rows failed to publish on their own; retried with backoff",
    ]
    # The delayed message is no backlog: it waits in the outbox for its time.
    assert lines[3] == "scheduled  1 row waiting for their time (delays, retries' backoff)"
    code, out, _ = run("outbox", "stats", "--json")
    document = json.loads(out)
    assert document["backlog"] == 1 and document["failing"] == 0 and document["scheduled"] == 1
    # The row was sent a moment ago: an age in seconds (not ms, not null) well under a minute.
    assert isinstance(document["oldest_age_s"], (int, float)) and 0 <= document["oldest_age_s"] < 60


def _published(db: Any, db_schema: str, *, days_ago: int, count: int) -> None:
    """``count`` outbox rows published ``days_ago`` days ago: what ``outbox purge`` deletes."""
    db.execute(
        psycopg.sql.SQL(
            "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body, published_at) "
            "SELECT 'm' || n, 'q', 'a', 'body', now() - make_interval(days => %s) FROM generate_series(1, %s) AS n"
        ).format(psycopg.sql.Identifier(db_schema)),
        (days_ago, count),
    )


def _kept(db: Any, db_schema: str) -> int:
    query = psycopg.sql.SQL("SELECT count(*) FROM {}.outbox").format(psycopg.sql.Identifier(db_schema))
    return int(db.execute(query).fetchone()[0])


def test_outbox_purge_asks_on_a_terminal_takes_yes_and_runs_unattended_from_a_schedule(run, db, db_schema, monkeypatch):
    """A question on a terminal, --yes to skip it, exit 6 when declined; a cron job (no terminal)
    goes ahead, as the other purges do.

    Before: 'outbox purge --yes' was a usage error (exit 2), and the purge never asked.
    """
    _published(db, db_schema, days_ago=2, count=3)
    _published(db, db_schema, days_ago=0, count=1)  # younger than --older-than: never counted nor deleted

    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    code, out, err = run("outbox", "purge")
    assert (code, out) == (ExitCode.ABORTED, "")
    assert err == "delete 3 published outbox rows older than 24.0h? [y/N] aborted; nothing changed\n"
    assert _kept(db, db_schema) == 4

    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    code, out, _ = run("outbox", "purge")
    assert (code, out) == (ExitCode.OK, "deleted 3 published rows\n")
    assert _kept(db, db_schema) == 1

    monkeypatch.setattr(sys, "stdin", Terminal(""))  # asked nothing: --yes answers
    _published(db, db_schema, days_ago=2, count=2)
    code, out, err = run("outbox", "purge", "--yes", "--json")
    assert (code, json.loads(out), err) == (ExitCode.OK, {"deleted": 2}, "")
    _published(db, db_schema, days_ago=2, count=1)
    code, out, err = run("outbox", "purge", "-y", "--older-than", "1h")
    assert (code, out, err) == (ExitCode.OK, "deleted 1 published row\n", "")
    assert _kept(db, db_schema) == 1

    monkeypatch.undo()  # pytest's own stdin is no terminal: a scheduled purge asks nothing
    _published(db, db_schema, days_ago=2, count=2)
    code, out, err = run("outbox", "purge")
    assert (code, out, err) == (ExitCode.OK, "deleted 2 published rows\n", "")
    assert _kept(db, db_schema) == 1


def test_outbox_purge_with_nothing_to_delete_asks_nothing(run, db, db_schema):
    """A scheduled purge that finds nothing past retention succeeds without --yes."""
    _published(db, db_schema, days_ago=0, count=1)
    code, out, err = run("outbox", "purge")
    assert (code, out, err) == (ExitCode.OK, "deleted 0 published rows\n", "")
    code, out, err = run("outbox", "purge", "--json")
    assert (code, json.loads(out), err) == (ExitCode.OK, {"deleted": 0}, "")
    assert _kept(db, db_schema) == 1


def test_no_info_log_line_is_mixed_into_a_commands_output(run, broker):
    # Both emit INFO events with float durations; a command shows WARNING and up only.
    code, out, err = run("idempotency", "purge")
    assert (code, out, err) == (ExitCode.OK, "deleted 0 expired idempotency keys\n", "")
    message = Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={"retries": 1})
    proxy = MessageProxy(message)
    try:
        raise ValueError("boom")
    except ValueError as error:
        proxy.stuff_exception(error)
    proxy.fail()
    stored = DeadLetters().capture(broker, proxy)
    assert stored is not None
    code, out, err = run("dead-letters", "replay", str(stored.id), "--to", "outbox")
    assert code == ExitCode.OK and out.startswith("replayed 1 dead letter")
    assert err == ""


def test_status_json_totals_are_zero_when_there_is_no_queue(run, rabbitmq_url):
    code, out, err = run("status", "--json", "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.OK, err
    document = json.loads(out)
    assert document["queues"] == []
    totals = document["totals"]
    assert {
        key: totals[key] for key in ("depth", "delayed", "xq", "outbox_backlog", "outbox_failing")
    } == dict.fromkeys(("depth", "delayed", "xq", "outbox_backlog", "outbox_failing"), 0)
    assert totals["dead_letters"] == 0 and totals["retries_waiting"] == 0


def test_a_long_running_relay_logs_progress_between_started_and_stopped(
    broker, queue_name, database_url, rabbitmq_url, db_schema, rabbit
):
    command = [
        sys.executable,
        "-m",
        "dramatiq_reliable",
        "relay",
        "--database-url",
        database_url,
        "--rabbitmq-url",
        rabbitmq_url,
        "--schema",
        db_schema,
        "--progress-interval",
        "1s",
    ]
    relay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(relay.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: any("outbox relay started" in line for line in lines), timeout_ms=20_000)
        _actor(broker, queue_name).send()
        wait_for(lambda: rabbit.count(queue_name) == 1, timeout_ms=20_000)
        wait_for(
            lambda: any("relay published 1 row in the last 1.0s; 0 rows waiting, 0 failing" in line for line in lines),
            timeout_ms=20_000,
            message=lambda: f"no progress line in {lines!r}",
        )
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=20) == 0
    finally:
        if relay.poll() is None:
            relay.kill()
        reader.join(timeout=5)
        relay.stderr.close()  # type: ignore[union-attr]
    text = "".join(lines)
    assert text.index("outbox relay started") < text.index("relay published 1 row") < text.index("outbox relay stopped")
    assert "Traceback" not in text
