"""Issue 13's CLI list against real servers: the points test_cli.py does not already check.

Checked in test_cli.py: Postgres down fails at once in one line (outbox stats and others),
status says Postgres is unreachable first, RabbitMQ errors name host and port once, no INFO
log lines in command output, counted nouns, status --json totals of 0, relay progress lines.
"""

from __future__ import annotations

from typing import Any

import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.dead_letters import DeadLetters

pytestmark = pytest.mark.integration


@pytest.fixture
def run(database_url: str, db_schema: str, capsys: pytest.CaptureFixture[str]) -> Any:
    def invoke(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", database_url, "--schema", db_schema])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def _dead_letter(broker: Any, queue_name: str) -> int:
    message = Message(queue_name=queue_name, actor_name="a", args=(), kwargs={}, options={"retries": 1})
    proxy = MessageProxy(message)
    try:
        raise ValueError("boom")
    except ValueError as error:
        proxy.stuff_exception(error)
    proxy.fail()
    stored = DeadLetters().capture(broker, proxy)
    assert stored is not None
    return stored.id


def test_dead_letters_show_prints_the_traceback_once(run, broker, queue_name):
    code, out, _ = run("dead-letters", "show", str(_dead_letter(broker, queue_name)))
    assert code == ExitCode.OK
    assert out.count("Traceback (most recent call last)") == 1, out


def test_an_empty_list_after_a_discard_says_what_the_other_states_hold(run, broker, queue_name):
    dead_letter_id = _dead_letter(broker, queue_name)
    assert run("dead-letters", "discard", str(dead_letter_id), "--yes")[0] == ExitCode.OK
    code, out, err = run("dead-letters", "list")
    assert code == ExitCode.OK
    said = out + err
    assert "no dead letters (all)" not in said
    assert "discarded" in said and "1" in said, said
    code, out, _ = run("dead-letters", "list", "--state", "all")
    assert str(dead_letter_id) in out


def test_status_calls_the_rabbitmq_dead_queue_xq_and_keeps_dead_letters_for_postgres(
    run, rabbitmq_url, queue_name, rabbit
):
    code, out, err = run("status", "--queue", queue_name, "--rabbitmq-url", rabbitmq_url)
    assert code == ExitCode.OK, err
    header = out.splitlines()[0]
    assert ".XQ" in header and "dead letters" in header
    assert "dead(" not in header
