"""Where the demo's messages travel: the one place that chooses the broker.

With RabbitMQ: an ``OutboxBroker`` on the given Postgres and RabbitMQ.  ``send()`` inside the signup's
transaction writes an outbox row; a relay (run here in a thread, so the demo can stop and
start it) forwards committed rows to RabbitMQ with publisher confirms; the worker consumes
from RabbitMQ.  Everything else in the demo only sees a Dramatiq broker and, when there is
one, a relay.

Without RabbitMQ (``--broker postgres``, or ``RABBITMQ_URL`` unset and nothing answering at the
default URL): a ``PostgresBroker``.  Its queues are tables in the demo's schema, so the send is
the queue row, committed with the account: there is no relay to stop and nothing to delete.
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass

import pika
from dramatiq.middleware import Middleware

from dramatiq_reliable import OutboxBroker, PostgresBroker, Relay, migrate


@dataclass
class Transport:
    """The broker, a sentence saying what runs, and how to stop and start its relay."""

    broker: OutboxBroker | PostgresBroker
    description: list[str]
    rabbitmq_url: str | None
    _relay: Relay | None = None
    _thread: threading.Thread | None = None

    @property
    def has_relay(self) -> bool:
        """An OutboxBroker has a relay; with a PostgresBroker the send is the queue row."""
        return isinstance(self.broker, OutboxBroker)

    def start_relay(self) -> None:
        if not isinstance(self.broker, OutboxBroker):
            return
        # A stopped Relay stays stopped: a restart is a new one, as a new process would be.
        self._relay = Relay.from_broker(self.broker, poll_interval_ms=100)
        self._thread = threading.Thread(target=self._relay.run, name="demo-relay", daemon=True)
        self._thread.start()

    def stop_relay(self) -> None:
        if self._relay is not None and self._thread is not None:
            self._relay.stop()  # finishes the batch in hand, as on SIGTERM
            self._thread.join(timeout=30)
        self._relay = self._thread = None

    def delete_queues(self, queue_names: list[str]) -> None:
        """Delete the demo's queues and their .DQ/.XQ companions: only what the demo declared.

        A PostgresBroker's queues are rows in the demo's schema, dropped with it."""
        if self.rabbitmq_url is None:
            return
        connection = pika.BlockingConnection(pika.URLParameters(self.rabbitmq_url.split(";")[0]))
        try:
            channel = connection.channel()
            for name in queue_names:
                for suffix in ("", ".DQ", ".XQ"):
                    channel.queue_delete(name + suffix)
        finally:
            connection.close()


def make_transport(
    *, database_url: str, rabbitmq_url: str | None, schema: str, middleware: list[Middleware]
) -> Transport:
    """The demo's broker: an OutboxBroker on ``rabbitmq_url``, or a PostgresBroker when it is None."""
    migrate(database_url, schema=schema)
    if rabbitmq_url is None:
        broker: OutboxBroker | PostgresBroker = PostgresBroker(
            database=database_url, schema=schema, middleware=middleware
        )
        description = [
            "broker    PostgresBroker: sends are queue rows in Postgres, no RabbitMQ and no relay",
            f"Postgres  {masked(database_url)}, schema {schema!r} (made for this run, dropped at the end)",
        ]
        return Transport(broker, description, None)
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=schema, middleware=middleware)
    description = [
        "broker    OutboxBroker: sends are outbox rows in Postgres, a relay forwards them to RabbitMQ",
        f"Postgres  {masked(database_url)}, schema {schema!r} (made for this run, dropped at the end)",
        f"RabbitMQ  {masked(rabbitmq_url)}",
    ]
    return Transport(broker, description, rabbitmq_url)


def answers(host: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (a server to try, not a health check)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def masked(url: str) -> str:
    """``url`` with its password masked, for printing."""
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)
