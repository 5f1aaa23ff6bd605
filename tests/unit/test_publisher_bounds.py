"""The relay's AMQP connection never waits without bound on a connection RabbitMQ blocks."""

from __future__ import annotations

import pika

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
    first, second = publisher._declarer.parameters
    assert (first.blocked_connection_timeout, second.blocked_connection_timeout) == (30.0, 2.0)
