"""PostgresBroker without a server: the middleware it adds itself, and retention's argument checks."""

from __future__ import annotations

from typing import Any

import pytest
from dramatiq.middleware import Retries

from dramatiq_reliable import (
    ClassifiedRetries,
    ConfigurationError,
    DeadLetters,
    Idempotency,
    PostgresBroker,
    build_middleware,
)
from dramatiq_reliable.postgres import purge_dead
from dramatiq_reliable.postgres.broker import AckInJobTransaction
from dramatiq_reliable.sending import TrackProcessing

URL = "postgresql://app@localhost/app"  # never connected to: building a broker does no I/O


def _names(broker: PostgresBroker) -> list[str]:
    return [type(m).__name__ for m in broker.middleware]


@pytest.mark.parametrize(
    ("middleware", "retries"),
    [
        (build_middleware(middleware=[Idempotency(), DeadLetters()], retries=ClassifiedRetries()), ClassifiedRetries),
        (None, Retries),  # Dramatiq's defaults
    ],
)
def test_it_adds_the_tracker_first_and_the_in_transaction_ack_right_before_the_retries(
    middleware: Any, retries: type
) -> None:
    broker = PostgresBroker(database=URL, middleware=middleware)
    try:
        assert isinstance(broker.middleware[0], TrackProcessing)
        assert isinstance(broker.middleware[-2], AckInJobTransaction)
        assert isinstance(broker.middleware[-1], retries)
        assert _names(broker).count("TrackProcessing") == _names(broker).count("AckInJobTransaction") == 1
    finally:
        broker.close()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"older_than_ms": -1}, "older_than_ms"),
        ({"older_than_ms": 10**30}, "older_than_ms"),
        ({"older_than_ms": "7d"}, "older_than_ms"),
    ],
)
def test_purge_dead_refuses_bad_arguments_before_any_sql(options: dict[str, Any], named: str) -> None:
    arguments: dict[str, Any] = {"older_than_ms": 1000, **options}
    with pytest.raises(ConfigurationError, match=named):
        purge_dead(object(), **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "250"])
def test_a_bad_poll_interval_is_refused_with_the_fix(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"poll_interval_ms.*e\.g\. poll_interval_ms=250"):
        PostgresBroker(database="postgresql://nobody@127.0.0.1:1/none", poll_interval_ms=value)
