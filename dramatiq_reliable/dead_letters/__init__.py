"""Dead letters: every message that failed for good, kept in Postgres with its error, replayable in one command.

Dramatiq rejects a message that fails for good, and RabbitMQ moves it to the queue's ``.XQ``
dead-letter queue: a body nobody reads, with the retry count and traceback of an earlier
attempt, gone after seven days.  :class:`DeadLetters` writes each of those messages to the
``dead_letters`` table instead, as the worker held it when it died: the whole message, the error
type and message, the full traceback of the last attempt, how many times the actor ran, why it
was not retried (retries exhausted, ``throws``, ``Unrecoverable``, age limit, time limit, unknown
actor), the HTTP status when there was one, first and last failure times, the worker host and
pid, and a fingerprint that groups a thousand failures from one bug into one row.

:class:`DeadLetterStore` reads and maintains that table: list and show, group by fingerprint,
replay through the outbox (the dead letter is marked in the same transaction as the outbox row,
so a replay is never lost and never doubled), discard, and purge past retention.  The
``dramatiq-reliable dead-letters`` command is a thin layer over it.

>>> broker = OutboxBroker(url=..., database=..., middleware=[..., DeadLetters(), ClassifiedRetries()])
... # doctest: +SKIP
>>> store = DeadLetterStore.from_broker(broker)                          # doctest: +SKIP
>>> store.replay(where=DeadLetterFilter(actor_name="send_receipt"))      # doctest: +SKIP
ReplayResult(replayed=12, too_old=0, problems={})

Every new dead letter is announced with ``NOTIFY`` on the channel ``"<schema>.dead_letters"``
(payload: JSON with ``id``, ``message_id``, ``queue_name``, ``actor_name``, ``error_type`` and
``fingerprint``) and passed to the ``on_dead_letter`` callable, so the person on call hears of it.
"""

from .analysis import Culprit, find_culprit, fingerprint, format_traceback
from .middleware import DeadLetters
from .records import (
    DEFAULT_REPLAY_MAX_AGE_MS,
    DEFAULT_RETENTION_MS,
    FIRST_FAILURE_OPTION,
    REASONS,
    RESET_OPTIONS,
    DeadLetter,
    DeadLetterCaptured,
    DeadLetterCaptureFailed,
    DeadLetterCount,
    DeadLetterFilter,
    DeadLetterGroup,
    DeadLetterPage,
    DeadLettersDiscarded,
    DeadLettersReplayed,
    DiscardResult,
    PurgeResult,
    ReplayResult,
    notify_channel,
)
from .store import DeadLetterStore

__all__ = [
    "DEFAULT_REPLAY_MAX_AGE_MS",
    "DEFAULT_RETENTION_MS",
    "FIRST_FAILURE_OPTION",
    "REASONS",
    "RESET_OPTIONS",
    "Culprit",
    "DeadLetter",
    "DeadLetterCaptureFailed",
    "DeadLetterCaptured",
    "DeadLetterCount",
    "DeadLetterFilter",
    "DeadLetterGroup",
    "DeadLetterPage",
    "DeadLetterStore",
    "DeadLetters",
    "DeadLettersDiscarded",
    "DeadLettersReplayed",
    "DiscardResult",
    "PurgeResult",
    "ReplayResult",
    "find_culprit",
    "fingerprint",
    "format_traceback",
    "notify_channel",
]
