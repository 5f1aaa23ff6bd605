"""Every RabbitMQ connection the package opens notices a silent partition in seconds: TCP
keepalives and TCP_USER_TIMEOUT on its socket, and a publish whose confirms time out aborts its
connection instead of closing it gracefully over the dead link (tests/acceptance/test_partition.py
measures both for real)."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from dramatiq_reliable import ConfigurationError, OutboxBroker
from dramatiq_reliable.outbox.publisher import Publisher
from dramatiq_reliable.queue_depths import QueueDepths

URL = "amqp://guest:guest@127.0.0.1:1/%2F"
DATABASE = "postgresql://app@127.0.0.1:1/app"  # never connected to: the pool opens lazily
BOUNDED = {"TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 10_000}


def test_the_broker_bounds_its_connections_and_so_its_workers_consumers() -> None:
    broker = OutboxBroker(url=URL, database=DATABASE)
    assert broker.parameters.tcp_options == BOUNDED


def test_the_bound_is_an_option_and_none_leaves_the_sockets_alone() -> None:
    shorter = OutboxBroker(url=URL, database=DATABASE, tcp_user_timeout_ms=3_000)
    unset = OutboxBroker(url=URL, database=DATABASE, tcp_user_timeout_ms=None)
    assert shorter.parameters.tcp_options["TCP_USER_TIMEOUT"] == 3_000
    assert unset.parameters.tcp_options is None


def test_tcp_options_in_the_url_win_on_every_url_of_a_list() -> None:
    broker = OutboxBroker(url=[URL, URL + "?tcp_options={'TCP_KEEPIDLE':60}"], database=DATABASE)
    # Each read starts at a random node (outbox/nodes.py): compare them whatever the order.
    options = [parameters.tcp_options for parameters in broker.parameters]
    assert sorted(options, key=len) == [{"TCP_KEEPIDLE": 60}, BOUNDED]


@pytest.mark.parametrize("value", [0, -1, 1.5, "10000", 2**31])
def test_a_bad_bound_is_refused_naming_the_option(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="tcp_user_timeout_ms must be"):
        OutboxBroker(url=URL, database=DATABASE, tcp_user_timeout_ms=value)
    with pytest.raises(ConfigurationError, match="tcp_user_timeout_ms must be"):
        Publisher(pika.URLParameters(URL), tcp_user_timeout_ms=value)


def test_the_relays_publisher_and_a_queue_depth_reader_from_a_url_are_bounded() -> None:
    assert Publisher(pika.URLParameters(URL))._declarer.parameters.tcp_options == BOUNDED
    assert QueueDepths(rabbitmq_url=URL).parameters.tcp_options == BOUNDED


class _DeadLink:
    """A connection whose peer stopped answering: a graceful close would wait on it."""

    def __init__(self) -> None:
        self.is_open = True
        self.is_closed = False
        self.aborted = False
        self._impl = self

    def _terminate_stream(self, error: Exception) -> None:
        self.aborted = True

    def process_data_events(self, time_limit: float = 0) -> None:
        self.is_open, self.is_closed = False, True
        raise pika.exceptions.StreamLostError("Stream connection lost")

    def close(self) -> None:
        raise AssertionError("a graceful close waits on the dead link for the server's reply")


def test_a_publisher_aborts_a_connection_whose_confirms_timed_out() -> None:
    publisher = Publisher(pika.URLParameters(URL))
    link = _DeadLink()
    publisher._declarer.state.connection = link
    publisher._declarer.connections.add(link)  # type: ignore[arg-type]
    publisher._reset(abort=True)
    assert link.aborted
    assert getattr(publisher._declarer.state, "connection", None) is None
