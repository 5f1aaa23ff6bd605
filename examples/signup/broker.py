"""Where the demo's messages travel: the one place that chooses the broker.

Today: an ``OutboxBroker`` on the given Postgres and RabbitMQ.  ``send()`` inside the signup's
transaction writes an outbox row; a relay (run here in a thread, so the demo can stop and
start it) forwards committed rows to RabbitMQ with publisher confirms; the worker consumes
from RabbitMQ.  Everything else in the demo only sees a Dramatiq broker and, when there is
one, a relay.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import pika
from dramatiq.middleware import Middleware

from dramatiq_reliable import OutboxBroker, Relay, migrate


@dataclass
class Transport:
    """The broker, a sentence saying what runs, and how to stop and start its relay."""

    broker: OutboxBroker
    description: list[str]
    rabbitmq_url: str
    _relay: Relay | None = None
    _thread: threading.Thread | None = None

    def start_relay(self) -> None:
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
        """Delete the demo's queues and their .DQ/.XQ companions: only what the demo declared."""
        connection = pika.BlockingConnection(pika.URLParameters(self.rabbitmq_url.split(";")[0]))
        try:
            channel = connection.channel()
            for name in queue_names:
                for suffix in ("", ".DQ", ".XQ"):
                    channel.queue_delete(name + suffix)
        finally:
            connection.close()


def make_transport(*, database_url: str, rabbitmq_url: str, schema: str, middleware: list[Middleware]) -> Transport:
    """The demo's broker.  TODO(PostgresBroker): with no server given, an embedded Postgres and
    a PostgresBroker (no RabbitMQ, no relay) are chosen here."""
    migrate(database_url, schema=schema)
    broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=schema, middleware=middleware)
    description = [
        "broker    OutboxBroker: sends are outbox rows in Postgres, a relay forwards them to RabbitMQ",
        f"Postgres  {masked(database_url)}, schema {schema!r} (made for this run, dropped at the end)",
        f"RabbitMQ  {masked(rabbitmq_url)}",
    ]
    return Transport(broker, description, rabbitmq_url)


def masked(url: str) -> str:
    """``url`` with its password masked, for printing."""
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)
