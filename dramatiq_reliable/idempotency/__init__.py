"""Idempotency: one effect per message, with the processed key committed in the job's own transaction.

Delivery is at least once: a worker that dies after the work but before the ack, a relay that
republishes after a lost confirm, or a producer that sends twice all run a job again.  The
:class:`Idempotency` middleware gives every job a key and keeps the keys that ran in the
``processed_jobs`` table, so a second run is recognised and acked without running the actor.

* **transactional** (the default): before the actor runs, the middleware borrows a pooled
  connection, opens a transaction and inserts the key as its first statement; the connection is
  bound (:func:`~dramatiq_reliable.outbox.bind`) while the actor runs, so the actor's writes
  (through :func:`connection`) and its ``send()`` calls join that transaction.  It commits when
  the actor returns and rolls back when it raises: the key exists exactly when the effect does.
  A concurrent duplicate waits on the uncommitted key's row lock, then sees it and skips.
* **record**: for actors whose effect is outside Postgres.  The key is checked before the actor
  runs and recorded after it returned, in its own short transaction.  A crash between the effect
  and the record runs the job again, so pass :func:`external_key` to the provider.
* **off**: the middleware leaves the actor alone.

The key is the ``message_id`` (stable across retries, delay-queue moves and relay republishes)
unless the actor option ``idempotency_key`` derives a business key from the arguments, or the
message option ``idempotency_key`` names one.  Keys are namespaced by actor.  Reusing a key with
other arguments fails the message with :class:`IdempotencyConflict` instead of skipping it, and
a key that cannot be computed fails it with :class:`IdempotencyKeyError`: both are dead-lettered
without running the actor.  If Postgres cannot be reached for the check the middleware fails
closed: it raises :class:`~dramatiq_reliable.errors.DatabaseUnavailable`, the actor does not run
and the retry middleware retries the message.

>>> broker = OutboxBroker(url="amqp://localhost", database="postgresql://app@localhost/app")  # doctest: +SKIP
>>> broker.add_middleware(Idempotency(), before=Callbacks)     # before actors are declared  # doctest: +SKIP
>>> @dramatiq.actor(idempotency_key=lambda order_id: f"invoice-{order_id}")   # doctest: +SKIP
... def issue_invoice(order_id):
...     job_connection().execute("INSERT INTO invoices (order_id) VALUES (%s)", (order_id,))
"""

from __future__ import annotations

from ..errors import ActorOptionError, IdempotencyConflict, IdempotencyKeyError, JobCommitFailed, NoCurrentJob
from .async_job import AsyncJobConnection, job_connection_async
from .context import Job, JobConnections, Mode, PooledJobConnections, current_job, external_key, job_connection
from .events import (
    IdempotencyCommitFailed,
    IdempotencyDuplicateSkipped,
    IdempotencyKeyInvalid,
    IdempotencyKeyReused,
    IdempotencyKeysPurged,
    IdempotencyRecordFailed,
    IdempotencyUnavailable,
)
from .keys import payload_hash
from .middleware import Idempotency
from .protocol import IdempotencyStore, StoredKey
from .purge import make_purge_actor
from .store import PostgresIdempotencyStore, purge_expired

__all__ = [
    "ActorOptionError",
    "AsyncJobConnection",
    "Idempotency",
    "IdempotencyCommitFailed",
    "IdempotencyConflict",
    "IdempotencyDuplicateSkipped",
    "IdempotencyKeyError",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyReused",
    "IdempotencyKeysPurged",
    "IdempotencyRecordFailed",
    "IdempotencyStore",
    "IdempotencyUnavailable",
    "Job",
    "JobCommitFailed",
    "JobConnections",
    "Mode",
    "NoCurrentJob",
    "PooledJobConnections",
    "PostgresIdempotencyStore",
    "StoredKey",
    "current_job",
    "external_key",
    "job_connection",
    "job_connection_async",
    "make_purge_actor",
    "payload_hash",
    "purge_expired",
]
