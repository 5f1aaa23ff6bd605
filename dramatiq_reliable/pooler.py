"""Transaction poolers (PgBouncer ``pool_mode = transaction``): detected, and where LISTEN goes.

Behind a transaction pooler each transaction may run on another server process, so a
``LISTEN`` registered by one statement is gone (or heard by someone else) by the next.
Everything else of ours is transaction-scoped already (``SET LOCAL``, ``pg_advisory_xact_lock``,
leases in rows, and no prepared statements behind a pooler: see
:meth:`~dramatiq_reliable.Database.transaction_pooled`).
So the parts that wake on ``LISTEN`` (the relay, ``PostgresBroker``'s consumers) take a
``listen_database=`` (a direct URL) for that one connection, and without it find out
themselves that they sit behind a pooler and poll instead: detected once per
:class:`~dramatiq_reliable.Database`, never configured by hand.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import _sql
from ._util import redact
from .database import Database, DatabaseLike
from .errors import ConfigurationError

__all__ = ["behind_transaction_pooler", "listen_target"]

logger = logging.getLogger("dramatiq_reliable.pooler")


def behind_transaction_pooler(database: Database) -> bool:
    """Whether ``database``'s connections go through a pooler in transaction mode (detected once)."""
    return database.transaction_pooled()


def _server(conn: psycopg.Connection[Any]) -> tuple[str, int | None]:
    row = conn.cursor(row_factory=dict_row).execute(_sql.query("pooler_server", _sql.DEFAULT_SCHEMA)).fetchone()
    assert row is not None
    return str(row["database_name"]), row["server_port"]


def listen_target(database: Database, listen_database: DatabaseLike | None, *, who: str) -> Database | None:
    """Where ``who`` holds its ``LISTEN`` connection: ``listen_database``, else ``database``, else
    nowhere (``None``: ``database`` is behind a transaction pooler; ``who`` polls, logged once).

    A ``listen_database`` that cannot be reached, is itself behind a transaction pooler, or is
    another database than ``database``'s (its notifications would never come) is refused with
    :class:`~dramatiq_reliable.errors.ConfigurationError`, without credentials in the text.
    """
    if listen_database is None:
        if not behind_transaction_pooler(database):
            return database
        logger.warning(
            "%s: the database is behind a transaction pooler, where LISTEN does not work; polling instead "
            "(pass listen_database= a direct Postgres URL for immediate wake-ups)",
            who,
        )
        return None
    direct = Database.of(listen_database, argument="listen_database", max_size=1)
    try:
        if behind_transaction_pooler(direct):
            raise ConfigurationError(
                f"{who}: listen_database= goes through a transaction pooler too, where LISTEN hears nothing; "
                "give it a direct Postgres URL (the server's own port, not the pooler's)"
            )
        with direct.connect(autocommit=True) as listen, database.connect(autocommit=True) as main:
            heard, sent = _server(listen), _server(main)
    except psycopg.Error as error:
        raise ConfigurationError(
            f"{who}: cannot connect to listen_database= ({redact(str(error).strip().splitlines()[0])}); "
            "give it a direct Postgres URL that this process can reach"
        ) from None
    if heard != sent:
        raise ConfigurationError(
            f"{who}: listen_database= is database {heard[0]!r} on port {heard[1]!r}, but database= is "
            f"{sent[0]!r} on port {sent[1]!r}: notifications would never arrive; point both at the same database"
        )
    return direct
