"""What concurrency per key and order per key share: the key of a message, parking, waking, a heartbeat.

Both park a message that cannot run now as a row in Postgres (its encoded body) and send it
again, in the transaction that frees its key, when its turn comes: no worker thread waits and
nothing spins through the broker's queue.  Both hold a lease per running job that a heartbeat
renews; a killed worker's lease lapses and the same heartbeat, in every live worker, sweeps it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name
from dramatiq.message import Message

from .. import schema as _schema
from .._util import first_line
from ..errors import ActorOptionError, DatabaseUnavailable

__all__ = [
    "MAX_KEY_CHARS",
    "Heartbeat",
    "check_key_option",
    "derive_key",
    "new_owner",
    "not_migrated",
    "parked_body",
    "send_woken",
]

logger = logging.getLogger("dramatiq_reliable.flow")

#: Keys are built from IDs and plain text; a longer one is a bug in the key function.
MAX_KEY_CHARS = 1000


def new_owner() -> str:
    """This process, as lease rows name it (host, pid and a random part for a reused pid)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def check_key_option(actor: dramatiq.Actor[Any, Any], option: str, example: str) -> Callable[..., Any] | None:
    """The actor's key function ``option``, or ``None``; anything else but a callable fails at declaration."""
    derive = actor.options.get(option)
    if derive is not None and not callable(derive):
        raise ActorOptionError(
            f"actor {actor.actor_name!r}: {option} must be a callable taking the actor's arguments, got {derive!r}; "
            f"write e.g. {option}={example}"
        )
    return derive


def derive_key(derive: Callable[..., Any], option: str, message: Message[Any] | MessageProxy) -> str:
    """The key ``derive`` gives for ``message``'s arguments.

    Fails closed: a key function that raises or gives no usable key raises
    :class:`ActorOptionError` naming the actor, and the job must not run unprotected.
    """
    try:
        key: object = derive(*message.args, **message.kwargs)
    except Exception as error:
        raise ActorOptionError(
            f"message {message.message_id!r} of actor {message.actor_name!r}: {option} raised "
            f"{type(error).__name__}: {first_line(error)}; the job was not run, fix the key function or the arguments"
        ) from error
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS or "\x00" in key:
        raise ActorOptionError(
            f"message {message.message_id!r} of actor {message.actor_name!r}: {option} gave {key!r}, not a non-empty "
            f"string of at most {MAX_KEY_CHARS} characters; the job was not run, build keys from IDs and plain text"
        )
    return key


def not_migrated(error: BaseException, schema: str, feature: str) -> DatabaseUnavailable | None:
    """The error to raise when ``error`` says migration 14 was not applied, else ``None``.

    A ``DatabaseUnavailable``, not a ``SchemaNotReady``: Dramatiq swallows anything but a
    ``MiddlewareError`` raised in a hook, and the job would run (or be sent) unordered.
    """
    if not isinstance(error, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction)):
        return None
    return DatabaseUnavailable(
        f"{feature} needs schema {schema!r} at version {_schema.ORDER_CONCURRENCY_VERSION} "
        f"({type(error).__name__}: {first_line(error)}); the job was neither run nor sent, "
        f"run {_schema.migrate_command(schema)!r}"
    )


def parked_body(message: MessageProxy) -> bytes:
    """The message as it is sent again when woken: to its queue itself, with no eta left from a delay."""
    original = message._message  # the proxy's Message (Dramatiq keeps it there)
    options = {name: value for name, value in original.options.items() if name != "eta"}
    return Message(
        queue_name=q_name(original.queue_name),
        actor_name=original.actor_name,
        args=original.args,
        kwargs=original.kwargs,
        options=options,
        message_id=original.message_id,
        message_timestamp=original.message_timestamp,
    ).encode()


def send_woken(broker: Broker, rows: Iterable[dict[str, Any]]) -> int:
    """Send the parked messages in ``rows`` again; call it bound to the transaction that woke them,
    so that on a Postgres-backed broker the key is freed and the next job sent in one commit."""
    sent = 0
    for row in rows:
        if row["body"] is None:
            continue
        broker.enqueue(Message.decode(bytes(row["body"])))
        sent += 1
    return sent


class Heartbeat:
    """A daemon thread calling ``beat`` every ``interval_ms`` until :meth:`stop`; a failed beat is logged
    and the next one tries again (leases lapse only if every beat in ``lease_ms`` fails)."""

    def __init__(self, name: str, interval_ms: int, beat: Callable[[], None]) -> None:
        self._name = name
        self._interval_s = interval_ms / 1000
        self._beat = beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._beat()
            except Exception:
                logger.warning(
                    "%s heartbeat failed; leases lapse unless the next one succeeds", self._name, exc_info=True
                )
