"""Hostile and odd command lines: one line on stderr, a documented exit code, never a traceback.

The property test draws argv from the parser's own actions (tests/support_cli.py), so an option
added tomorrow is covered without touching this file.  No service is needed: every URL points
at a closed port (127.0.0.1:1), so a command that gets as far as connecting fails at once with
exit 3.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from support_cli import CLOSED_AMQP, CLOSED_PG, LEAVES, SECRET, assert_well_behaved, command_lines, run

from dramatiq_reliable.cli import ExitCode


@pytest.fixture(autouse=True)
def _closed_services(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the environment says, nothing here may reach a real server.
    monkeypatch.setenv("DATABASE_URL", CLOSED_PG)
    monkeypatch.setenv("RABBITMQ_URL", CLOSED_AMQP)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)


# -- the eleven inputs of the probe, and their exit codes ---------------------------------------

HOSTILE = [
    (["dead-letters", "replay", str(2**63), "--yes"], ExitCode.USAGE, "out of range"),
    (["dead-letters", "discard", "99999999999999999999999", "--yes"], ExitCode.USAGE, "out of range"),
    (["dead-letters", "list", "--since", "999999999w"], ExitCode.USAGE, "too long"),
    (["dead-letters", "purge", "--older-than", "999999999w"], ExitCode.USAGE, "too long"),
    (["outbox", "purge", "--older-than", "9" * 400 + "d"], ExitCode.USAGE, "too long"),
    (["dead-letters", "replay", "--all", "--yes", "--delay", "999999999w"], ExitCode.USAGE, "too long"),
    (["dead-letters", "list", "--cursor", "9999999999999999999.1"], ExitCode.USAGE, "not a cursor"),
    (["dead-letters", "list", "--actor", b"caf\xe9".decode("utf-8", "surrogateescape")], ExitCode.USAGE, "UTF-8"),
    (["outbox", "stats", "--database-url", f"postgresql://app:{SECRET} x@db/app"], ExitCode.USAGE, "Postgres URL"),
    (["status", "--rabbitmq-url", f"amqp://app:{SECRET}@db:port/%2F"], ExitCode.USAGE, "RabbitMQ URL"),
    (["migrate", "--schema", "pg_app"], ExitCode.USAGE, "reserves"),
    (["status", "--queue", "q" * 300], ExitCode.USAGE, "not a queue name"),
    (["dead-letters", "list", "--actor", "a\x00b"], ExitCode.USAGE, "NUL"),
    (["relay", "--once", "--max-priority", "256"], ExitCode.USAGE, "out of range"),
    (["relay", "--once", "--poll-interval", "0"], ExitCode.USAGE, "too short"),
    (["migrate", "--since", "2"], ExitCode.USAGE, "only with --sql"),
    (["status", "--max-queue-depth", "3"], ExitCode.USAGE, "only with --check"),
    (["outbox", "stats"], ExitCode.UNAVAILABLE, "cannot reach Postgres"),
    (["status", "--skip-rabbitmq"], ExitCode.UNAVAILABLE, "cannot reach Postgres"),
]


@pytest.mark.parametrize(("argv", "code", "says"), HOSTILE, ids=[" ".join(a)[:50] for a, _, _ in HOSTILE])
def test_each_hostile_input_gets_one_line_and_its_documented_code(argv, code, says):
    outcome = run(argv)
    assert_well_behaved(outcome, argv)
    assert outcome.code == code, outcome
    assert says in outcome.err


def test_a_malformed_url_in_the_environment_is_a_usage_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", f"app:{SECRET}@db/app")
    outcome = run(["dead-letters", "list"])
    assert_well_behaved(outcome, [])
    assert outcome.code == ExitCode.USAGE
    assert "$DATABASE_URL is not a valid Postgres URL (it has no postgresql:// scheme)" in outcome.err
    # A command that does not use RabbitMQ does not care that $RABBITMQ_URL is broken.
    monkeypatch.setenv("RABBITMQ_URL", "garbage")
    monkeypatch.setenv("DATABASE_URL", CLOSED_PG)
    assert run(["outbox", "stats"]).code == ExitCode.UNAVAILABLE
    assert run(["status"]).code == ExitCode.USAGE


# -- the property ----------------------------------------------------------------------------


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(command_lines())
def test_no_command_line_ends_in_a_traceback_an_undocumented_code_or_a_password(argv):
    assert_well_behaved(run(argv), argv)


def test_the_generator_reaches_every_command():
    assert {" ".join(path) for path, _ in LEAVES} >= {
        "migrate",
        "relay",
        "outbox stats",
        "outbox purge",
        "idempotency purge",
        "dead-letters list",
        "dead-letters show",
        "dead-letters stats",
        "dead-letters replay",
        "dead-letters discard",
        "dead-letters purge",
        "status",
    }
