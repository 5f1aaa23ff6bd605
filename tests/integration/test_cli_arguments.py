"""The CLI's property test against a real Postgres: odd arguments reach the database and still
end in one line and a documented exit code (never 1, never a traceback).

The closed-port test (tests/unit/test_cli_hostile.py) stops every command at the connect; here
each command runs in a schema of its own, so values only the server would refuse (an id past
bigint, a time past year 9999, an interval out of range) are tried against the server.
RabbitMQ stays a closed port: nothing here publishes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from psycopg import sql
from support_cli import CLOSED_AMQP, assert_well_behaved, command_lines, run

from dramatiq_reliable import schema

pytestmark = pytest.mark.integration

_SCHEMA = f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module", autouse=True)
def _schema(database_url: str) -> Iterator[str]:
    schema.migrate(database_url, schema=_SCHEMA)
    yield _SCHEMA
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(_SCHEMA)))


@pytest.fixture(autouse=True)
def _no_rabbitmq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RABBITMQ_URL", CLOSED_AMQP)


def test_no_command_line_against_a_real_database_ends_in_a_traceback_or_exit_1(database_url):
    @settings(
        max_examples=200,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(command_lines(database_url=database_url, schema=_SCHEMA))
    def check(argv: list[str]) -> None:
        assert_well_behaved(run(argv), argv)

    check()
