"""The errors dramatiq-reliable raises, and the one users raise to stop retries.

Every error here says what went wrong and ends with the fix, and every one is a
:class:`ReliableError`, so ``except dramatiq_reliable.ReliableError`` catches all of them.  The tree::

    dramatiq.DramatiqError
     └── ReliableError                  base of everything below
          ├── ConfigurationError        (also ValueError) a bad argument, at construction or call time
          │    ├── ActorOptionError     (also MiddlewareError) a bad actor option, at decoration time
          │    └── TargetUnknown        the schema cannot tell whether messages go to the outbox or the queue table
          ├── SchemaNotReady            tables missing or behind; run 'dramatiq-reliable migrate'
          ├── PayloadError              (also TypeError) a message send() cannot encode or accept
          ├── NotBound                  send() with no usable transaction: none under on_unbound="error", or one it must not join
          ├── OutboxWriteError          the outbox insert failed; the message was not stored
          ├── BrokerUnavailable         RabbitMQ unreachable while publishing; nothing was marked sent
          ├── QueueMismatch             a queue exists in RabbitMQ with another type or arguments than declared
          ├── DeliveryLimitReached      a message delivered delivery_limit times without an ack: not run again
          ├── DatabaseUnavailable       (also MiddlewareError) Postgres unreachable in a before-hook
          ├── MiddlewareFailed          (also MiddlewareError) an unexpected error in a before-hook of ours
          ├── Unrecoverable             raised by an actor: never retried, dead-lettered at once
          ├── JobCancelled              raised at a cancel checkpoint: acked, never retried nor dead-lettered
          ├── IdempotencyKeyError       (also SkipMessage) a job key that cannot be computed
          ├── IdempotencyConflict       (also SkipMessage) a key reused with other arguments
          ├── NoCurrentJob              (also LookupError) job helpers called outside a job
          ├── ScheduleNotFound          (also LookupError) no schedule of that name; see 'schedules list'
          ├── JobNotFound               (also LookupError) no table knows that message id or key
          ├── ScheduleDisabled          a schedule removed from code cannot be triggered
          ├── CheckpointError           (also ValueError) a checkpoint misused: wrong type, moved backwards
          └── JobCommitFailed           the actor returned but its transaction did not commit
               └── CommitOutcomeUnknown the connection broke during COMMIT: it may have landed

Dramatiq lets only a ``MiddlewareError`` out of a before-hook (anything else is logged and the
actor runs anyway), so the errors that must stop a message are also ``MiddlewareError``s:
``SkipMessage`` is one.

Each class reports ``dramatiq_reliable`` as its module, so the type names stored with dead
letters (``dramatiq_reliable.Unrecoverable``) and the fingerprints built from them do not change
when code moves between internal modules.  The driver error, where there is one, is kept as
``__cause__``.
"""

from __future__ import annotations

from dramatiq.errors import DramatiqError
from dramatiq.middleware import MiddlewareError, SkipMessage

__all__ = [
    "ActorOptionError",
    "BrokerUnavailable",
    "CheckpointError",
    "CommitOutcomeUnknown",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DeliveryLimitReached",
    "IdempotencyConflict",
    "IdempotencyKeyError",
    "JobCancelled",
    "JobCommitFailed",
    "JobNotFound",
    "MiddlewareFailed",
    "NoCurrentJob",
    "NotBound",
    "OutboxWriteError",
    "PayloadError",
    "QueueMismatch",
    "ReliableError",
    "ScheduleDisabled",
    "ScheduleNotFound",
    "SchemaNotReady",
    "TargetUnknown",
    "Unrecoverable",
]

_PUBLIC_MODULE = "dramatiq_reliable"


class ReliableError(DramatiqError):
    """Base class of every error dramatiq-reliable raises."""

    __module__ = _PUBLIC_MODULE

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.message: str = message

    def __str__(self) -> str:
        return str(self.message)


class ConfigurationError(ReliableError, ValueError):
    """An argument has a value that cannot work; the message names the argument and the fix."""

    __module__ = _PUBLIC_MODULE


class ActorOptionError(ConfigurationError, MiddlewareError):
    """A bad actor option of ours (``idempotency*``, ``retry_*``), or a middleware with no database.

    A ``MiddlewareError`` so that Dramatiq lets it out of ``before_declare_actor``: the
    decorator raises at import time instead of the message failing at run time.
    """

    __module__ = _PUBLIC_MODULE


class SchemaNotReady(ReliableError):
    """The tables are missing or older than this version of the package expects."""

    __module__ = _PUBLIC_MODULE


class TargetUnknown(ConfigurationError):
    """Where a message goes (the outbox or the Postgres queue table) was not given and the schema cannot tell."""

    __module__ = _PUBLIC_MODULE


class PayloadError(ReliableError, TypeError):
    """A message ``send()`` cannot accept.  Raised before anything is written."""

    __module__ = _PUBLIC_MODULE


class NotBound(ReliableError):
    """``send()`` found no transaction it may write in.

    Raised outside any transaction when the broker has ``on_unbound="error"``, and always when the
    transaction it would join is unusable (failed, autocommit, another database) or is async.
    """

    __module__ = _PUBLIC_MODULE


class OutboxWriteError(ReliableError):
    """The outbox insert failed; the message was not stored and ``send()`` did not succeed."""

    __module__ = _PUBLIC_MODULE


