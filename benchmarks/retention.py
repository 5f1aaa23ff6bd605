"""Retention benchmark: dropping partitions of published outbox rows vs DELETE, measured side by side in one run.

    python benchmarks/retention.py [--rows 10000000] [--during-rows N] [--relay-rows 20000] [--rounds 5]
                                   [--batch-size 500]

Three schemas on the same servers: ``del`` keeps ``--rows`` published rows in the outbox (no
partitions, as today); ``part`` has partitions enabled and the same rows in the partitioned
history; ``empty`` has partitions enabled and keeps nothing.  Rows are loaded with one
``INSERT ... SELECT generate_series`` each.
  1. relay throughput (our relay draining ``--relay-rows`` rows into RabbitMQ, marking them as a
     running relay does once it maintained the partitions) and claim throughput (the relay's
     claim and mark statements alone, no publish) with the rows retained vs the empty schema,
     in ``--rounds`` interleaved rounds (medians): ``retained_relay_ratio``,
     ``retained_claim_ratio`` (and the same for ``del``, for reference);
  2. the purge of every retained row, nothing else running: ``DELETE`` in batches (the relay's
     ``purge_published``) vs ``partitions.maintain`` dropping the expired partitions: time, WAL
     bytes (``pg_current_wal_lsn`` before and after), table size after; ``purge_speedup``,
     ``purge_wal_ratio``;
  3. ``--during-rows`` (default a tenth of ``--rows``) loaded again and purged again while a
     relay drains ``--relay-rows`` rows over and over: its throughput during each purge.
Everything created is dropped at the end.  The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import pika
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).parent))
from relay import DATABASE_URL, RABBITMQ_URL, fast_fill, log, ready

from dramatiq_reliable import OutboxBroker, Relay, _sql, migrate, partitions
from dramatiq_reliable.outbox.relay import purge_published

DAY_MS = 86_400_000


def wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])


def size(conn: psycopg.Connection[Any], schema: str, table: str) -> int:
    """Bytes of ``table`` with its indexes and TOAST, partitions included."""
    row = conn.execute(
        "SELECT CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0) "
        "FROM pg_partition_tree(c.oid) AS t) ELSE pg_total_relation_size(c.oid) END::bigint "
        "FROM pg_class AS c WHERE c.oid = %s::regclass",
        (sql.Identifier(schema, table).as_string(conn),),
    ).fetchone()
    assert row is not None
    return int(row[0])


def load_retained(schema: str, table: str, template: bytes, rows: int) -> None:
    """``rows`` published rows, published 2 to 3 days ago (expired under a one-day retention)."""
    message_id = json.loads(template)["message_id"]
    query = sql.SQL(
        "INSERT INTO {} (id, message_id, queue_name, actor_name, body, created_at, available_at, published_at, attempts) "
        "SELECT g.n, g.mid, 'retained', 'bench_actor', convert_to(replace(%(template)s, %(old)s, g.mid), 'UTF8'), "
        "g.at, g.at, g.at, 0 "
        "FROM (SELECT n, gen_random_uuid()::text AS mid, "
        "      now() - interval '2 days' - (n %% 86000) * interval '1 second' AS at "
        "      FROM generate_series(1, %(rows)s) AS n) AS g"
    ).format(sql.Identifier(schema, table))
    if table == "outbox":
        # The outbox's id is GENERATED ALWAYS; the history's is a plain column.
        query = sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, created_at, available_at, published_at) "
            "SELECT g.mid, 'retained', 'bench_actor', convert_to(replace(%(template)s, %(old)s, g.mid), 'UTF8'), "
            "g.at, g.at, g.at "
            "FROM (SELECT n, gen_random_uuid()::text AS mid, "
            "      now() - interval '2 days' - (n %% 86000) * interval '1 second' AS at "
            "      FROM generate_series(1, %(rows)s) AS n) AS g"
        ).format(sql.Identifier(schema, table))
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(query, {"template": template.decode(), "old": message_id, "rows": rows})
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.Identifier(schema, table)))


def relay_round(broker: OutboxBroker, queue: str, template: bytes, rows: int, batch_size: int) -> float:
    """Rows/s of a relay draining ``rows`` new rows, marking them as a running relay does."""
    fast_fill(broker.schema, template, [queue], rows)
    relay = Relay.from_broker(broker, batch_size=batch_size)
    try:
        # What Relay.run does at its first purge: learn whether to move rows to the partitions.
        relay._mark = partitions.maintain_for_relay(relay.database, schema=broker.schema)
        ready(relay, [queue])
        started = time.perf_counter()
        published = relay.drain()
        return published / (time.perf_counter() - started)
    finally:
        relay.publisher.close()


def claim_round(schema: str, template: bytes, queue: str, rows: int, batch_size: int) -> float:
    """Rows/s of the relay's own claim and mark statements with no publish between."""
    fast_fill(schema, template, [queue], rows)
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        mark = partitions.maintain_for_relay(DATABASE_URL, schema=schema)
        claimed = 0
        started = time.perf_counter()
        while True:
            with conn.transaction():
                ids = [
                    row[0]
                    for row in conn.execute(
                        _sql.query("outbox_claim", schema), {"batch_size": batch_size, "max_attempts": 25}
                    )
                ]
                if not ids:
                    break
                conn.execute(_sql.query(mark, schema), {"ids": ids})
            claimed += len(ids)
        return claimed / (time.perf_counter() - started)


