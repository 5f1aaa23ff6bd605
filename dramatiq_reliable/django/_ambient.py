"""``send()`` inside Django's ``transaction.atomic()`` joins it, with no ``bind()``."""

from __future__ import annotations

from typing import Any

import psycopg
from django.db import connections

from ..database import Database
from ..errors import NotBound
from ._database import check_psycopg3, same_database

__all__ = ["django_transaction"]


def django_transaction(database: Database) -> psycopg.Connection[Any] | None:
    """The driver connection of the Django transaction open in this thread on ``database``, if any.

    ``None`` outside any transaction (the broker's ``on_unbound`` applies, as documented).  A
    transaction open only on aliases of another database cannot carry the message: the send is
    refused with :class:`~dramatiq_reliable.NotBound` rather than committed on its own.
    """
    elsewhere: list[str] = []
    for wrapper in connections.all(initialized_only=True):
        # ATOMIC_REQUESTS and atomic() set in_atomic_block; AUTOCOMMIT=False leaves a transaction open too.
        # Attributes only: Django's methods refuse to run in an event loop's thread, a send may not.
        if wrapper.connection is None or (not wrapper.in_atomic_block and wrapper.autocommit):
            continue
        if wrapper.vendor == "postgresql" and same_database(wrapper.alias, database):
            return check_psycopg3(wrapper.connection, wrapper.alias)
        elsewhere.append(wrapper.alias)
    if elsewhere:
        raise NotBound(
            f"send() inside a transaction on database alias {elsewhere[0]!r}, which is not the broker's database; "
            "the message cannot commit with it: use transaction.atomic(using=<the broker's alias>), or send "
            "outside the atomic block (the message then commits on its own)"
        )
    return None
