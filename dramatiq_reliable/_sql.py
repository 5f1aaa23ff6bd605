"""SQL kept in ``.sql`` files, composed with quoted identifiers.

Every query and migration lives in ``dramatiq_reliable/sql``.  A file names its schema as
``{schema}``; :func:`query` fills that in with ``psycopg.sql.Identifier`` so a schema name is
always quoted and values always travel as parameters, never as text.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

from .errors import ConfigurationError

__all__ = ["DEFAULT_SCHEMA", "query", "read", "validate_schema"]

DEFAULT_SCHEMA = "dramatiq_reliable"

# Postgres truncates identifiers at 63 bytes; the NOTIFY channel is "<schema>.outbox", so the
# schema must leave room for that suffix or two schemas could share one channel.
_MAX_SCHEMA_BYTES = 63 - len(".outbox")
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


@functools.cache
def read(name: str) -> str:
    """The text of ``sql/<name>.sql`` (or a migration, ``migrations/NNNN_x``)."""
    return resources.files(__package__).joinpath("sql").joinpath(f"{name}.sql").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=512)
def query(name: str, schema: str) -> sql.Composed:
    """``sql/<name>.sql`` with ``{schema}`` bound to the quoted schema identifier."""
    return compose(read(name), schema)


def compose(text: str, schema: str) -> sql.Composed:
    """Bind ``{schema}`` in ``text``; literal braces are not used in our SQL files."""
    names = set(_PLACEHOLDER.findall(text))
    if names - {"schema"}:
        raise ValueError(f"unknown placeholders {sorted(names - {'schema'})!r} in SQL text")
    return sql.SQL(text).format(schema=sql.Identifier(schema))
