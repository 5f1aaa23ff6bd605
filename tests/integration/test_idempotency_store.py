"""PostgresIdempotencyStore keeps the in-memory store's contract over the real processed_jobs table."""

from __future__ import annotations

from dramatiq_reliable import IdempotencyStore, PostgresIdempotencyStore


def test_the_postgres_store_looks_up_records_once_and_purges(database_url, db_schema, db):
    store = PostgresIdempotencyStore(database=database_url, schema=db_schema)
    try:
        assert isinstance(store, IdempotencyStore)
        store.check_ready()
        assert store.lookup(actor_name="a", key="k") is None
        assert store.record(actor_name="a", key="k", payload_hash=b"h1", message_id="m1", retention_s=60)
        assert not store.record(actor_name="a", key="k", payload_hash=b"h2", message_id="m2", retention_s=60)
        assert store.lookup(actor_name="a", key="k") == (b"h1", "m1")
        assert store.record(actor_name="a", key="old", payload_hash=b"h", message_id="m3", retention_s=60)
        db.execute(
            f"UPDATE \"{db_schema}\".processed_jobs SET expires_at = now() - interval '1 s' WHERE job_key = 'old'"
        )
        assert store.lookup(actor_name="a", key="old") is None
        assert store.purge_expired() == 1
        assert store.lookup(actor_name="a", key="k") == (b"h1", "m1")
    finally:
        store.close()
