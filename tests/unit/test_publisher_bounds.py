"""The relay's AMQP connection never waits without bound on a connection RabbitMQ blocks."""

from __future__ import annotations

import pika
import pytest

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.outbox.publisher import Publisher

URL = "amqp://guest:guest@127.0.0.1:1/%2F"


def test_a_url_without_a_bound_gets_the_confirm_timeout_as_its_blocked_connection_timeout() -> None:
    publisher = Publisher(pika.URLParameters(URL), confirm_timeout_ms=7_000)
    assert publisher._declarer.parameters.blocked_connection_timeout == 7.0


def test_what_the_url_sets_is_kept() -> None:
    publisher = Publisher(pika.URLParameters(URL + "?blocked_connection_timeout=3&heartbeat=120"))
    parameters = publisher._declarer.parameters
    assert (parameters.blocked_connection_timeout, parameters.heartbeat) == (3.0, 120)


def test_every_url_of_a_cluster_list_is_bounded() -> None:
    publisher = Publisher([pika.URLParameters(URL), pika.URLParameters(URL + "?blocked_connection_timeout=2")])
    # Each read starts at a random node (outbox/nodes.py): compare the bounds whatever the order.
    bounds = sorted(parameters.blocked_connection_timeout for parameters in publisher._declarer.parameters)
    assert bounds == [2.0, 30.0]


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"max_priority": 0}, "max_priority must be an int from 1 to 255 or None, got 0"),
        ({"confirm_timeout_ms": 0}, "confirm_timeout_ms must be an int >= 1 .milliseconds., got 0"),
        ({"confirm_timeout_ms": 1.5}, "confirm_timeout_ms must be an int >= 1 .milliseconds., got 1.5"),
    ],
)
def test_a_publisher_refuses_bad_bounds_with_the_one_checker(options, fix) -> None:
    with pytest.raises(ConfigurationError, match=fix):
        Publisher(pika.URLParameters(URL), **options)
