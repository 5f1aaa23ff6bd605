"""The verdict of a chaos run, order by order: lost, doubled, phantom, stuck.

Definitions (a *committed order* is a row of ``chaos_orders``: the producer inserts it in the
same transaction as the order's outbox row, so it exists exactly when the message was sent;
read from Postgres directly, it settles producer commits whose outcome the producer never learnt):

* **done**: a committed order that is not poison and has exactly one effect row.
* **dead**: a committed poison order (its actor raises ``Unrecoverable``, a permanent failure)
  with a dead-letter row and no effect.
* **doubled**: an order with more than one effect row.
* **phantom**: an effect row whose order never committed (rolled back on purpose, or its
  producer transaction failed).
* **stuck**: a committed order that is neither done, dead nor doubled at the drain deadline but
  still on its way: an unpublished outbox row, or its message in the queue or the delay queue
  once the fleet stopped.
* **lost**: every other committed order that is neither done, dead nor doubled: no effect and
  nowhere it can still get one.  Split by where it ended: ``dead_lettered`` (a dead-letter row
  although every failure was transient, so a retry was safe), ``xq_only`` (only in RabbitMQ's
  ``.XQ``, out of reach of ``dead-letters replay``) and ``vanished`` (nowhere at all).

Also counted: ``spurious_dead_letters``, dead-letter rows of orders that are not poison (the
operator is told a job failed that was retry-safe; with an effect, it even ran), with their
reasons.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

VERDICTS = ("lost", "doubled", "phantom", "stuck")
_EXAMPLES = 10


@dataclasses.dataclass(frozen=True)
class Order:
    order_id: int
    message_id: str
    poison: bool


@dataclasses.dataclass(frozen=True)
class DeadLetterRow:
    message_id: str
    reason: str
    attempts: int
    error_type: str | None


@dataclasses.dataclass
class Ledger:
    """Counts (and a few example order ids) for each verdict; ``line()`` is the one JSON line."""

    counts: dict[str, int]
    examples: dict[str, list[int]]
    dead_letter_reasons: dict[str, int]
    run: dict[str, Any]

    @property
    def ok(self) -> bool:
        return all(self.counts[name] == 0 for name in (*VERDICTS, "spurious_dead_letters"))

    def line(self) -> str:
        return json.dumps(
            {
                "chaos_ledger": {name: self.counts[name] for name in VERDICTS},
                **self.counts,
                "examples": {name: ids for name, ids in self.examples.items() if ids},
                "spurious_dead_letter_reasons": self.dead_letter_reasons,
                **self.run,
            },
            sort_keys=False,
        )


def tally(
    *,
    orders: Iterable[Order],
    effects: Mapping[int, int],
    dead_letters: Iterable[DeadLetterRow],
    outbox_pending: set[str],
    queued: set[str],
    xq: set[str],
    run: dict[str, Any] | None = None,
) -> Ledger:
    """Judge every order from what Postgres and RabbitMQ hold once the fleet stopped.

    ``effects`` counts effect rows per order id, ``outbox_pending`` holds the message ids of
    unpublished outbox rows, ``queued`` those in the queue and its delay queue, ``xq`` those in
    the dead-letter queue.
    """
    by_message: dict[str, list[DeadLetterRow]] = collections.defaultdict(list)
    for row in dead_letters:
        by_message[row.message_id].append(row)
    committed = {order.order_id: order for order in orders}
    found: dict[str, list[int]] = {
        name: []
        for name in (
            "done",
            "dead",
            "doubled",
            "stuck",
            "lost",
            "dead_lettered",
            "xq_only",
            "vanished",
            "spurious_dead_letters",
        )
    }
    reasons: collections.Counter[str] = collections.Counter()
    for order in committed.values():
        count = effects.get(order.order_id, 0)
        rows = by_message.get(order.message_id, [])
        if rows and not order.poison:
            found["spurious_dead_letters"].append(order.order_id)
            reasons.update(f"{row.reason} ({row.error_type}, attempts={row.attempts})" for row in rows)
        if count > 1:
            found["doubled"].append(order.order_id)
        elif order.poison and rows and count == 0:
            found["dead"].append(order.order_id)
        elif not order.poison and count == 1:
            found["done"].append(order.order_id)
        elif order.message_id in outbox_pending or order.message_id in queued:
            found["stuck"].append(order.order_id)
        else:
            found["lost"].append(order.order_id)
            if rows:
                found["dead_lettered"].append(order.order_id)
            elif order.message_id in xq:
                found["xq_only"].append(order.order_id)
            else:
                found["vanished"].append(order.order_id)
    phantom = sorted(order_id for order_id, count in effects.items() if count and order_id not in committed)
    counts = {
        "committed": len(committed),
        "poison": sum(order.poison for order in committed.values()),
        **{name: len(ids) for name, ids in found.items()},
        "phantom": len(phantom),
    }
    examples = {name: sorted(ids)[:_EXAMPLES] for name, ids in found.items() if name not in ("done", "dead")}
    examples["phantom"] = phantom[:_EXAMPLES]
    return Ledger(counts, examples, dict(reasons.most_common()), dict(run or {}))
