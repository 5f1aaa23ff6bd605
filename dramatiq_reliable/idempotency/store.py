"""The Postgres idempotency store: record-mode keys in ``processed_jobs``, one autocommit statement each."""

from __future__ import annotations

from typing import Any

from .. import _sql
from ..database import Database, DatabaseLike
from ..schema import IDEMPOTENCY_VERSION, ensure_ready
from ._connections import autocommit
from .protocol import StoredKey
from .purge import purge_expired

__all__ = ["PostgresIdempotencyStore"]


class PostgresIdempotencyStore:
    """Keys in the ``processed_jobs`` table, with the same statements the middleware runs.

    The middleware without ``store=`` keeps using its own pool handling (retries on fresh
    connections, the job's transaction); this class is for record mode through ``store=`` and
    for code that reads or purges keys.
    """

    def __init__(self, *, database: DatabaseLike, schema: str = _sql.DEFAULT_SCHEMA) -> None:
        self.database = Database.of(database)
        self.schema = _sql.validate_schema(schema)

    def _params(self, actor_name: str, key: str, **more: Any) -> dict[str, Any]:
        return {"actor_name": actor_name, "job_key": key, **more}

    def lookup(self, *, actor_name: str, key: str) -> StoredKey | None:
        with self.database.connection() as conn, autocommit(conn):
            row = (
                _sql.tuples(conn)
                .execute(_sql.query("idempotency_lookup", self.schema), self._params(actor_name, key))
                .fetchone()
            )
        return None if row is None else StoredKey(bytes(row[0]), str(row[1]))

    def record(self, *, actor_name: str, key: str, payload_hash: bytes, message_id: str, retention_s: float) -> bool:
        params = self._params(
            actor_name, key, payload_hash=payload_hash, message_id=message_id, retention_s=retention_s
        )
        with self.database.connection() as conn, autocommit(conn):
            row = _sql.tuples(conn).execute(_sql.query("idempotency_claim", self.schema), params).fetchone()
        return row is not None

    def check_ready(self) -> None:
        with self.database.connection() as conn:
            ensure_ready(conn, schema=self.schema, required=IDEMPOTENCY_VERSION, feature="idempotency")

    def purge_expired(self) -> int:
        return purge_expired(self.database, schema=self.schema)

    def close(self) -> None:
        self.database.close()
