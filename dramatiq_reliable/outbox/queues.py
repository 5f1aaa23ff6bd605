"""How the outbox's RabbitMQ queues are declared: classic or quorum, and what each argument means.

Workers (``OutboxBroker``) and relays (the publisher) declare the same queues, and RabbitMQ
refuses a declaration whose arguments differ from the queue's (``PRECONDITION_FAILED``), so both
build their arguments here from one :class:`QueueSettings`.  Classic queues get exactly
Dramatiq's arguments (dead-lettering to ``.XQ``, ``x-max-priority``), so a deployment that
stays classic declares nothing new.

Quorum queues (replicated with Raft; the only replicated queue type since RabbitMQ 4 removed
classic mirroring) get ``x-queue-type: quorum`` on the queue, its ``.DQ`` and its ``.XQ``, and on
the queue itself:

* ``x-delivery-limit`` a few deliveries above the worker's own ``delivery_limit``
  (:mod:`~dramatiq_reliable.outbox.delivery_limit`): the worker moves a message that keeps
  killing workers to the ``dead_letters`` table first; RabbitMQ's limit is only the backstop
  for a worker that dies while doing so, and then dead-letters to ``.XQ``
  (``dramatiq-reliable dead-letters import-xq`` brings it over), never drops it.
* ``x-dead-letter-strategy: at-least-once`` (with ``x-overflow: reject-publish``, which it
  requires and which does nothing without a length limit): a message dead-lettered to ``.XQ``
  stays in the queue until ``.XQ`` has it, where the default strategy may lose it.

The ``.DQ`` queue gets no delivery limit: a delayed message waits unacked in worker memory, and
every consumer restart counts as a delivery, so a limit there would dead-letter messages that
never ran.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

import pika.exceptions
from dramatiq.common import dq_name, q_name, xq_name

from .._checks import check_choice, check_int, check_queue_name
from ..errors import ConfigurationError, QueueMismatch

__all__: list[str] = []

QueueType = Literal["classic", "quorum"]
QUEUE_TYPES: tuple[QueueType, ...] = ("classic", "quorum")

#: Dramatiq's ``.XQ`` message TTL (``dramatiq.brokers.rabbitmq.DEAD_MESSAGE_TTL``): seven days.
_DEAD_MESSAGE_TTL_MS = 86_400_000 * 7
#: How many deliveries RabbitMQ allows past the worker's limit before its own backstop: room for
#: a worker that dies while storing the dead letter, a few times over.
BACKSTOP_MARGIN = 5
#: Where the move from classic to quorum queues is written down.
MOVE_DOCS = "docs/production-topology.md, 'Moving a classic deployment to quorum queues'"

_INEQUIVALENT = re.compile(r"inequivalent arg '(?P<arg>[^']+)'")


@dataclasses.dataclass(frozen=True)
class QueueSettings:
    """Which type each queue is and the arguments that follow from it; validated on construction.

    ``queue_type`` is every queue's type unless ``queue_types`` names the queue.
    ``delivery_limit`` is the worker's limit on quorum queues (``None``: no limit of ours nor
    RabbitMQ's; a poison message then kills workers forever).
    """

    queue_type: QueueType = "classic"
    queue_types: Mapping[str, QueueType] = dataclasses.field(default_factory=dict)
    max_priority: int | None = None
    delivery_limit: int | None = 20

    def __post_init__(self) -> None:
        check_choice("queue_type", self.queue_type, QUEUE_TYPES, fix="e.g. queue_type='quorum'")
        if not isinstance(self.queue_types, Mapping):
            raise ConfigurationError(
                f"queue_types must map queue names to 'classic' or 'quorum', got {self.queue_types!r}; "
                "e.g. queue_types={'emails': 'quorum'}"
            )
        types: dict[str, QueueType] = {}
        for name, kind in self.queue_types.items():
            check_queue_name("a queue_types key", name)
            types[q_name(name)] = check_choice(
                f"queue_types[{name!r}]", kind, QUEUE_TYPES, fix="e.g. queue_types={'emails': 'quorum'}"
            )
        object.__setattr__(self, "queue_types", types)
        check_int("max_priority", self.max_priority, minimum=1, maximum=255, allow_none=True)
        check_int("delivery_limit", self.delivery_limit, minimum=1, maximum=1_000_000, allow_none=True, fix="e.g. 20")
        quorum = [name for name, kind in types.items() if kind == "quorum"]
        if self.max_priority is not None and (self.queue_type == "quorum" or quorum):
            which = "every queue" if self.queue_type == "quorum" else f"the queues {sorted(quorum)!r}"
            raise ConfigurationError(
                f"max_priority={self.max_priority!r} cannot apply to quorum queues ({which}): RabbitMQ 3.x quorum "
                "queues have no priorities and refuse x-max-priority; drop max_priority, or keep the queues that "
                "need priorities classic with queue_types={'name': 'classic'} and no max_priority on the others "
                "(one broker per kind)"
            )

    def type_of(self, queue_name: str) -> QueueType:
        """The type of ``queue_name`` (or of the canonical queue of its ``.DQ``/``.XQ``)."""
        return self.queue_types.get(q_name(queue_name), self.queue_type)

    def limit_of(self, queue_name: str) -> int | None:
        """The worker's delivery limit for consumers of ``queue_name``: only canonical quorum queues."""
        if queue_name != q_name(queue_name) or self.type_of(queue_name) != "quorum":
            return None
        return self.delivery_limit

    def arguments(self, queue_name: str) -> dict[str, Any]:
        """The declare arguments of ``queue_name``, a canonical queue or its ``.DQ``/``.XQ``."""
        canonical = q_name(queue_name)
        quorum = self.type_of(canonical) == "quorum"
        if queue_name == xq_name(canonical):
            arguments: dict[str, Any] = {"x-message-ttl": _DEAD_MESSAGE_TTL_MS}
            return {**arguments, "x-queue-type": "quorum"} if quorum else arguments
        arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": xq_name(canonical)}
        if not quorum:
            if self.max_priority:
                arguments["x-max-priority"] = self.max_priority
            return arguments
        arguments.update({"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once"})
        arguments["x-overflow"] = "reject-publish"
        if queue_name == canonical and self.delivery_limit is not None:
            arguments["x-delivery-limit"] = self.delivery_limit + BACKSTOP_MARGIN
        return arguments


