"""Batches and Workflows refuse a write timeout that is not a positive number of milliseconds, and say when they come too early."""

from __future__ import annotations

import logging

import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_reliable import ConfigurationError, Idempotency
from dramatiq_reliable.workflows import Batches, Workflows


@pytest.mark.parametrize("middleware", [Batches, Workflows])
@pytest.mark.parametrize("bad", [0, -1, 1.5, "30s", True])
def test_write_timeout_ms_must_be_a_positive_int(middleware: type, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="write_timeout_ms"):
        middleware(write_timeout_ms=bad)


def test_write_timeout_ms_is_kept() -> None:
    assert Batches(write_timeout_ms=500).write_timeout_ms == 500
    assert Workflows().write_timeout_ms == 30_000


@pytest.mark.parametrize(("middleware", "member"), [(Batches, "child"), (Workflows, "step")])
def test_a_bad_write_timeout_ms_names_the_member_whose_message_is_failed(middleware: type, member: str) -> None:
    with pytest.raises(ConfigurationError, match=f"past it the {member}'s message is failed"):
        middleware(write_timeout_ms=0)


@pytest.mark.parametrize(
    ("middleware", "logger", "late"),
    [
        (Batches, "dramatiq_reliable.workflows.batch", "children are counted after their job commits"),
        (Workflows, "dramatiq_reliable.workflows.workflow", "steps are marked (and the next stage sent) after"),
    ],
)
def test_worker_boot_warns_when_the_middleware_comes_before_idempotency(
    middleware: type, logger: str, late: str, caplog: pytest.LogCaptureFixture
) -> None:
    marking = middleware()
    first, second = StubBroker(middleware=[]), StubBroker(middleware=[])
    first.add_middleware(marking)
    first.add_middleware(Idempotency())
    second.add_middleware(Idempotency())
    second.add_middleware(marking)
    with caplog.at_level(logging.WARNING, logger=logger):
        marking.before_worker_boot(second, None)
        assert caplog.records == [], "after Idempotency is the right place: nothing to say"
        marking.before_worker_boot(first, None)
    assert [(r.name, r.levelno) for r in caplog.records] == [(logger, logging.WARNING)]
    assert late in caplog.records[0].getMessage()
    assert f"add {middleware.__name__} after Idempotency" in caplog.records[0].getMessage()


def test_a_subclass_under_another_name_boots_and_is_still_checked(caplog: pytest.LogCaptureFixture) -> None:
    class ShopWorkflows(Workflows):
        pass

    marking = ShopWorkflows()
    broker = StubBroker(middleware=[])
    broker.add_middleware(marking)
    broker.add_middleware(Idempotency())
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.workflows.workflow"):
        marking.before_worker_boot(broker, None)  # looked its class name up, and raised ValueError
    assert ["comes before Idempotency" in r.getMessage() for r in caplog.records] == [True]
