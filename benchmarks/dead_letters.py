"""Dead letters benchmark: a bulk replay through the outbox and a filtered listing on a big table.

    python benchmarks/dead_letters.py [--rows 1000000] [--replay 100000] [--batch 5000] [--list-runs 30]

In a throwaway schema (dropped at the end) it fills ``dead_letters`` with ``--rows`` rows using
set-based SQL (``generate_series``), then measures:
  1. filtered listings (newest first, 50 rows): one actor, first page and a page 21 deep through
     the keyset cursor; actor + error type + time range; no filter; median and p95 over
     ``--list-runs`` runs;
  2. ``PostgresDeadLetterStore.replay()`` of ``--replay`` rows of one actor, each from a fresh checkpoint:
     an incident (one bug, consecutive rows: the usual bulk replay after a fix, the headline
     figure) and the same number of rows scattered one in nine over the table (the worst case:
     every row on its own page, so every row costs a full-page image in the WAL).
  3. the baseline, what replaying looks like without a store: a loop over ``--baseline`` dead
     rows of one other actor that re-sends each message with Dramatiq's own ``RabbitmqBroker``
     (publisher confirms on, so a re-send is known to have landed) and marks the row replayed.
The last line printed is one JSON object with ``replay_rows_per_s`` (the incident),
``replay_scattered_rows_per_s``, ``baseline_rows_per_s``, ``ratio_to_baseline`` and
``list_ms`` (the actor filter's first page).
Targets on 2 cores: replay >= 20,000 rows/s, filtered listing under 50 ms.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name, xq_name
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import migrate
from dramatiq_reliable.dead_letters import DeadLetterFilter, PostgresDeadLetterStore

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

# Rows look like real dead letters: a 300-byte message, a 600-byte traceback, 50 actors, 10
# queues, 6 error types, failures spread over the last 30 days (jobs first sent an hour before).
FILL = """
INSERT INTO {table} (
    message_id, queue_name, actor_name, message, error_type, error_message, traceback, attempts,
    reason, fingerprint, culprit, sent_at, first_failed_at, last_failed_at, worker_host, worker_pid
)
SELECT
    'm-' || n,
    'queue_' || mod(n, 10),
    actor,
    jsonb_build_object(
        'queue_name', 'queue_' || mod(n, 10),
        'actor_name', actor,
        'args', jsonb_build_array(n, 'user-' || n),
        'kwargs', jsonb_build_object('locale', 'en', 'source', 'signup'),
        'options', jsonb_build_object('retries', 20, 'max_retries', 20, 'traceback', repeat('t', 120),
                                      'trace_context', jsonb_build_object('traceparent', '00-' || md5(n::text) || '-01')),
        'message_id', 'm-' || n,
        'message_timestamp', (extract(epoch FROM failed - interval '1 hour') * 1000)::bigint
    ),
    error_type,
    'the error message of failure ' || n,
    'Traceback (most recent call last):' || repeat(E'\n  File "/app/tasks.py", line 42, in run\n    step()', 9),
    20,
    'retries_exhausted',
    md5(error_type || actor),
    'app.tasks:42 in ' || actor,
    failed - interval '1 hour',
    failed - interval '10 minutes',
    failed,
    'worker-' || mod(n, 4),
    1000 + mod(n, 8)
