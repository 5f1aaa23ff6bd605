"""What the command says when a service cannot be reached or a URL is wrong: one reason, said
once, with the host and port and never the password."""

from __future__ import annotations

import socket

import pika
import pika.exceptions
import pytest
from pika.adapters.utils.connection_workflow import AMQPConnectionWorkflowFailed, AMQPConnectorSocketConnectError

from dramatiq_reliable._util import rabbitmq_address, rabbitmq_error, rabbitmq_reason
from dramatiq_reliable.cli.common import _postgres_url_problem, _rabbitmq_url_problem, _safe_url


def _refused() -> BaseException:
    # What pika raises for a closed port: three levels that each repeat the one below.
    return pika.exceptions.AMQPConnectionError(
        AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "Connection refused"))
    )


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (_refused(), "connection refused"),
        (AMQPConnectionWorkflowFailed([_refused(), TimeoutError()]), "timed out"),
        (
            pika.exceptions.ProbableAuthenticationError("ConnectionClosedByBroker: (403) 'ACCESS_REFUSED - Login'"),
            "login refused: check the user and password",
        ),
        (
            pika.exceptions.ProbableAccessDeniedError(
                "ConnectionClosedByBroker: (530) 'NOT_ALLOWED - vhost x not found'"
            ),
            "access refused (530 NOT_ALLOWED - vhost x not found): check the virtual host and the user's permissions",
        ),
        (
            pika.exceptions.IncompatibleProtocolError("StreamLostError"),
            "the server does not speak AMQP 0-9-1: is this RabbitMQ's port?",
        ),
        (socket.gaierror(-2, "Name or service not known"), "cannot resolve the host name (Name or service not known)"),
        (
            pika.exceptions.ConnectionClosedByBroker(320, "CONNECTION_FORCED"),
            "RabbitMQ closed the connection (320 CONNECTION_FORCED)",
        ),
    ],
)
def test_a_rabbitmq_failure_is_named_once_in_plain_words(error, reason):
    assert rabbitmq_reason(error) == reason


def test_the_address_of_rabbitmq_is_host_and_port_and_never_the_credentials():
    parameters = pika.URLParameters("amqp://app:hunter2@mq.example:5673/%2F")
    assert rabbitmq_address(parameters) == "mq.example:5673"
    assert rabbitmq_address([parameters, pika.URLParameters("amqp://app:hunter2@[::1]:1/%2F")]) == (
        "mq.example:5673, [::1]:1"
    )
    assert rabbitmq_error(_refused(), parameters) == "cannot reach RabbitMQ at mq.example:5673: connection refused"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("app:hunter2@db/app", "it has no postgresql:// scheme"),
        ("", "it is empty"),
        ("mysql://app:hunter2@db/app", "its scheme is 'mysql', not postgresql://"),
        ("postgresql://app:hunter2@db:five/app", "port 'five' is not a number from 1 to 65535"),
        (
            "postgresql://app:hun ter2@db/app",
            'unexpected spaces found in "***", use percent-encoded spaces (%20) instead',
        ),
        ("host=db password=hun ter2", 'missing "=" after "***" in connection info string'),
        ("postgresql://db/app?connect_timeout=soon", "connect_timeout 'soon' is not a whole number of seconds"),
        ("postgresql://app:hunter2@db:5432/app", None),
        ("host=db dbname=app", None),
    ],
)
def test_a_malformed_postgres_url_says_what_is_wrong_without_the_password(url, problem):
    assert _postgres_url_problem(url) == problem


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("garbage", "it has no amqp:// scheme"),
        ("http://mq", "it has scheme 'http'"),
        ("amqp://app:hunter2@mq:99999/%2F", "Port out of range 0-65535"),
        ("amqp://app:hunter2@mq/%2F?bogus=1", "Unknown URL parameter: 'bogus'"),
        ("amqp://a/%2F;", "it has an empty URL between two ';'"),
        ("amqp://app:hunter2@mq:5672/%2F;amqps://mq2", None),
    ],
)
def test_a_malformed_rabbitmq_url_says_what_is_wrong(url, problem):
    assert _rabbitmq_url_problem(url) == problem


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:hunter2@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:hun ter2/x@db/app", "postgresql://app:***@db/app"),
        ("app:hunter2 x@db/app", "app:***@db/app"),
        ("postgresql://postgres@127.0.0.1:5432/postgres", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ("host=db password=hun ter2 dbname=app", "host=db password=*** dbname=app"),
    ],
)
def test_urls_in_help_texts_never_show_a_password(url, shown):
    assert _safe_url(url) == shown