def purge_case(name: str, purge: Any, schema: str, table: str) -> dict[str, Any]:
    """Run ``purge`` with nothing else running: time, WAL bytes, the table's size after."""
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        before = wal_lsn(conn)
        started = time.perf_counter()
        purge()
        elapsed = time.perf_counter() - started
        wal = wal_lsn(conn) - before
        return {
            f"{name}_s": round(elapsed, 3),
            f"{name}_wal_bytes": wal,
            f"{name}_table_bytes_after": size(conn, schema, table),
        }


def relay_during(purge: Any, broker: OutboxBroker, queue: str, template: bytes, args: argparse.Namespace) -> float:
    """Median rows/s of relay drains run back to back while ``purge`` runs (at least one)."""
    done = threading.Event()
    rates: list[float] = []

    def relay_loop() -> None:
        while not done.is_set() or not rates:
            rates.append(relay_round(broker, queue, template, args.relay_rows, args.batch_size))

    thread = threading.Thread(target=relay_loop)
    thread.start()
    try:
        purge()
    finally:
        done.set()
        thread.join()
    return round(statistics.median(rates), 1)


def rabbit(queue: str, method: str) -> None:
    """Purge or delete ``queue`` on a connection of its own (a long load would let one time out)."""
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        getattr(connection.channel(), method)(queue)
    finally:
        connection.close()