FROM (
    SELECT n,
           CASE WHEN n BETWEEN %(burst_first)s::bigint AND %(burst_last)s::bigint THEN 'incident'
                WHEN mod(n, %(stride)s::bigint) = 0 THEN 'scattered'
                ELSE 'actor_' || mod(n, 50) END AS actor,
           (ARRAY['ValueError', 'KeyError', 'TimeoutError', 'app.errors.Declined', 'ConnectionResetError',
                  'psycopg.errors.UniqueViolation'])[1 + mod(n, 6)] AS error_type,
           -- the incident: one hour, two days ago; the scattered rows: within the last 6 days (the
           -- 7-day replay age limit refuses none of them); the rest: over 30 days
           now() - make_interval(secs => CASE
               WHEN n BETWEEN %(burst_first)s::bigint AND %(burst_last)s::bigint
                   THEN 172800 - (n - %(burst_first)s::bigint) * 3600.0 / %(burst_size)s::bigint
               WHEN mod(n, %(stride)s::bigint) = 0 THEN mod(n, 500000)
               ELSE mod(n, 2592000) END) AS failed
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS n
) AS g
"""


def log(text: str) -> None:
    print(text, flush=True)


def timed_ms(fn: Any, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return times


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def replay(
    store: PostgresDeadLetterStore, conn: psycopg.Connection[Any], schema_name: str, actor: str
) -> dict[str, Any]:
    """Replay every dead letter of ``actor`` after a checkpoint; return the figures."""
    expected = store.count(where=DeadLetterFilter(actor_name=actor))
    outbox = sql.Identifier(schema_name, "outbox")
    before = (conn.execute(sql.SQL("SELECT count(*) FROM {}").format(outbox)).fetchone() or [0])[0]
    # From a fresh checkpoint every page's first change writes a full-page image to the WAL:
    # the conservative case, and the same for every layout.
    conn.execute("CHECKPOINT")
    marks: list[float] = []
    started = time.perf_counter()
    result = store.replay(
        where=DeadLetterFilter(actor_name=actor), progress=lambda done, total: marks.append(time.perf_counter())
    )
    seconds = time.perf_counter() - started
    after = (conn.execute(sql.SQL("SELECT count(*) FROM {}").format(outbox)).fetchone() or [0])[0]
    assert result.replayed == expected == after - before, (result, expected, after - before)
    batch_ms = [(b - a) * 1000 for a, b in itertools.pairwise(marks)]
    return {
        "replayed": result.replayed,
        "seconds": seconds,
        "rows_per_s": result.replayed / seconds,
        "first_ms": (marks[0] - started) * 1000 if marks else 0.0,
        "batch_ms_median": statistics.median(batch_ms) if batch_ms else 0.0,
    }


def baseline(conn: psycopg.Connection[Any], schema_name: str, rows: int) -> dict[str, Any]:
    """Re-send ``rows`` dead letters one by one with plain Dramatiq (confirmed), marking each row."""
    table = sql.Identifier(schema_name, "dead_letters")
    picked = conn.execute(
        sql.SQL(
            "SELECT id, message FROM {} WHERE actor_name = 'actor_3' AND state = 'dead' ORDER BY id LIMIT %s"
        ).format(table),
        (rows,),
    ).fetchall()
    queue = f"bench_dl_{uuid.uuid4().hex[:8]}"
    broker = RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=True, middleware=[])
    dramatiq.actor(lambda *a, **k: None, actor_name="actor_3", queue_name=queue, broker=broker)
    broker.declare_queue(queue, ensure=True)
    mark = sql.SQL("UPDATE {} SET state = 'replayed', handled_at = now() WHERE id = %s").format(table)
    conn.execute("CHECKPOINT")
    started = time.perf_counter()
    for row_id, fields in picked:
        fields = {**fields, "queue_name": queue, "args": tuple(fields["args"])}
        broker.enqueue(Message(**fields))
        conn.execute(mark, (row_id,))
    seconds = time.perf_counter() - started
    channel = broker.channel
    for name in (queue, dq_name(queue), xq_name(queue)):
        channel.queue_delete(name)
    broker.close()
    return {"replayed": len(picked), "seconds": seconds, "rows_per_s": len(picked) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the table (default 1,000,000)")
    parser.add_argument("--replay", type=int, default=100_000, help="rows replayed per layout (default 100,000)")
    parser.add_argument("--batch", type=int, default=5000, help="replay batch size (default 5000)")
    parser.add_argument("--list-runs", type=int, default=30, help="runs of each listing (default 30)")
    parser.add_argument("--baseline", type=int, default=5000, help="rows re-sent one by one (default 5000)")
    args = parser.parse_args()
    if not 0 < 2 * args.replay <= args.rows:
        parser.error("--replay must be between 1 and half of --rows")

    schema_name = f"bench_dl_{uuid.uuid4().hex[:10]}"
    migrate(DATABASE_URL, schema=schema_name)
    table = sql.Identifier(schema_name, "dead_letters")
    store = PostgresDeadLetterStore(database=DATABASE_URL, schema=schema_name, batch_size=args.batch)
    conn = psycopg.connect(DATABASE_URL, autocommit=True)
    try:
        # Two sets of rows to replay: an incident (one bug, one hour, consecutive rows: what a bulk
        # replay after a fix usually is) and the same number scattered over the whole table.
        burst_first = args.rows // 2
        params = {
            "burst_first": burst_first,
            "burst_last": burst_first + args.replay - 1,
            "burst_size": args.replay,
            "stride": (args.rows - args.replay) // args.replay,
        }
        log(f"schema {schema_name}: filling {args.rows:,} dead letters")
        started = time.perf_counter()
        chunk = 200_000
        for first in range(1, args.rows + 1, chunk):
            last = min(args.rows, first + chunk - 1)
            conn.execute(sql.SQL(FILL).format(table=table), {**params, "first": first, "last": last})
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
        size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size(%s))", (f'"{schema_name}".dead_letters',))
        total_size = (size.fetchone() or ["?"])[0]
        fill_s = time.perf_counter() - started
        log(f"filled in {fill_s:.1f}s; table and indexes {total_size}")

        # 1. Filtered listings, newest first, 50 rows.
        by_actor = DeadLetterFilter(actor_name="actor_7")
        store.list(where=by_actor)  # warm the pool and the cache
        first_page = timed_ms(lambda: store.list(where=by_actor, limit=50), args.list_runs)
        page = store.list(where=by_actor, limit=50)
        deep_cursor = None
        depth = 1
        while page.next_cursor is not None and depth < 21:  # up to 21 pages deep
            deep_cursor = page.next_cursor
            page = store.list(where=by_actor, limit=50, cursor=deep_cursor)
            depth += 1
        deep_page = timed_ms(lambda: store.list(where=by_actor, limit=50, cursor=deep_cursor), args.list_runs)
        now = datetime.datetime.now(datetime.timezone.utc)
        narrow = DeadLetterFilter(actor_name="actor_7", error_type="KeyError", since=now - datetime.timedelta(days=3))
        combined = timed_ms(lambda: store.list(where=narrow, limit=50), args.list_runs)
        unfiltered = timed_ms(lambda: store.list(limit=50), args.list_runs)
        log(
            f"listing (actor filter, 50 rows): first page median {statistics.median(first_page):.2f} ms "
            f"(p95 {p95(first_page):.2f}); page {depth} median {statistics.median(deep_page):.2f} ms; "
            f"actor+error+since median {statistics.median(combined):.2f} ms; "
            f"no filter median {statistics.median(unfiltered):.2f} ms"
        )

        # 2. Bulk replays through the outbox.
        incident = replay(store, conn, schema_name, "incident")
        scattered = replay(store, conn, schema_name, "scattered")
        for name, figures in (("incident (consecutive rows)", incident), ("scattered (1 row in 9)", scattered)):
            log(
                f"replay {name}: {figures['replayed']:,} rows in {figures['seconds']:.2f}s = "
                f"{figures['rows_per_s']:,.0f} rows/s (count + first batch {figures['first_ms']:.0f} ms, "
                f"then {figures['batch_ms_median']:.0f} ms per batch of {args.batch:,})"
            )
        loop = baseline(conn, schema_name, args.baseline)
        log(
            f"baseline, a loop of confirmed Dramatiq sends: {loop['replayed']:,} rows in {loop['seconds']:.2f}s = "
            f"{loop['rows_per_s']:,.0f} rows/s"
        )
        result = {
            "rows": args.rows,
            "replayed": incident["replayed"],
            "replay_rows_per_s": round(incident["rows_per_s"]),
            "replay_scattered_rows_per_s": round(scattered["rows_per_s"]),
            "baseline_rows_per_s": round(loop["rows_per_s"]),
            "ratio_to_baseline": round(incident["rows_per_s"] / loop["rows_per_s"], 1),
            "list_ms": round(statistics.median(first_page), 2),
            "list_ms_p95": round(p95(first_page), 2),
            "list_deep_page_ms": round(statistics.median(deep_page), 2),
            "list_combined_filter_ms": round(statistics.median(combined), 2),
            "list_unfiltered_ms": round(statistics.median(unfiltered), 2),
            "fill_s": round(fill_s, 1),
            "batch": args.batch,
        }
    finally:
        store.close()
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema_name)))
        conn.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
