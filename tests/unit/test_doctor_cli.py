"""The doctor command's exit code and table, from findings alone."""

from __future__ import annotations

import pytest

from dramatiq_reliable.cli import ExitCode
from dramatiq_reliable.cli.doctor import exit_code, render
from dramatiq_reliable.doctor import Finding

OK = Finding("relay", "ok", "the relay keeps up")
WARN = Finding("timeouts", "warn", "idle_in_transaction_session_timeout is 0", "set it")
FAIL = Finding("indexes", "fail", "missing: outbox_due", "run CREATE INDEX ...")
SCHEMA = Finding("schema", "fail", "never migrated", "run 'dramatiq-reliable migrate'")
DOWN = Finding("rabbitmq", "fail", "cannot reach RabbitMQ", "check the URL")


@pytest.mark.parametrize(
    ("findings", "strict", "code"),
    [
        ([OK], False, ExitCode.OK),
        ([OK, WARN], False, ExitCode.OK),
        ([OK, WARN], True, ExitCode.CHECK_FAILED),
        ([OK, FAIL], False, ExitCode.CHECK_FAILED),
        ([FAIL, SCHEMA], False, ExitCode.SCHEMA),
        ([FAIL, SCHEMA, DOWN], False, ExitCode.UNAVAILABLE),
    ],
)
def test_the_lowest_code_that_applies_wins(findings: list[Finding], strict: bool, code: ExitCode) -> None:
    assert exit_code(findings, strict=strict) == code


def test_the_table_gives_each_warning_and_problem_its_fix_and_counts_them() -> None:
    text = render([OK, WARN, FAIL])
    assert "relay     ok    the relay keeps up" in text
    assert "fix timeouts: set it" in text
    assert "fix indexes: run CREATE INDEX ..." in text
    assert "fix relay" not in text
    assert text.endswith("1 problem, 1 warning")
    assert render([OK]).endswith("no problems found")
