"""Connection helpers shared by the middleware and the purge."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg


@contextlib.contextmanager
def autocommit(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """One-statement transactions on a pooled connection: no BEGIN/COMMIT round trips."""
    previous = conn.autocommit
    conn.autocommit = True
    try:
        yield conn
    finally:
        if not conn.closed and not conn.broken:
            conn.autocommit = previous
