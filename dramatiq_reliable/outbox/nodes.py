"""Several RabbitMQ nodes: each new connection starts at a random node of the list, then tries the rest.

pika, given a list of connection parameters (``url="amqp://a;amqp://b;amqp://c"`` or a list of
URLs), tries them in order, so every relay and worker of a deployment connects to the first
node while it is up: all the load on one node, and with classic queues all the queues on it too,
so losing it stops everything.  Here the list is rotated from a random start on every read of
``parameters`` (each connection reads it once), so connections spread over the nodes and a
reconnect after a node is lost goes on to the others.  Quorum queues then survive the loss of
any one node of three: RabbitMQ elects a new leader in a few seconds and the clients that were
connected to the lost node reconnect elsewhere.
"""

from __future__ import annotations

import random
from typing import Any

__all__: list[str] = []


class SpreadsOverNodes:
    """Mixed into a ``RabbitmqBroker``: ``parameters`` starts at a random node on every read."""

    _node_parameters: Any = None

    @property
    def parameters(self) -> Any:
        """The connection parameters, rotated from a random start when there are several."""
        nodes = self._node_parameters
        if isinstance(nodes, list) and len(nodes) > 1:
            start = random.randrange(len(nodes))
            return nodes[start:] + nodes[:start]
        return nodes

    @parameters.setter
    def parameters(self, value: Any) -> None:
        self._node_parameters = value
