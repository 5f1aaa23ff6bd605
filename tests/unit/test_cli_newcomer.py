"""Issue 13's CLI list, checked where a newcomer looks first (no server needed for these).

Points that need a server are in tests/integration/test_cli_newcomer_servers.py and test_cli.py.
"""

from __future__ import annotations

import pytest
from support_cli import run

from dramatiq_reliable import __version__
from dramatiq_reliable.cli import ExitCode, build_parser


@pytest.mark.parametrize(
    "argv",
    [
        ["outbox", "stats", "--database-url", "postgresql://app:pw@127.0.0.1:abc/app"],
        ["status", "--database-url", "postgresql://127.0.0.1:1/app", "--rabbitmq-url", "amqp://a b@127.0.0.1:1/%2F"],
    ],
    ids=["bad postgres port", "space in rabbitmq url"],
)
def test_a_malformed_url_is_a_usage_error_not_unreachable(argv):
    outcome = run(argv)
    assert outcome.code == ExitCode.USAGE, outcome
    assert "unreachable" not in outcome.err and "cannot reach" not in outcome.err
    assert len(outcome.err.splitlines()) == 1


@pytest.mark.parametrize("command", ["relay", "migrate"])
def test_relay_and_migrate_help_have_a_description(command):
    sub = run([command, "--help"])
    assert sub.code == 0
    description = sub.out.split("\n\n")[1]
    assert not description.startswith(("options:", "positional")), sub.out
    assert len(description.split()) > 8


@pytest.mark.parametrize(
    ("option", "default"),
    [
        ("--batch-size", "500"),
        ("--on-published", "mark"),
        ("--max-priority", "none"),
        ("--queue-type", "classic"),
        ("--delivery-limit", "20"),
    ],
)
def test_relay_options_have_help_and_their_default(option, default):
    text = " ".join(run(["relay", "--help"]).out.split())
    after = text.split(option, 2)[-1][:300]
    assert f"(default: {default})" in after, after


def test_migrate_since_without_sql_is_refused_not_ignored():
    outcome = run(["migrate", "--since", "2", "--database-url", "postgresql://127.0.0.1:1/app"])
    assert outcome.code == ExitCode.USAGE
    assert "--sql" in outcome.err


def test_version_prints_the_version():
    outcome = run(["--version"])
    assert outcome.code == 0
    assert __version__ in outcome.out


def test_the_top_level_help_names_the_environment_variables_and_every_exit_code():
    text = build_parser().format_help()
    assert "DATABASE_URL" in text and "RABBITMQ_URL" in text
    for code in ExitCode:
        assert f"  {int(code)}  " in text, code
