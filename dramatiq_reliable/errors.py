"""The errors dramatiq-reliable raises, and the one users raise to stop retries.

Every error here says what went wrong and ends with the fix.  The tree::

    dramatiq.DramatiqError
     └── ReliableError                      base of everything below
          ├── ConfigurationError            a bad argument; raised at construction or call time
          ├── SchemaNotReady                tables missing or behind; run 'dramatiq-reliable migrate'
          ├── PayloadError                  a message that cannot be encoded, raised by send()
          ├── NotBound                      send() with no bound transaction under on_unbound="error"
          ├── OutboxWriteError              the outbox insert failed; the message was not stored
          ├── Unrecoverable                 raised by an actor: never retried, dead-lettered at once
          ├── IdempotencyKeyError           (idempotency.py) a job key that cannot be computed
          ├── IdempotencyConflict           (idempotency.py) a key reused with other arguments
          └── NoCurrentJob                  (idempotency.py) job helpers called outside a job

    dramatiq.middleware.MiddlewareError
     ├── DatabaseUnavailable                raised from a before-hook so the actor does not run
     └── IdempotencyOptionError             (idempotency.py) a bad actor option, raised at decoration

The two idempotency errors that stop a message also subclass Dramatiq's ``SkipMessage``.

The driver error, where there is one, is kept as ``__cause__``.
"""

from __future__ import annotations

from dramatiq.errors import DramatiqError
from dramatiq.middleware import MiddlewareError

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "NotBound",
    "OutboxWriteError",
    "PayloadError",
    "ReliableError",
    "SchemaNotReady",
    "Unrecoverable",
]


class ReliableError(DramatiqError):
    """Base class of every error dramatiq-reliable raises."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.message: str = message

    def __str__(self) -> str:
        return str(self.message)


class ConfigurationError(ReliableError, ValueError):
    """An argument has a value that cannot work; the message names the argument and the fix."""


class SchemaNotReady(ReliableError):
    """The tables are missing or older than this version of the package expects."""


class PayloadError(ReliableError, TypeError):
    """A message cannot be encoded.  Raised by ``send()`` before anything is written."""


class NotBound(ReliableError):
    """``send()`` was called outside a bound transaction and the broker forbids that."""


class OutboxWriteError(ReliableError):
    """The outbox insert failed; the message was not stored and ``send()`` did not succeed."""


class Unrecoverable(ReliableError):
    """Raise this from an actor when retrying can never help.

    The message is not retried, whatever ``max_retries`` says, and goes straight to the
    dead letters with this error's message.

    >>> raise Unrecoverable(f"user {user_id!r} does not exist")  # doctest: +SKIP
    """


class DatabaseUnavailable(MiddlewareError):
    """Postgres could not be reached from a before-hook.

    A ``MiddlewareError`` is the only kind of exception Dramatiq lets out of a before-hook,
    so raising this one is what keeps the actor from running: the middleware fails closed.
    """