class BrokerUnavailable(ReliableError):
    """RabbitMQ cannot be reached or the connection broke; no outcome is known for the batch.

    The relay keeps every row of such a batch and tries again later.
    """

    __module__ = _PUBLIC_MODULE


class QueueMismatch(ReliableError):
    """A queue exists in RabbitMQ with another type (classic, quorum) or other arguments than declared.

    RabbitMQ refuses such a declaration with ``PRECONDITION_FAILED`` and closes the channel; this
    error names the queue, both types and the way to move it.  Workers log it and retry their
    consumer; the relay keeps the queue's rows in the outbox with it as their ``last_error``.
    """

    __module__ = _PUBLIC_MODULE


class DeliveryLimitReached(ReliableError):
    """A message was delivered ``delivery_limit`` times without being acked: it is not run again.

    On a quorum queue RabbitMQ counts deliveries (``x-delivery-count``); a count that high means
    each run ended with the worker dying or losing its connection (a segfault, the OOM killer, a
    ``SIGKILL``).  The worker stores the message in ``dead_letters`` with the reason
    ``delivery_limit`` instead of running it again.
    """

    __module__ = _PUBLIC_MODULE

    def __init__(self, message: str, *, deliveries: int = 0) -> None:
        super().__init__(message)
        self.deliveries = deliveries


class DatabaseUnavailable(ReliableError, MiddlewareError):
    """Postgres could not be reached from a before-hook.

    A ``MiddlewareError`` is the only kind of exception Dramatiq lets out of a before-hook,
    so raising this one is what keeps the actor from running: the middleware fails closed.
    """

    __module__ = _PUBLIC_MODULE


class MiddlewareFailed(ReliableError, MiddlewareError):
    """One of our before-hooks hit an error it did not expect; the actor did not run.

    Dramatiq logs and swallows anything but a ``MiddlewareError`` raised by a before-hook and
    then runs the actor anyway, unprotected (a duplicate would run twice).  Our hooks turn an
    unexpected error into this one instead, so the message fails closed: it is retried like a
    failed job (and dead-lettered when the retries run out), with the original error as
    ``__cause__``.
    """

    __module__ = _PUBLIC_MODULE


class Unrecoverable(ReliableError):
    """Raise this from an actor when retrying can never help.

    The message is not retried, whatever ``max_retries`` says, and goes straight to the
    dead letters with this error's message.

    >>> raise Unrecoverable(f"user {user_id!r} does not exist")  # doctest: +SKIP
    """

    __module__ = _PUBLIC_MODULE


class JobCancelled(ReliableError):
    """The running job was cancelled (``dramatiq-reliable jobs cancel``) and stops here.

    Raised by :func:`~dramatiq_reliable.check_cancelled` (or by the actor itself after
    :func:`~dramatiq_reliable.is_cancelled` said so).  ``ClassifiedRetries`` treats it as final
    without failing the message: it is acked, never retried and never dead-lettered, and the
    job's transaction (under transactional ``Idempotency``) rolls back like any exception's.
    """

    __module__ = _PUBLIC_MODULE


class IdempotencyKeyError(ReliableError, SkipMessage):
    """The job key cannot be computed, or a message option names an invalid one.

    From a worker it fails the message without running the actor (a ``SkipMessage`` after
    ``message.fail()``, so it is dead-lettered, not acked).  From ``send()`` it refuses the send.
    """

    __module__ = _PUBLIC_MODULE


class IdempotencyConflict(ReliableError, SkipMessage):
    """A key that already ran is reused with different arguments.

    Skipping would silently drop the second job, running it would defeat the key: the message
    fails without running the actor and is dead-lettered, so someone looks at the key function.
    """

    __module__ = _PUBLIC_MODULE


class NoCurrentJob(ReliableError, LookupError):
    """:func:`~dramatiq_reliable.job_connection`, ``current_job`` or ``external_key`` used outside a job."""

    __module__ = _PUBLIC_MODULE


class CheckpointError(ReliableError, ValueError):
    """A checkpoint used wrongly: a watermark of the wrong type, or one that would move backwards.

    Raised before anything is written; the job's transaction is left as it was, so raising it
    out of the actor rolls the job back and the window is offered again on the next run.
    """

    __module__ = _PUBLIC_MODULE


class JobCommitFailed(ReliableError):
    """The actor returned but its transaction (with its key) did not commit.

    Recorded on the message so its dead letter says why it failed although the actor succeeded.
    """

    __module__ = _PUBLIC_MODULE


class CommitOutcomeUnknown(JobCommitFailed):
    """The connection broke during the job's ``COMMIT``: the transaction may or may not have landed.

    Not a failure of the job: its processed key makes a retry safe either way (the retry finds
    the key and skips if the commit did land).  Distinct so that retries, dead letters and
    metrics can tell an unknown outcome from a commit the server refused.
    """

    __module__ = _PUBLIC_MODULE


class ScheduleNotFound(ReliableError, LookupError):
    """A schedule asked for by name is not stored; the message says how to see the names."""

    __module__ = _PUBLIC_MODULE


class JobNotFound(ReliableError, LookupError):
    """No table knows a job id (message id or idempotency key): mistyped, or purged by retention."""

    __module__ = _PUBLIC_MODULE


class ScheduleDisabled(ReliableError):
    """A schedule no longer declared in code cannot be triggered; the message names the fix."""

    __module__ = _PUBLIC_MODULE
