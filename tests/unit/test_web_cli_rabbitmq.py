"""``dramatiq-reliable web`` reads RabbitMQ where the deployment has one, and only there (no service needed)."""

from __future__ import annotations

from typing import Any

import pytest

import dramatiq_reliable.web
from dramatiq_reliable.cli import ExitCode, common, main

LOCAL = "amqp://guest:guest@127.0.0.1:5672/%2F"
GIVEN = "amqp://app:secret@rabbitmq.example:5672/%2F"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The options ``web`` built its app with; uvicorn is not started."""
    import uvicorn

    seen: dict[str, Any] = {}
    monkeypatch.setattr(dramatiq_reliable.web, "create_app", lambda database, **options: seen.update(options))
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)
    monkeypatch.delenv("RABBITMQ_URL", raising=False)
    monkeypatch.setattr(common, "DEFAULT_RABBITMQ_URL", LOCAL)
    return seen


@pytest.mark.parametrize(
    ("arguments", "environment", "read"),
    [
        # A PostgresBroker deployment has no RabbitMQ to show as down...
        (["--to", "queue"], None, None),
        # ...unless one is configured: then it is read, as status reads it.
        (["--to", "queue", "--rabbitmq-url", GIVEN], None, GIVEN),
        (["--to", "queue"], GIVEN, GIVEN),
        # An OutboxBroker deployment's relay publishes to RabbitMQ: the local one by default.
        ([], None, LOCAL),
        (["--to", "outbox"], GIVEN, GIVEN),
        (["--skip-rabbitmq"], GIVEN, None),
    ],
)
def test_the_page_reads_rabbitmq_where_the_deployment_has_one(served, monkeypatch, arguments, environment, read):
    if environment is not None:
        monkeypatch.setenv("RABBITMQ_URL", environment)
    assert main(["web", "--database-url", "postgresql://app@127.0.0.1:1/app", *arguments]) == ExitCode.OK
    assert served["rabbitmq_url"] == read