def set_retention(schema: str, retention_ms: int) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET retention_ms = %s").format(sql.Identifier(schema, "partitioned_tables")),
            (retention_ms,),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="published rows retained")
    parser.add_argument("--during-rows", type=int, default=None, help="rows purged while a relay runs (rows/10)")
    parser.add_argument("--relay-rows", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args()
    during_rows = args.rows // 10 if args.during_rows is None else args.during_rows

    tag = uuid.uuid4().hex[:8]
    queue = f"perfretention_{tag}"
    names = {kind: f"perfretention_{kind}_{tag}" for kind in ("del", "part", "empty")}
    brokers: dict[str, OutboxBroker] = {}
    template = dramatiq.Message(
        queue_name=queue, actor_name="bench_actor", args=(1, "x" * 40), kwargs={}, options={}
    ).encode()
    results: dict[str, Any] = {
        "rows": args.rows,
        "during_rows": during_rows,
        "relay_rows": args.relay_rows,
        "rounds": args.rounds,
    }
    try:
        for kind, schema in names.items():
            migrate(DATABASE_URL, schema=schema)
            brokers[kind] = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=schema)
        for kind in ("part", "empty"):
            partitions.enable(DATABASE_URL, schema=names[kind], interval_ms=DAY_MS, retention_ms=7 * DAY_MS)
        log(f"loading {args.rows} published rows twice")
        started = time.perf_counter()
        load_retained(names["del"], "outbox", template, args.rows)
        load_retained(names["part"], "outbox_published", template, args.rows)
        log(f"loaded in {time.perf_counter() - started:.0f}s")

        # 1. Relay and claim with the rows retained vs none, interleaved.
        relay: dict[str, list[float]] = {kind: [] for kind in names}
        claim: dict[str, list[float]] = {kind: [] for kind in names}
        for round_ in range(args.rounds):
            for kind in ("part", "empty", "del"):
                relay[kind].append(relay_round(brokers[kind], queue, template, args.relay_rows, args.batch_size))
                claim[kind].append(claim_round(names[kind], template, queue, args.relay_rows, args.batch_size))
                rabbit(queue, "queue_purge")
            log(f"round {round_ + 1}: relay {[round(v[-1]) for v in relay.values()]} rows/s (del, part, empty)")
        med = {kind: statistics.median(values) for kind, values in relay.items()}
        cmed = {kind: statistics.median(values) for kind, values in claim.items()}
        results.update(
            {
                "relay_rows_per_s_empty": round(med["empty"], 1),
                "relay_rows_per_s_retained_partitioned": round(med["part"], 1),
                "relay_rows_per_s_retained_unpartitioned": round(med["del"], 1),
                "retained_relay_ratio": round(med["part"] / med["empty"], 3),
                "retained_relay_ratio_unpartitioned": round(med["del"] / med["empty"], 3),
                "claim_rows_per_s_empty": round(cmed["empty"], 1),
                "claim_rows_per_s_retained_partitioned": round(cmed["part"], 1),
                "claim_rows_per_s_retained_unpartitioned": round(cmed["del"], 1),
                "retained_claim_ratio": round(cmed["part"] / cmed["empty"], 3),
                "retained_claim_ratio_unpartitioned": round(cmed["del"] / cmed["empty"], 3),
                "relay_spread": {k: [round(min(v)), round(max(v))] for k, v in relay.items()},
                "claim_spread": {k: [round(min(v)), round(max(v))] for k, v in claim.items()},
            }
        )

        # 2. The purge alone.  A retention of one day: every retained row has expired.
        set_retention(names["part"], DAY_MS)
        log("purging by DELETE")
        delete = lambda: purge_published(DATABASE_URL, schema=names["del"], older_than_ms=DAY_MS)  # noqa: E731
        drop = lambda: partitions.maintain(DATABASE_URL, schema=names["part"])  # noqa: E731
        results.update(purge_case("delete", delete, names["del"], "outbox"))
        log("purging by dropping partitions")
        results.update(purge_case("drop", drop, names["part"], "outbox_published"))
        results["purge_speedup"] = round(results["delete_s"] / max(results["drop_s"], 1e-6), 1)
        results["purge_wal_ratio"] = round(results["drop_wal_bytes"] / max(results["delete_wal_bytes"], 1), 5)

        # 3. A relay draining while each purge runs.
        if during_rows:
            set_retention(names["part"], 7 * DAY_MS)
            partitions.maintain(DATABASE_URL, schema=names["part"])  # the window's partitions again
            load_retained(names["del"], "outbox", template, during_rows)
            load_retained(names["part"], "outbox_published", template, during_rows)
            set_retention(names["part"], DAY_MS)
            log(f"purging {during_rows} rows each way with a relay draining")
            results["delete_relay_rows_per_s_during"] = relay_during(delete, brokers["del"], queue, template, args)
            rabbit(queue, "queue_purge")
            results["drop_relay_rows_per_s_during"] = relay_during(drop, brokers["part"], queue, template, args)
            rabbit(queue, "queue_purge")
        with open("/proc/loadavg") as load:
            results["loadavg"] = load.read().split()[:3]
    finally:
        for broker in brokers.values():
            broker.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            for schema in names.values():
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        rabbit(queue, "queue_delete")
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
