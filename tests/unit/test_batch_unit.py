"""Batch refuses bad input before any I/O: a callback that is no message of a declared actor, a broker without Postgres."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_reliable import Batch, ConfigurationError


def test_a_callback_must_be_a_message_of_a_declared_actor_on_a_postgres_backed_broker() -> None:
    broker = StubBroker()

    @dramatiq.actor(broker=broker)
    def report(month: str) -> None: ...

    with pytest.raises(ConfigurationError, match="callback must be a message, got .*; pass actor.message"):
        Batch(callback="report", broker=broker)  # type: ignore[arg-type]
    undeclared = dramatiq.Message("default", "elsewhere", ("2026-11",), {}, {})
    with pytest.raises(ConfigurationError, match="actor 'elsewhere', which is not declared on this broker; declare"):
        Batch(callback=undeclared, broker=broker)
    with pytest.raises(ConfigurationError, match="on_failure is a message of actor 'elsewhere'"):
        Batch(callback=report.message("2026-11"), on_failure=undeclared, broker=broker)
    with pytest.raises(ConfigurationError, match="Batch has no database on a StubBroker"):
        Batch(callback=report.message("2026-11"), broker=broker)
