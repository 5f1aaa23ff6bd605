"""Recovering dead letters that exist only in RabbitMQ's ``.XQ`` queues (a capture that failed).

When Postgres is down for longer than ``DeadLetters(timeout_ms=...)``, a dying message is still
nacked into its queue's ``.XQ`` and logged CRITICAL; :func:`import_xq` later moves such messages
into the ``dead_letters`` table, where ``replay`` reaches them.  It is idempotent by message id:
a message whose death already has a row is only acked off ``.XQ``, never stored twice, so it is
safe to re-run and to run after a capture that did succeed.

Each message is acked only after its row committed; a crash in between leaves it in ``.XQ`` and
the next run finds the row and acks it.  A body that is not a Dramatiq message is left in
``.XQ`` (counted as ``unreadable``): there is nothing a replay could send.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dramatiq.common import q_name, xq_name
from dramatiq.message import Message

from ..errors import ConfigurationError
from .analysis import _describe_imported, _replayed_from
from .protocol import DeadLetterStore

__all__ = ["ImportResult", "import_xq", "peek_xq"]

logger = logging.getLogger("dramatiq_reliable.dead_letters")


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What an import did, per canonical queue: ``imported`` rows written, ``already_stored``
    messages acked off ``.XQ`` because their death had a row, ``unreadable`` bodies left there."""

    imported: Mapping[str, int]
    already_stored: Mapping[str, int]
    unreadable: Mapping[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "imported": dict(self.imported),
            "already_stored": dict(self.already_stored),
            "unreadable": dict(self.unreadable),
        }


def import_xq(store: DeadLetterStore, *, parameters: Any, queues: Sequence[str]) -> ImportResult:
    """Move every message of each queue's ``.XQ`` into ``store``; see the module docstring.

    ``parameters``: pika connection parameters (or a list of them).  Messages that arrive in
    ``.XQ`` during the import are left for the next run: each queue is read up to the count it
    had when the import reached it.
    """
    import pika
    import pika.exceptions

    names = [q_name(name) for name in queues]
    if not names or any(not isinstance(name, str) or not name for name in names):
        raise ConfigurationError(f"queues must name at least one queue, got {list(queues)!r}; pass e.g. ['default']")
    imported: dict[str, int] = {}
    already: dict[str, int] = {}
    unreadable: dict[str, int] = {}
    connection = pika.BlockingConnection(parameters)
    try:
        for name in dict.fromkeys(names):
            imported[name] = already[name] = unreadable[name] = 0
            channel = connection.channel()
            try:
                try:
                    count = channel.queue_declare(queue=xq_name(name), passive=True).method.message_count
                except pika.exceptions.ChannelClosedByBroker as error:
                    if error.reply_code != 404:
                        raise
                    continue  # no .XQ: nothing ever died there
                for _ in range(count):
                    method, _properties, body = channel.basic_get(queue=xq_name(name), auto_ack=False)
                    if method is None:
                        break
                    try:
                        data = Message.decode(body).asdict()
                    except Exception:
                        # Held unacked until the channel closes, then back in .XQ: not fetched again.
                        unreadable[name] += 1
                        continue
                    stored_id = store.save_imported(_describe_imported(data), after_id=_replayed_from(data))
                    if stored_id is None:
                        already[name] += 1
                    else:
                        imported[name] += 1
                    channel.basic_ack(method.delivery_tag)
            finally:
                with contextlib.suppress(Exception):
                    if channel.is_open:
                        channel.close()
    finally:
        with contextlib.suppress(Exception):
            connection.close()
    return ImportResult(imported, already, unreadable)


def peek_xq(parameters: Any, queue: str, *, limit: int) -> tuple[list[tuple[str, int]], int]:
    """The deaths held in ``queue``'s ``.XQ`` without taking them: ``(message id, dead letter it
    was replayed from)`` of up to ``limit`` messages, and how many bodies were unreadable.

    Messages are fetched unacked and go back when the channel closes (RabbitMQ marks them
    redelivered; nothing reads ``.XQ`` but this module, so nothing else sees the difference).
    """
    import pika
    import pika.exceptions

    keys: list[tuple[str, int]] = []
    unreadable = 0
    connection = pika.BlockingConnection(parameters)
    try:
        channel = connection.channel()
        try:
            count = channel.queue_declare(queue=xq_name(q_name(queue)), passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as error:
            if error.reply_code != 404:
                raise
            return keys, 0
        for _ in range(min(count, limit)):
            method, _properties, body = channel.basic_get(queue=xq_name(q_name(queue)), auto_ack=False)
            if method is None:
                break
            try:
                data = Message.decode(body).asdict()
            except Exception:
                unreadable += 1
                continue
            keys.append((str(data.get("message_id")), _replayed_from(data)))
    finally:
        with contextlib.suppress(Exception):
            connection.close()  # unacked messages go back to .XQ
    return keys, unreadable
