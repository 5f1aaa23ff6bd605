"""The narrator: turns the package's events into plain sentences as the demo runs.

Nothing here is needed in an application.  The package already reports what it does as
events (``dramatiq_reliable.events``: a retry scheduled, a duplicate skipped, a dead letter
stored, outbox rows published); the demo subscribes to them and says each in words, next to
what the fake providers saw.  :class:`Narrator` is a tiny middleware that notes when a message
is settled (done, skipped or dead), so the demo can wait for exactly that and not a fixed time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

from dramatiq_reliable import events
from dramatiq_reliable.dead_letters import DeadLetterCaptured, DeadLettersReplayed
from dramatiq_reliable.idempotency import IdempotencyDuplicateSkipped, IdempotencyKeyReused
from dramatiq_reliable.outbox.events import OutboxBatchPublished, OutboxBrokerUnavailable
from dramatiq_reliable.retries import RetryGaveUp, RetryScheduled

WHO_WIDTH = 14


class Story:
    """Prints the demo's lines, one speaker a line, from any thread."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.relay = True  # False on a PostgresBroker: no relay, the send is the queue row
        self.labels: dict[str, str] = {}  # message_id -> "Ada's welcome email"
        self.settled: dict[str, str] = {}  # message_id -> "done" | "skipped" | "dead"
        self.dead_letters: dict[str, int] = {}  # message_id -> dead letter id
        self._published: Counter[str] = Counter()  # relay publishes told, per message_id
        self._started: Counter[str] = Counter()  # worker attempts begun, per message_id
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.counts: Counter[str] = Counter()  # what each part did, for the closing summary
        self._tty = out.isatty()
        self._progress_shown = False

    # -- printing -----------------------------------------------------------------------------

    def _print(self, line: str) -> None:
        if self._progress_shown:
            self.out.write("\r\x1b[2K")
            self._progress_shown = False
        self.out.write(line + "\n")
        self.out.flush()

    def chapter(self, number: int, title: str, *explanation: str) -> None:
        with self._lock:
            self._print("")
            self._print(f"{number}. {title}")
            for line in explanation:
                self._print(f"   {line}")

    def say(self, who: str, text: str) -> None:
        with self._lock:
            self._print(f"   {who:<{WHO_WIDTH}} {text}")

    def line(self, text: str) -> None:
        with self._lock:
            self._print(f"   {text}")

    def block(self, text: str) -> None:
        """Command output, indented under the line that ran it."""
        with self._lock:
            for line in text.rstrip("\n").splitlines():
                self._print(f"   {'':<{WHO_WIDTH}} | {line}")

    # -- messages -------------------------------------------------------------------------------

    def track(self, message_id: str, label: str) -> None:
        with self._lock:
            self.labels[message_id] = label

    def label(self, message_id: str) -> str:
        return self.labels.get(message_id, f"message {message_id[:8]}")

    def settle(self, message_id: str, how: str) -> None:
        with self._changed:
            self.settled[message_id] = how
            self._changed.notify_all()

    def forget(self, message_ids: Iterable[str]) -> None:
        """A replayed message runs again: it is no longer settled."""
        with self._changed:
            for message_id in message_ids:
                self.settled.pop(message_id, None)

    def wait_told_published(self, message_id: str) -> None:
        """Hold a worker attempt until the relay's line about it is printed, so the story reads
        in the order things happened (the relay's event comes after its commit, and a worker
        can be quicker than that).  A retry's move from its delay queue is no relay publish:
        each attempt waits for one relay publish of its own."""
        if message_id not in self.labels or not self.relay:
            return
        with self._changed:
            self._changed.wait_for(lambda: self._published[message_id] > self._started[message_id], timeout=2.0)
            self._started[message_id] += 1

    def wait_for(self, what: str, done: Callable[[], bool], *, timeout_s: float = 30.0) -> None:
        """Wait until ``done()``; after a second, show a progress line saying what we wait for."""
        started = time.monotonic()
        last_shown = 0.0
        with self._changed:
            while not done():
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    raise SystemExit(f"demo failed: gave up waiting for {what} after {timeout_s:.0f}s")
                if elapsed >= 1.0 and elapsed - last_shown >= (0.2 if self._tty else 2.0):
                    last_shown = elapsed
                    line = f"   {'':<{WHO_WIDTH}} ... waiting for {what} ({elapsed:.0f}s)"
                    if self._tty:
                        self.out.write("\r\x1b[2K" + line)
                        self.out.flush()
                        self._progress_shown = True
                    else:
                        self.out.write(line + "\n")
                        self.out.flush()
                self._changed.wait(0.2)

    def wait_settled(self, message_ids: Iterable[str], what: str, *, timeout_s: float = 30.0) -> None:
        ids = list(message_ids)
        self.wait_for(what, lambda: all(i in self.settled for i in ids), timeout_s=timeout_s)

    # -- the package's events, in words -----------------------------------------------------------

    def on_event(self, event: events.Event) -> None:
        if isinstance(event, OutboxBatchPublished):
            ours = [m for m in event.messages if m.message_id in self.labels and m.error is None]
            if ours:
                shown = [self.label(m.message_id) + (" (retry)" if m.queue_name.endswith(".DQ") else "") for m in ours]
                names = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
                self.counts["published"] += len(ours)
                self.say("relay", f"published {len(ours)} outbox {_rows(len(ours))} to RabbitMQ, confirmed: {names}")
                with self._changed:
                    self._published.update(m.message_id for m in ours)
                    self._changed.notify_all()
        elif isinstance(event, OutboxBrokerUnavailable):
            self.say("relay", f"RabbitMQ is unreachable ({event.error}); rows wait in the outbox")
        elif isinstance(event, RetryScheduled):
            self.counts["retried"] += 1
            delay = (event.delay_ms or 0) / 1000
            status = f"HTTP {event.http_status}" if event.http_status else event.error_type
            self.say(
                "retries",
                f"{self.label(event.message_id)} failed on attempt {event.attempt} with {status} "
                f"({event.category}: {event.reason}); next attempt in {delay:.1f}s, through the {self._via}",
            )
        elif isinstance(event, RetryGaveUp):
            self.counts["failed fast"] += 1
            status = f"HTTP {event.http_status}" if event.http_status else event.error_type
            self.say(
                "retries",
                f"{self.label(event.message_id)} failed with {status} ({event.category}: {event.reason}): "
                "no retry can fix that, so it fails at once",
            )
        elif isinstance(event, IdempotencyDuplicateSkipped):
            self.counts["skipped"] += 1
            self.say(
                "idempotency",
                f"{self.label(event.message_id)}: skipped, key {event.key!r} already ran "
                f"(as message {event.first_message_id[:8]}, {event.mode} mode)",
            )
        elif isinstance(event, IdempotencyKeyReused):
            self.say("idempotency", f"{self.label(event.message_id)}: key {event.key!r} reused with other arguments")
        elif isinstance(event, DeadLetterCaptured):
            with self._lock:
                self.dead_letters[event.message_id] = event.dead_letter_id
                self.counts["dead"] += 1
            self.say(
                "dead letters",
                f"{self.label(event.message_id)} stored as dead letter #{event.dead_letter_id} "
                f"({event.error_type}, {event.reason}, {event.attempts} {_plural(event.attempts, 'attempt')})",
            )
            self.settle(event.message_id, "dead")
        elif isinstance(event, DeadLettersReplayed):
            self.counts["replayed"] += event.count
            self.say(
                "dead letters", f"{event.count} {_plural(event.count, 'dead letter')} replayed through the {self._via}"
            )

    @property
    def _via(self) -> str:
        return "outbox" if self.relay else "queue"

    def summary(self) -> list[str]:
        """One line per part: what it did in this run, counted from its events."""
        c = self.counts
        sent = len(self.labels)
        if self.relay:
            transport = [
                f"outbox        {sent} messages sent inside the signups' transactions: {sent} outbox rows, "
                "committed with the accounts",
                f"relay         {c['published']} rows published to RabbitMQ with publisher confirms "
                "(retries and replays are outbox rows too)",
            ]
        else:
            transport = [
                f"queue         {sent} messages sent inside the signups' transactions: {sent} queue rows, "
                "committed with the accounts",
                "relay         none: with PostgresBroker the queue row is the message (retries and replays too)",
            ]
        return [
            *transport,
            f"idempotency   {c['skipped']} {_plural(c['skipped'], 'duplicate')} skipped by their keys",
            f"retries       {c['retried']} {_plural(c['retried'], 'retry')} scheduled with backoff; "
            f"{c['failed fast']} permanent {_plural(c['failed fast'], 'error')} failed fast",
            f"dead letters  {c['dead']} stored with {_plural(c['dead'], 'its', 'their')} error and attempts, "
            f"{c['replayed']} replayed after the fix",
        ]


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    if count == 1:
        return noun
    return plural or (noun[:-1] + "ies" if noun.endswith("y") else noun + "s")


def _rows(count: int) -> str:
    return _plural(count, "row")


class Narrator(Middleware):
    """Marks a message settled once the worker is done with it: processed, or skipped.

    First in the list, so its after-hooks run last: after ``Idempotency`` committed and after
    ``ClassifiedRetries`` decided.  A failed message settles when its dead letter is stored.
    """

    def __init__(self, story: Story) -> None:
        self.story = story

    def before_process_message(self, broker: Broker, message: Any) -> None:
        self.story.wait_told_published(message.message_id)

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        if exception is None:
            self.story.settle(message.message_id, "done")

    def after_skip_message(self, broker: Broker, message: Any) -> None:
        self.story.settle(message.message_id, "skipped")
