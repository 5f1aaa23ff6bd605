"""What concurrency per key and order per key share: the key of a message, parking, waking, a heartbeat.

Both park a message that cannot run now as a row in Postgres (its encoded body) and send it
again, in the statement that frees its key, when its turn comes: no worker thread waits and
nothing spins through the broker's queue.  The resend is a row written by SQL into the table the
broker sends to (``queue`` or ``outbox``), as a replay of dead letters is, so a release is one
autocommit statement.  Both hold a lease per running job that a heartbeat
renews; a killed worker's lease lapses and the same heartbeat, in every live worker, sweeps it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

import dramatiq
import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.common import q_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware, SkipMessage
from psycopg import sql
from psycopg.rows import dict_row

from .. import _sql
from .. import schema as _schema
from .._checks import check_ms
from .._util import first_line
from ..backing import backing_of
from ..database import Database, DatabaseLike
from ..errors import ActorOptionError, DatabaseUnavailable, MiddlewareFailed
from ..idempotency._connections import autocommit  # the pool's connections keep their mode
from ..outbox.wake import channel

__all__ = [
    "DEFAULT_LEASE_MS",
    "MAX_KEY_CHARS",
    "Heartbeat",
    "Held",
    "KeyedMiddleware",
    "check_key_option",
    "derive_key",
    "fail_closed",
    "new_owner",
    "not_migrated",
    "one_statement",
    "parked_body",
    "parked_priority",
    "parked_queue",
    "resend_to",
]

logger = logging.getLogger("dramatiq_reliable.flow")


class _Lease(Protocol):
    key: str
    token: int


L = TypeVar("L", bound=_Lease)

#: How long a lease outlives a holder that stopped renewing it (a killed worker).
DEFAULT_LEASE_MS = 30_000
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


def parked_queue(message: MessageProxy) -> str:
    """The queue a parked message goes back to: the queue itself, never its delay queue."""
    return q_name(message.queue_name)


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
    """The message as it is sent again when woken: to its queue itself (``parked_queue``), with no eta
    left from a delay."""
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


def parked_priority(message: MessageProxy) -> int | None:
    """The broker priority a parked message is sent again with when woken (the send path checked it)."""
    priority = message.options.get("broker_priority")
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else None


def resend_to(schema: str, sends_to: str) -> dict[str, str]:
    """The parameters telling the release and sweep functions where a woken message goes: the
    table the broker sends to, and the channel that wakes the relays when it is the outbox."""
    return {"target": sends_to, "channel": channel(schema)}


def one_statement(database: Database, query: sql.Composed | bytes, params: dict[str, Any]) -> dict[str, Any]:
    """Run one function call in autocommit on a pooled connection and return its row (by name)."""
    with database.connection() as conn, autocommit(conn):
        row = conn.cursor(row_factory=dict_row).execute(query, params).fetchone()
    assert row is not None  # a SELECT of a function: always one row
    return row


class Held(Generic[L]):
    """The leases this process holds, for the heartbeat to renew: one per worker thread, and those
    taken for a message before a worker thread has it (held under the message's id)."""

    def __init__(self) -> None:
        self._held: dict[int | str, L] = {}
        self._lock = threading.Lock()

    def hold(self, lease: L, *, message_id: str | None = None) -> None:
        with self._lock:
            self._held[threading.get_ident() if message_id is None else message_id] = lease

    def drop(self, *, message_id: str | None = None) -> None:
        with self._lock:
            self._held.pop(threading.get_ident() if message_id is None else message_id, None)

    def renewal(self, lease_ms: int) -> dict[str, Any] | None:
        """The parameters of the renew statement (``keys``, ``tokens``), or ``None`` when nothing is held."""
        with self._lock:
            held = list(self._held.values())
        if not held:
            return None
        return {"lease_ms": lease_ms, "keys": [h.key for h in held], "tokens": [h.token for h in held]}


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


def fail_closed(message: MessageProxy, error: ActorOptionError) -> NoReturn:
    """A key that cannot be computed will not be computable on a retry: dead-letter the message unrun."""
    logger.error("%s", error)
    message.fail()
    raise SkipMessage(str(error)) from error


class KeyedMiddleware(Middleware, Generic[L]):
    """What ``ConcurrencyLimit`` and ``OrderedKeys`` share: where their tables are, the leases this
    process holds, the heartbeat that renews them and sweeps the lapsed ones, and how a take and a
    release talk to Postgres."""

    #: The middleware's name in errors, the actor option that enables it, the renew query.
    label: ClassVar[str]
    option: ClassVar[str]
    renew_query: ClassVar[str]

    def __init__(
        self, *, database: DatabaseLike | None = None, schema: str | None = None, lease_ms: int = DEFAULT_LEASE_MS
    ) -> None:
        check_ms("lease_ms", lease_ms, minimum=300, fix="e.g. lease_ms=30_000, longer than a GC pause or a failover")
        self.schema: str | None = None if schema is None else _sql.validate_schema(schema)
        self.lease_ms = lease_ms
        self.owner = new_owner()
        self._own_database = Database.of(database) if database is not None else None
        self._target: tuple[Database, str, dict[str, str]] | None = None
        self._held: Held[L] = Held()
        self._heartbeat: Heartbeat | None = None

    def database_for(self, broker: Broker) -> tuple[Database, str, dict[str, str]]:
        """The database and schema of ``broker``'s tables, and where a woken message is sent."""
        if self._target is None:
            backing = backing_of(
                broker, needed_by=self.label, database=self._own_database, schema=self.schema, error=ActorOptionError
            )
            self._target = (backing.database, backing.schema, resend_to(backing.schema, backing.sends_to))
        return self._target

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        if any(broker.get_actor(name).options.get(self.option) for name in broker.get_declared_actors()):
            name = f"dramatiq-reliable-{self.label}"
            self._heartbeat = Heartbeat(name, self.lease_ms // 3, lambda: self._beat(broker))
            self._heartbeat.start()

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _beat(self, broker: Broker) -> None:
        self.renew(broker)
        self.sweep(broker)

    def renew(self, broker: Broker) -> None:
        """Push back the expiry of every lease this process holds (the heartbeat calls it)."""
        params = self._held.renewal(self.lease_ms)
        if params is not None:
            database, schema, _ = self.database_for(broker)
            with database.connection() as conn, autocommit(conn):
                conn.execute(_sql.query(self.renew_query, schema), params)

    def sweep(self, broker: Broker) -> int:
        """Hand on what killed workers held; returns how many messages were sent again."""
        raise NotImplementedError

    def _take(self, broker: Broker, query: str, params: dict[str, Any], what: str) -> dict[str, Any]:
        """Run a take; any failure stops the actor with a ``MiddlewareError`` (the only kind Dramatiq
        lets out of a before-hook: anything else and the job would run unprotected)."""
        database, schema, _ = self.database_for(broker)
        try:
            return self._run_take(database, schema, query, params)
        except (psycopg.Error, OSError, TimeoutError) as error:
            raise not_migrated(error, schema, self.label) or DatabaseUnavailable(
                f"{self.label} could not {what}: {type(error).__name__}: {first_line(error)}; the actor did not run "
                "and the message will be retried once Postgres answers"
            ) from error
        except Exception as error:
            raise MiddlewareFailed(
                f"{self.label} could not {what}: {type(error).__name__}: {first_line(error)}; the actor did not run, "
                "report this as a bug"
            ) from error

    def _run_take(self, database: Database, schema: str, query: str, params: dict[str, Any]) -> dict[str, Any]:
        """The take's statement, and its row (a subclass may write several takes in one)."""
        return one_statement(database, _sql.rendered(query, schema), params)

    def _free(self, broker: Broker, query: str, params: dict[str, Any], what: str) -> None:
        """Run a release; a failure only leaves the lease to lapse, and the sweep hands it on."""
        self._held.drop()
        database, schema, resend = self.database_for(broker)
        try:
            one_statement(database, _sql.rendered(query, schema), {**params, **resend})
        except Exception:
            logger.warning("could not free %s; it lapses after %d ms", what, self.lease_ms, exc_info=True)

    def _sweep(self, broker: Broker, query: str, params: dict[str, Any]) -> int:
        database, schema, resend = self.database_for(broker)
        return int(one_statement(database, _sql.query(query, schema), {**params, **resend})["woken"])
