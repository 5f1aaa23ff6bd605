"""``status`` gives numbers a person on call can trust on every kind of deployment, with the real services.

Three deployments share one schema layout: ``PostgresBroker`` only (queue rows, no RabbitMQ),
``OutboxBroker`` (outbox rows a relay publishes to RabbitMQ), and a mixed one (a deployment
moving from the first to the second: the same queue has rows in Postgres and messages in
RabbitMQ).  "No RabbitMQ" is a RabbitMQ URL on a loopback port nothing listens on: configured
with ``--rabbitmq-url`` or ``$RABBITMQ_URL``, or as the command's local default when neither is set.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import closed_port, send_many

from dramatiq_reliable.cli import ExitCode, common, main
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def no_rabbitmq_url() -> str:
    """A RabbitMQ URL nothing answers at."""
    return f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F"


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch, no_rabbitmq_url: str) -> str:
    """Neither ``--rabbitmq-url`` nor ``$RABBITMQ_URL``, and the local default answers nothing."""
    monkeypatch.delenv("RABBITMQ_URL", raising=False)
    monkeypatch.setattr(common, "DEFAULT_RABBITMQ_URL", no_rabbitmq_url)
    return no_rabbitmq_url


@pytest.fixture
def status(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    """``status(*args)``: the command on the test's schema, in-process; (exit code, stdout, stderr)."""

    def invoke(*args: str) -> tuple[int, str, str]:
        code = main(["status", "--database-url", database_url, "--schema", db_schema, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _age_queue_rows(db: psycopg.Connection[Any], db_schema: str, seconds: int) -> None:
    db.execute(
        sql.SQL("UPDATE {}.queue SET enqueued_at = enqueued_at - make_interval(secs => %s)").format(
            sql.Identifier(db_schema)
        ),
        (seconds,),
    )


def _entry(out: str, queue_name: str) -> dict[str, Any]:
    document = json.loads(out)
    (entry,) = [item for item in document["queues"] if item["queue"] == queue_name]
    return entry


# -- a PostgresBroker queue shows its Postgres depth ---------------------------------------------


def test_a_postgres_queue_shows_its_postgres_depth_when_rabbitmq_answers(status, pg_broker, queue_name, rabbitmq_url):
    # Before: RabbitMQ's "no such queue" overwrote the depth with 0 and the check passed.
    send_many(pg_broker, queue_name, 2)
    code, out, err = status("--json", "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.OK, err
    entry = _entry(out, queue_name)
    assert entry["depth"] == 2
    assert entry["in_postgres"] == {"depth": 2, "delayed": 0, "xq": 0}
    assert entry["in_rabbitmq"] == {"depth": 0, "delayed": 0, "xq": 0}
    assert entry["queue_oldest_age_s"] is not None and entry["queue_oldest_age_s"] >= 0
    code, out, err = status("--check", "--max-queue-depth", "1", "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.CHECK_FAILED
    assert f"queue {queue_name!r}: 2 messages waiting, over --max-queue-depth 1" in err
    # The table says where the two are.
    (line,) = [row for row in out.splitlines() if row.startswith(queue_name)]
    assert "2 = 2 pg + 0 mq" in line
    assert "pg: rows in the Postgres queue table" in out


def test_the_age_of_the_oldest_ready_postgres_message_is_shown_and_can_be_checked(
    status, pg_broker, queue_name, db, db_schema, unconfigured
):
    send_many(pg_broker, queue_name, 1)
    _age_queue_rows(db, db_schema, 300)
    code, out, err = status("--check", "--max-queue-age", "1m")
    assert code == ExitCode.CHECK_FAILED, err
    assert f"queue {queue_name!r}: oldest ready message has waited 5m, over --max-queue-age 60s" in err
    header, line = out.splitlines()[0], next(row for row in out.splitlines() if row.startswith(queue_name))
    assert "waited" in header.split()
    assert line.split()[4] == "5m"
    code, out, err = status("--check", "--max-queue-age", "10m")
    assert code == ExitCode.OK, err
    code, out, _ = status("--json")
    assert 300 <= _entry(out, queue_name)["queue_oldest_age_s"] < 400
    assert 300 <= json.loads(out)["totals"]["queue_oldest_age_s"] < 400


# -- which RabbitMQ is read ------------------------------------------------------------------------


def test_a_postgres_broker_only_deployment_is_not_an_outage(status, pg_broker, queue_name, unconfigured):
    # Before: status read the default amqp://...@127.0.0.1:5672 and exited 3 (UNAVAILABLE).
    send_many(pg_broker, queue_name, 2)
    code, out, err = status("--check")
    assert code == ExitCode.OK, err
    assert err == "" and "check passed" in out
    assert "RabbitMQ not read: the outbox of schema" in out and "was never used" in out
    code, _out, err = status("--check", "--max-queue-depth", "1")
    assert code == ExitCode.CHECK_FAILED
    assert f"queue {queue_name!r}: 2 messages waiting, over --max-queue-depth 1" in err
    assert "RabbitMQ" not in err
    code, out, err = status("--json", "--check")
    assert code == ExitCode.OK, err
    document = json.loads(out)
    assert document["rabbitmq"]["ok"] is True and document["rabbitmq"]["error"] is None
    assert "never used" in document["rabbitmq"]["skipped"]
    assert document["queue_sources"] == ["postgres"]
    assert document["check"] == {"ok": True, "problems": []}
    entry = _entry(out, queue_name)
    assert (entry["depth"], entry["in_postgres"]["depth"], entry["in_rabbitmq"]) == (2, 2, None)


def test_a_fresh_schema_with_no_rabbitmq_configured_is_not_an_outage(status, unconfigured):
    code, out, err = status("--check")
    assert code == ExitCode.OK, err
    assert "check passed" in out


def test_an_outbox_deployment_reads_the_default_rabbitmq_and_its_absence_is_an_outage(
    status, broker, queue_name, unconfigured
):
    # The outbox was used, so RabbitMQ is part of the deployment even with no URL configured.
    send_many(broker, queue_name, 1)
    code, out, err = status("--check")
    assert code == ExitCode.UNAVAILABLE
    port = unconfigured.rsplit(":", 1)[1].split("/")[0]
    assert err == f"dramatiq-reliable: error: cannot reach RabbitMQ at 127.0.0.1:{port}: connection refused\n"
    code, out, _ = status("--json")
    document = json.loads(out)
    assert document["rabbitmq"]["skipped"] is None and document["rabbitmq"]["ok"] is False
    assert _entry(out, queue_name)["outbox_backlog"] == 1


def test_an_outbox_deployment_whose_outbox_rows_were_deleted_still_reads_rabbitmq(
    status, broker, queue_name, unconfigured, db, db_schema
):
    # The relay's on_published="delete" leaves no row; the outbox's id sequence remembers.
    send_many(broker, queue_name, 1)
    db.execute(sql.SQL("DELETE FROM {}.outbox").format(sql.Identifier(db_schema)))
    code, _out, err = status("--check")
    assert code == ExitCode.UNAVAILABLE
    assert "cannot reach RabbitMQ" in err


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_configured_rabbitmq_is_always_read_and_down_is_an_outage(
    status, pg_broker, queue_name, no_rabbitmq_url, monkeypatch, how
):
    send_many(pg_broker, queue_name, 2)
    if how == "option":
        monkeypatch.delenv("RABBITMQ_URL", raising=False)
        given: tuple[str, ...] = ("--rabbitmq-url", no_rabbitmq_url)
    else:
        monkeypatch.setenv("RABBITMQ_URL", no_rabbitmq_url)
        given = ()
    code, out, err = status("--json", "--check", "--max-queue-depth", "1", *given)
    assert code == ExitCode.UNAVAILABLE
    assert "cannot reach RabbitMQ" in err
    document = json.loads(out)
    entry = _entry(out, queue_name)
    # The total is unknown, Postgres's part is not, and the check still sees it.
    assert (entry["depth"], entry["in_postgres"]["depth"], entry["in_rabbitmq"]) == (None, 2, None)
    assert document["check"]["problems"] == [
        f"queue {queue_name!r}: at least 2 messages waiting (in Postgres; RabbitMQ could not be read), "
        "over --max-queue-depth 1"
    ]
    code, out, err = status("--skip-rabbitmq", "--check", *given)
    assert code == ExitCode.OK, err


# -- a mixed deployment: the same queue in both places ---------------------------------------------


def test_a_queue_moving_to_rabbitmq_shows_the_sum_and_each_place(
    status, pg_broker, broker, queue_name, rabbit, rabbitmq_url
):
    # Step 2 of "moving to RabbitMQ": old rows wait in Postgres while new messages reach RabbitMQ.
    send_many(pg_broker, queue_name, 2)
    send_many(pg_broker, queue_name, 1, delay=600_000)
    send_many(broker, queue_name, 3)
    assert drain_outbox(broker) == 3
    wait_for(lambda: rabbit.count(queue_name) == 3, message="the relay's 3 messages in RabbitMQ")
    code, out, err = status("--json", "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.OK, err
    entry = _entry(out, queue_name)
    assert (entry["depth"], entry["delayed"]) == (5, 1)
    assert entry["in_postgres"] == {"depth": 2, "delayed": 1, "xq": 0}
    assert entry["in_rabbitmq"] == {"depth": 3, "delayed": 0, "xq": 0}
    assert json.loads(out)["queue_sources"] == ["postgres", "rabbitmq"]
    code, out, err = status("--check", "--max-queue-depth", "4", "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.CHECK_FAILED
    assert f"queue {queue_name!r}: 5 messages waiting (2 in Postgres, 3 in RabbitMQ), over --max-queue-depth 4" in err
    (line,) = [row for row in out.splitlines() if row.startswith(queue_name)]
    assert "5 = 2 pg + 3 mq" in line and "1 = 1 pg + 0 mq" in line


def test_a_mixed_deployment_with_rabbitmq_down_is_an_outage_even_unconfigured(
    status, pg_broker, broker, queue_name, unconfigured
):
    send_many(pg_broker, queue_name, 2)
    send_many(broker, queue_name, 1)
    code, out, err = status("--check")
    assert code == ExitCode.UNAVAILABLE
    assert "cannot reach RabbitMQ" in err
    (line,) = [row for row in out.splitlines() if row.startswith(queue_name)]
    assert "2 pg + ? mq" in line


def test_with_rabbitmq_skipped_an_outbox_deployments_depth_is_unknown_and_a_postgres_ones_known(
    status, pg_broker, broker, queue_name, db, db_schema
):
    send_many(pg_broker, queue_name, 2)
    code, out, _ = status("--json", "--skip-rabbitmq")
    assert code == ExitCode.OK
    assert _entry(out, queue_name)["depth"] == 2  # the outbox was never used: no RabbitMQ part
    send_many(broker, f"{queue_name}_outbox", 1)
    code, out, _ = status("--json", "--skip-rabbitmq")
    assert code == ExitCode.OK
    document = json.loads(out)
    # Now RabbitMQ may hold messages nobody read: unknown, not 0, with Postgres's part kept.
    entry = _entry(out, queue_name)
    assert (entry["depth"], entry["in_postgres"]["depth"], entry["in_rabbitmq"]) == (None, 2, None)
    assert document["rabbitmq"]["skipped"] == "not asked to"
    assert document["totals"]["depth"] is None
