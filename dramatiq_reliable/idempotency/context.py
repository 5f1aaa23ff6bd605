"""The running job: its identity, the connection of its transaction, and the helpers an actor calls."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import psycopg
from dramatiq.broker import MessageProxy

from ..errors import NoCurrentJob
from .keys import derive_external_key
from .protocol import IdempotencyStore

if TYPE_CHECKING:
    from ..database import Database

__all__ = ["Job", "JobConnections", "Mode", "PooledJobConnections", "current_job", "external_key", "job_connection"]

Mode = Literal["transactional", "record", "off"]
MODES: tuple[Mode, ...] = ("transactional", "record", "off")


# -- where the job's connection comes from ------------------------------------------------------


@runtime_checkable
class JobConnections(Protocol):
    """Where a transactional job's connection comes from, and where it goes back after the job.

    The middleware begins the job's transaction on the connection :meth:`acquire` returns,
    claims the key on it, binds it for ``send()`` while the actor runs, commits or rolls it
    back, and only then calls :meth:`release`.  The default, :class:`PooledJobConnections`,
    borrows from the broker's pool; ``dramatiq_reliable.django`` hands out Django's own
    connection of the worker thread instead, so ORM writes commit with the key.
    """

    def acquire(self, database: Database, timeout_s: float) -> psycopg.Connection[Any]:
        """A connection to ``database`` with no transaction in progress, within ``timeout_s``."""
        ...

    def release(self, conn: psycopg.Connection[Any], *, database: Database, committed: bool) -> None:
        """Take back ``conn``, whose transaction was just committed (``committed``) or rolled back."""
        ...


class PooledJobConnections:
    """The default :class:`JobConnections`: a connection of ``database``'s pool per job."""

    def __init__(self) -> None:
        self._opened: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self, database: Database, timeout_s: float) -> psycopg.Connection[Any]:
        # getconn/putconn, as the job spans two hooks where a ``with`` block cannot.
        if id(database) not in self._opened:
            database.open()  # a pool the Database created lazily
            with self._lock:
                self._opened.add(id(database))
        conn: psycopg.Connection[Any] = database.pool.getconn(timeout=timeout_s)
        return conn

    def release(self, conn: psycopg.Connection[Any], *, database: Database, committed: bool) -> None:
        database.pool.putconn(conn)


# -- the job ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """The idempotency identity of one message: which key it runs under, and how."""

    actor_name: str
    key: str
    mode: Mode
    message_id: str

    def external_key(self, step: str) -> str:
        """A key for an external API call made by this job, the same on every run of the job."""
        return derive_external_key(self.actor_name, self.key, step)


@dataclasses.dataclass(eq=False)
class Running:
    """What the middleware holds between the before- and after-hooks of one message."""

    job: Job
    message: MessageProxy
    payload_hash: bytes
    retention_s: float
    token: contextvars.Token[Running | None] | None = None
    conn: psycopg.Connection[Any] | None = None
    # gives ``conn`` back once its transaction ended (True: it committed)
    release: Callable[[psycopg.Connection[Any], bool], None] | None = None
    binding: contextlib.AbstractContextManager[Any] | None = None
    restore_autocommit: bool = False
    # the schema of the job's key, so helpers on the job connection (checkpoints) use the same one
    schema: str | None = None
    # record mode: where the key is looked up before the run and recorded after it
    store: IdempotencyStore | None = None
    # complete statements (values inlined) sent with the COMMIT, in its round trip: send_with_commit()
    with_commit: list[bytes] = dataclasses.field(default_factory=list)


# Before- and after-hooks of one message run in the same worker thread and context, so a
# context variable carries the job from one to the other and is visible to the actor.
current_running: contextvars.ContextVar[Running | None] = contextvars.ContextVar(
    "dramatiq_reliable_idempotency_job", default=None
)


#: What a middleware ordered before ``Idempotency`` asks to run first in the job's transaction:
#: called with the job connection right after the key is claimed; it returns ``None`` to let the
#: actor run, or a callable that ``Idempotency`` calls once that transaction is rolled back and
#: its connection returned (it settles the message and raises ``SkipMessage`` or another
#: ``MiddlewareError``).
InTransaction = Callable[[psycopg.Connection[Any]], Callable[[], None] | None]

# Set by the before-hook of such a middleware, taken (and cleared) by Idempotency's before-hook
# of the same message on the same thread.
pending_in_transaction: contextvars.ContextVar[InTransaction | None] = contextvars.ContextVar(
    "dramatiq_reliable_in_job_transaction", default=None
)


def send_with_commit(statement: bytes) -> bool:
    """Run ``statement`` (complete SQL, its values inlined) in the running job's transaction, just
    before its COMMIT and in the same round trip; ``False`` when no transactional job runs here.

    Internal: for middleware whose last write of a job must commit with it (a batch child's
    count), so it costs no round trip of its own.  A failing statement fails the commit, which
    the middleware handles as any failed commit (the job is retried); a job that raised rolls
    back and the statement never runs.
    """
    running = current_running.get()
    if running is None or running.conn is None or running.job.mode != "transactional":
        return False
    running.with_commit.append(statement)
    return True


def current_job() -> Job:
    """The job the calling actor is running as; raises :class:`NoCurrentJob` outside one."""
    running = current_running.get()
    if running is None:
        raise NoCurrentJob(
            "current_job() was called outside a job run by the Idempotency middleware; call it from an "
            "actor whose idempotency mode is 'transactional' or 'record'"
        )
    return running.job


def job_connection() -> psycopg.Connection[Any]:
    """The connection of the running job's transaction (transactional mode).

    Write on it and the writes commit with the job's key or not at all.  Do not commit or roll
    it back yourself; ``with conn.transaction():`` inside the actor makes a savepoint, which is fine.
    """
    running = current_running.get()
    if running is None or running.conn is None:
        where = "outside a job" if running is None else f"in a job of mode {running.job.mode!r}"
        raise NoCurrentJob(
            f"job_connection() was called {where}; the job connection exists only while an actor with "
            "idempotency='transactional' runs under the Idempotency middleware"
        )
    return running.conn


def external_key(step: str) -> str:
    """A deterministic idempotency key for one external call of the running job.

    Derived from the actor, the job key and ``step`` (never random), so every retry and every
    redelivery of the job sends the same key and the provider can recognise the repeat.

    >>> stripe.PaymentIntent.create(..., idempotency_key=external_key("charge"))   # doctest: +SKIP
    """
    return current_job().external_key(step)
