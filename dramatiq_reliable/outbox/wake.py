"""Relay wake-up: how an idle relay finds new rows without producers sending it anything.

A producer's outbox insert sends no NOTIFY (a transaction that notified takes a cluster-wide
lock at commit, so notifying producers would serialise).  The relay wakes itself instead:
after a pass that found rows it passes again at once; after an empty pass it sleeps a short,
slowly growing, jittered delay (about 1 ms first, a quarter longer each time) up to
``poll_interval_ms``, probing the outbox between sleeps.  A row committed while traffic flows is picked up within a few milliseconds;
the first row after a long idle within ``poll_interval_ms``.

Relays still ``LISTEN`` on the channel ``"<schema>.outbox"``: :func:`wake_relays` ends their
sleep at once.  It is for paths off the producer's hot path (an operator's retry, a replay of
dead letters, the scheduler's fires, a bulk load), which pay the commit lock once per batch.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg

from .. import _sql

__all__ = ["channel", "idle_delay_s", "wake_relays"]

# The first sleep after an empty pass: at a steady rate the next row is usually this close.
FIRST_IDLE_S = 0.001
# Each empty probe lengthens the next sleep by this factor.  A row committed after a quiet gap
# of G ms waits up to about G * (GROWTH - 1) for the sleep in progress: doubling would add the
# whole gap (a producer's 100 ms stall becoming 100 ms more latency for the rows behind it); a
# quarter adds at most a quarter, for about 25 probes from 1 ms to a 250 ms ceiling instead of 8.
GROWTH = 1.25


def channel(schema: str) -> str:
    """The NOTIFY channel the relays of ``schema`` listen on: ``"<schema>.outbox"``."""
    return f"{_sql.validate_schema(schema)}.outbox"


def wake_relays(conn: psycopg.Connection[Any], *, schema: str = _sql.DEFAULT_SCHEMA) -> None:
    """Wake every relay of ``schema`` now, instead of at the end of its idle sleep.

    Sent on ``conn``: inside a transaction it is delivered when that transaction commits (and
    never if it rolls back), so call it in the transaction that wrote the rows.  Outbox sends
    never need it (an idle relay finds them within its ``poll_interval_ms``); it is for code
    that wrote rows the relay should publish without waiting out a long ``poll_interval_ms``.
    Notifying takes a server-wide lock at commit: once per batch is cheap, once per producer
    transaction is the tax this design avoids.

    >>> with broker.transaction() as conn:                  # doctest: +SKIP
    ...     load_many_rows(conn)
    ...     wake_relays(conn, schema=broker.schema)
    """
    conn.execute(_sql.query("outbox_wake", _sql.validate_schema(schema)), {"channel": channel(schema)})


def idle_delay_s(step: int, *, ceiling_s: float, first_s: float = FIRST_IDLE_S) -> float:
    """The sleep after ``step`` consecutive empty probes (0 for the first): growing, jittered.

    Drawn from the upper half of ``first_s * GROWTH**step`` (capped at ``ceiling_s``), so relays
    that went idle together drift apart instead of probing Postgres in lockstep, and no sleep
    exceeds ``ceiling_s``.
    """
    bound = min(ceiling_s, first_s * GROWTH ** min(step, 400))
    return random.uniform(bound / 2, bound)