class DeclaresQueues:
    """Mixed into a ``RabbitmqBroker``: declare its queues from :attr:`queue_settings`.

    Overrides Dramatiq's three ``_declare_*`` methods only, so its ``_ensure_queue`` (retries,
    pending queues) is unchanged; a declaration RabbitMQ refuses because the queue exists with
    other arguments raises :class:`~dramatiq_reliable.errors.QueueMismatch` at once instead of
    being retried as a connection error twenty times.
    """

    queue_settings: QueueSettings
    channel: Any

    def _declare_queue(self, queue_name: str) -> Any:
        return self._declare(queue_name)

    def _declare_dq_queue(self, queue_name: str) -> Any:
        return self._declare(dq_name(queue_name))

    def _declare_xq_queue(self, queue_name: str) -> Any:
        return self._declare(xq_name(queue_name))

    def _declare(self, name: str) -> Any:
        arguments = self.queue_settings.arguments(name)
        try:
            return self.channel.queue_declare(queue=name, durable=True, arguments=arguments)
        except pika.exceptions.ChannelClosedByBroker as error:
            match = _INEQUIVALENT.search(str(error.reply_text))
            if error.reply_code != 406 or match is None:
                raise
            del self.channel  # RabbitMQ closed it; the next declare opens another
            raise mismatch(name, match["arg"], self.queue_settings.type_of(name), str(error.reply_text)) from error


#: Arguments only our quorum queues carry: RabbitMQ may name one of them, not ``x-queue-type``,
#: as the first difference with a classic queue.
_QUORUM_ONLY = frozenset({"x-queue-type", "x-overflow", "x-dead-letter-strategy", "x-delivery-limit"})


def existing_type(argument: str, wanted: QueueType, reply_text: str) -> QueueType | None:
    """The type of the queue RabbitMQ holds, from its refusal of our declaration, if it tells."""
    if argument == "x-queue-type":
        return "quorum" if re.search(r"current is (the value )?'quorum'", reply_text) else "classic"
    if argument in _QUORUM_ONLY:
        if wanted == "quorum" and reply_text.rstrip().endswith("current is none"):
            return "classic"
        if wanted == "classic" and "received none" in reply_text:
            return "quorum"
    return None


def mismatch(name: str, argument: str, wanted: QueueType, reply_text: str) -> QueueMismatch:
    """The error for a queue RabbitMQ holds with other arguments than ours."""
    current = existing_type(argument, wanted, reply_text)
    if current is not None and current != wanted:
        return QueueMismatch(
            f"queue {name!r} exists in RabbitMQ as a {current} queue but this broker declares it {wanted} "
            f"(RabbitMQ: {reply_text}); either keep it {current} with queue_types={{{q_name(name)!r}: {current!r}}} "
            f"on every broker and relay, or move it: stop the relays, let the workers drain it, delete it "
            f"(rabbitmqctl delete_queue), then start the new code; sends wait in the outbox meanwhile ({MOVE_DOCS})"
        )
    return QueueMismatch(
        f"queue {name!r} exists in RabbitMQ with another {argument!r} than this broker declares ({wanted} queue; "
        f"RabbitMQ: {reply_text}); give every broker and relay the settings it was declared with (max_priority, "
        f"delivery_limit), or drain and delete it so it is declared again ({MOVE_DOCS})"
    )
