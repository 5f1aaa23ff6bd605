"""The status command and health numbers against a real Postgres and RabbitMQ."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

import dramatiq_reliable.health as health_lib
from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.cli import status as status_command
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def run(database_url: str, rabbitmq_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """Runs ``dramatiq-reliable status`` in-process; returns (exit code, stdout, stderr)."""

    def invoke(*args: str, database: str = database_url, rabbitmq: str = rabbitmq_url, schema: str = db_schema):
        code = main(["status", "--database-url", database, "--rabbitmq-url", rabbitmq, "--schema", schema, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _actor(broker: OutboxBroker, queue_name: str) -> dramatiq.Actor[Any, Any]:
    return dramatiq.actor(lambda *a: None, actor_name=f"{queue_name}_task", queue_name=queue_name, broker=broker)


def _age_outbox(db: psycopg.Connection[Any], db_schema: str, seconds: int) -> None:
    db.execute(
        sql.SQL("UPDATE {}.outbox SET created_at = created_at - make_interval(secs => %s)").format(
            sql.Identifier(db_schema)
        ),
        (seconds,),
    )


def _dead_letter(db: psycopg.Connection[Any], db_schema: str, queue_name: str, *, state: str = "dead") -> None:
    handled = "now()" if state != "dead" else "NULL"
    db.execute(
        sql.SQL(
            "INSERT INTO {}.dead_letters (message_id, queue_name, actor_name, message, reason, fingerprint, sent_at, "
            "first_failed_at, last_failed_at, worker_host, worker_pid, state, handled_at) "
            "VALUES (gen_random_uuid()::text, %s, 'a', '{{}}', 'throws', 'f', now(), now(), now() - interval '2 minutes', "
            "'h', 1, %s, " + handled + ")"
        ).format(sql.Identifier(db_schema)),
        (queue_name, state),
    )


def test_check_passes_when_every_threshold_holds(run, broker, queue_name):
    _actor(broker, queue_name).send()
    assert drain_outbox(broker) == 1
    code, out, err = run(
        "--check",
        "--queue",
        queue_name,
        "--max-outbox-age",
        "60s",
        "--max-dead-letters",
        "0",
        "--max-queue-depth",
        "5",
        "--max-outbox-backlog",
        "0",
    )
    assert code == ExitCode.OK, err
    assert "check passed" in out
    assert queue_name in out
    assert err == ""


def test_check_fails_on_an_old_outbox_row_and_names_the_queue(run, broker, queue_name, db, db_schema):
    task = _actor(broker, queue_name)
    task.send()
    task.send()
    _age_outbox(db, db_schema, 75)
    code, _out, err = run("--check", "--max-outbox-age", "60s", "--max-outbox-backlog", "1")
    assert code == ExitCode.CHECK_FAILED
    assert f"queue {queue_name!r}: oldest unpublished outbox row is" in err
    assert "over --max-outbox-age 60s" in err
    assert f"queue {queue_name!r}: 2 unpublished outbox rows, over --max-outbox-backlog 1" in err
    # A relay catches up and the same check passes.
    drain_outbox(broker)
    code, _out, err = run("--check", "--max-outbox-age", "60s", "--max-outbox-backlog", "1")
    assert code == ExitCode.OK, err


def test_check_fails_on_queue_depth_and_dead_letters(run, broker, queue_name, db, db_schema, rabbit):
    task = _actor(broker, queue_name)
    for _ in range(3):
        task.send()
    drain_outbox(broker)
    wait_for(lambda: rabbit.count(queue_name) == 3)
    _dead_letter(db, db_schema, queue_name)
    _dead_letter(db, db_schema, queue_name, state="replayed")  # handled rows are not counted
    code, _out, err = run("--check", "--max-queue-depth", "2", "--max-dead-letters", "0")
    assert code == ExitCode.CHECK_FAILED
    assert f"queue {queue_name!r}: 3 messages waiting, over --max-queue-depth 2" in err
    assert f"queue {queue_name!r}: 1 dead letter, over --max-dead-letters 0" in err
    code, _out, err = run("--check", "--max-queue-depth", "3", "--max-dead-letters", "1")
    assert code == ExitCode.OK, err


def test_json_reports_every_number_per_queue(run, broker, queue_name, db, db_schema, rabbit):
    task = _actor(broker, queue_name)
    task.send()
    assert drain_outbox(broker) == 1
    wait_for(lambda: rabbit.count(queue_name) == 1)
    task.send()  # stays in the outbox
    task.send_with_options(delay=600_000, retries=2)  # a retry waiting in the outbox for its eta
    _age_outbox(db, db_schema, 30)
    _dead_letter(db, db_schema, queue_name)
    code, out, err = run("--json", "--check", "--max-outbox-backlog", "0")
    assert code == ExitCode.CHECK_FAILED, err
    document = json.loads(out)
    (entry,) = [q for q in document["queues"] if q["queue"] == queue_name]
    assert entry["depth"] == 1
    assert entry["delayed"] == 0 and entry["xq"] == 0
    # The retry is scheduled, not a backlog: only the row due now counts against the threshold.
    assert entry["outbox_backlog"] == 1
    assert entry["outbox_scheduled"] == 1
    assert 30 <= entry["outbox_oldest_age_s"] < 60
    assert entry["dead_letters"] == 1
    assert 110 <= entry["dead_letters_newest_age_s"] < 200
    assert entry["retries_waiting"] == 1
    assert document["postgres"]["ok"] and document["rabbitmq"]["ok"]
    assert document["check"] == {
        "ok": False,
        "problems": [f"queue {queue_name!r}: 1 unpublished outbox row, over --max-outbox-backlog 0"],
    }


def test_an_unreachable_service_exits_unavailable_without_printing_its_url(run, queue_name):
    code, _out, err = run("--check", "--queue", queue_name, database="postgresql://secret_user:hunter2@127.0.0.1:1/x")
    assert code == ExitCode.UNAVAILABLE
    assert "cannot reach Postgres" in err and "hunter2" not in err
    code, _out, err = run("--check", "--queue", queue_name, rabbitmq="amqp://guest:hunter2@127.0.0.1:1/%2F")
    assert code == ExitCode.UNAVAILABLE
    assert "cannot reach RabbitMQ" in err and "hunter2" not in err
    code, _out, err = run(
        "--check", "--queue", queue_name, "--skip-rabbitmq", rabbitmq="amqp://guest:hunter2@127.0.0.1:1/%2F"
    )
    assert code == ExitCode.OK, err


def test_an_unmigrated_schema_exits_with_the_schema_code(run):
    code, _out, err = run("--check", schema=f"never_migrated_{uuid.uuid4().hex[:8]}")
    assert code == ExitCode.SCHEMA
    assert "dramatiq-reliable migrate" in err


def test_thresholds_without_check_are_a_usage_error(run):
    code, out, err = run("--max-queue-depth", "3")
    assert code == ExitCode.USAGE
    assert out == "" and err == "dramatiq-reliable: error: the --max-* thresholds apply only with --check\n"


def test_the_module_runs_as_a_command_for_probes(database_url, rabbitmq_url, db_schema, broker, queue_name, db):
    _actor(broker, queue_name).send()
    _age_outbox(db, db_schema, 120)
    command = [
        sys.executable,
        "-m",
        "dramatiq_reliable",
        "status",
        "--database-url",
        database_url,
        "--rabbitmq-url",
        rabbitmq_url,
        "--schema",
        db_schema,
        "--check",
        "--max-outbox-age",
        "1m",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.CHECK_FAILED, result.stderr
    assert queue_name in result.stdout
    assert "check failed" in result.stderr


def test_collect_health_for_gauges_skips_the_scans_and_reports_backlog_queues(
    broker, queue_name, database_url, db_schema
):
    _actor(broker, queue_name).send_with_options(delay=600_000, retries=1)
    health = health_lib.collect_health(database=database_url, schema=db_schema, discover_queues=False)
    item = health.queue(queue_name)
    # The delayed retry waits in the outbox for its time: scheduled, no backlog.
    assert (item.outbox_backlog, item.outbox_scheduled) == (0, 1)
    assert item.retries_waiting is None  # not scanned unless asked
    assert health.rabbitmq_error is None and health.postgres_error is None


def test_health_monitor_caches_a_reading_for_its_ttl(broker, queue_name, database_url, db_schema):
    task = _actor(broker, queue_name)
    monitor = health_lib.HealthMonitor(
        database=database_url, schema=db_schema, queues=lambda: [queue_name], ttl_ms=60000
    )
    first = monitor.get()
    task.send()
    assert monitor.get() is first
    assert first is not None and first.queue(queue_name).outbox_backlog == 0
    fresh = health_lib.HealthMonitor(database=database_url, schema=db_schema, queues=lambda: [queue_name], ttl_ms=0)
    reading = fresh.get()
    assert reading is not None and reading.queue(queue_name).outbox_backlog == 1


def test_register_adds_the_command_to_a_cli_parser_with_its_parents():
    import argparse

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url", default="postgresql://db")
    common.add_argument("--schema", default="s")
    rabbit = argparse.ArgumentParser(add_help=False)
    rabbit.add_argument("--rabbitmq-url", default="amqp://mq")
    parser = argparse.ArgumentParser(prog="dramatiq-reliable")
    commands = parser.add_subparsers(dest="command", required=True)
    status_command.register(commands, [common, rabbit])
    args = parser.parse_args(["status", "--check", "--max-outbox-age", "90s", "--queue", "a", "--queue", "b"])
    assert args.handler is not None
    assert (args.max_outbox_age, args.queue, args.database_url, args.rabbitmq_url) == (
        90_000,
        ["a", "b"],
        "postgresql://db",
        "amqp://mq",
    )


def test_check_health_names_each_crossed_threshold_and_ignores_unknown_numbers():
    health = health_lib.Health(
        queues=(
            health_lib.QueueHealth(
                queue="a", depth=5, xq=2, outbox_backlog=1, outbox_oldest_age_s=61.0, dead_letters=0
            ),
            health_lib.QueueHealth(queue="b"),  # nothing known: nothing crossed
        ),
        collected_at=0.0,
        dead_letters_table=True,
    )
    limits = health_lib.Thresholds(max_outbox_age_ms=60_000, max_queue_depth=5, max_xq=1, max_dead_letters=0)
    assert health_lib.check_health(health, limits) == [
        "queue 'a': oldest unpublished outbox row is 61s old, over --max-outbox-age 60s (is a relay running?)",
        "queue 'a': 2 messages in its .XQ, over --max-xq 1",
    ]
    assert health_lib.check_health(health, health_lib.Thresholds()) == []
