"""SQL kept in ``.sql`` files, composed with quoted identifiers.

Every query and migration lives in ``dramatiq_reliable/sql``.  A file names its schema as
``{schema}``; :func:`query` fills that in with ``psycopg.sql.Identifier`` so a schema name is
always quoted and values always travel as parameters, never as text.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from .errors import ConfigurationError

__all__ = ["DEFAULT_SCHEMA", "query", "read", "rendered", "set_local_timeouts", "tuples", "validate_schema"]

DEFAULT_SCHEMA = "dramatiq_reliable"

# Postgres truncates identifiers at 63 bytes; the NOTIFY channels are "<schema>.outbox" and
# "<schema>.dead_letters", so the schema must leave room for the longer suffix or two schemas
# could share one channel.
_MAX_SCHEMA_BYTES = 63 - len(".dead_letters")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def validate_schema(schema: object) -> str:
    """Return ``schema`` if it can name our Postgres schema, else raise ``ConfigurationError``."""
    if not isinstance(schema, str) or not schema:
        raise ConfigurationError(
            f"schema must be a non-empty string, got {schema!r}; pass e.g. schema={DEFAULT_SCHEMA!r}"
        )
    if len(schema.encode()) > _MAX_SCHEMA_BYTES:
        raise ConfigurationError(
            f"schema {schema!r} is longer than {_MAX_SCHEMA_BYTES} bytes; choose a shorter schema name"
        )
    if "\x00" in schema:
        raise ConfigurationError(f"schema {schema!r} contains a NUL byte; choose another schema name")
    return schema


def tuples(conn: psycopg.Connection[Any]) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor on ``conn`` that returns tuples whatever row factory the app gave its connection.

    An app may share a pool (or bind a connection) configured with ``dict_row``; our queries
    read columns by position.
    """
    return conn.cursor(row_factory=tuple_row)


@functools.cache
def read(name: str) -> str:
    """The text of ``sql/<name>.sql`` (or a migration, ``migrations/NNNN_x``)."""
    return resources.files(__package__).joinpath("sql").joinpath(f"{name}.sql").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=512)
def query(name: str, schema: str, **identifiers: str) -> sql.Composed:
    """``sql/<name>.sql`` with ``{schema}`` (and any other ``{name}``) bound to quoted identifiers."""
    return compose(read(name), schema, **identifiers)


@functools.lru_cache(maxsize=512)
def rendered(name: str, schema: str) -> bytes | sql.Composed:
    """:func:`query` rendered to bytes once, for statements run on every message.

    psycopg renders a ``Composed`` to bytes on every ``execute`` (about a tenth of the cost of
    the idempotency claim); bytes are sent as they are.  An ASCII schema renders to the same
    bytes in every client encoding, so only then are the bytes cached; any other schema keeps
    the ``Composed``, which psycopg renders in the connection's encoding.
    """
    composed = query(name, schema)
    return composed.as_bytes(None) if schema.isascii() else composed


def compose(text: str, schema: str, **identifiers: str) -> sql.Composed:
    """Bind ``{schema}`` and ``identifiers`` in ``text``; literal braces are not used in our SQL files."""
    known = {"schema", *identifiers}
    names = set(_PLACEHOLDER.findall(text))
    if names - known:
        raise ValueError(f"unknown placeholders {sorted(names - known)!r} in SQL text")
    values = {key: sql.Identifier(value) for key, value in identifiers.items()}
    return sql.SQL(text).format(schema=sql.Identifier(schema), **values)


def set_local_timeouts(
    conn: psycopg.Connection[Any], *, statement_timeout_ms: int, idle_in_transaction_timeout_ms: int = 0
) -> None:
    """Bound our own transaction on ``conn`` server-side (``SET LOCAL``; 0 leaves a bound off).

    Never call it on the app's transaction: the bounds would cut the app's own statements.
    """
    conn.execute(
        query("local_timeouts", DEFAULT_SCHEMA),
        {"statement_timeout": str(int(statement_timeout_ms)), "idle_timeout": str(int(idle_in_transaction_timeout_ms))},
    )
