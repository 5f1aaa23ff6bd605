"""Jobs by id: what the failure record costs a worker that does not fail, and how fast `jobs show` is.

    python benchmarks/job_lifecycle.py [--jobs 2000] [--rounds 3] [--rows 100000] [--lookups 50]

1. ``failure_record_ratio``: a ``PostgresBroker`` worker (8 threads, ``Idempotency``
   transactional, a one-INSERT actor) drains ``--jobs`` messages that all succeed, with
   ``ClassifiedRetries(record_failures=True)`` and with ``record_failures=False``, the two
   interleaved round by round so machine noise hits both alike; the ratio is the median rate on
   over the median rate off (the baseline, measured in the same run).  Nothing should be
   written on the happy path, so about 1.0 is expected (>= 0.97).
2. ``show_ms``: ``--rows`` rows in each table ``show_job`` reads (outbox, queue, job_attempts,
   processed_jobs over 20 actors, dead_letters, job_leases), loaded with ``generate_series`` and
   analysed; then the median (and p95) of ``--lookups`` lookups of a message that only a
   published outbox row knows (every reader runs: the slowest answer), of an idempotency key,
   and of an unknown id.  The issue's figure is 1M rows a table (``--rows 1000000``); loading it
   takes minutes here, so the default is 100k.
3. ``dedupe_send_ratio``: committed sends with a dedupe key against the same sends without, on
   ``OutboxBroker`` (and ``_queue`` on ``PostgresBroker``): ``benchmarks/dedupe.py``'s run with
   its defaults, whose docstring says how (target >= 0.9).

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dedupe import measure as measure_dedupe
from dedupe import parse_args as dedupe_args
from psycopg import sql

from dramatiq_reliable import ClassifiedRetries, Idempotency, PostgresBroker, build_middleware, migrate, show_job
from dramatiq_reliable.idempotency import job_connection

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
THREADS = 8


def log(text: str) -> None:
    print(text, flush=True)


def _drop(schema: str) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def drain_rate(*, record: bool, jobs: int) -> float:
    """Jobs/s of one worker draining ``jobs`` succeeding messages, from first to last effect."""
    schema = f"bench_jobs_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    effects = sql.Identifier(schema, "effects")
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (n int, at timestamptz DEFAULT clock_timestamp())").format(effects))
    broker = PostgresBroker(
        database=DATABASE_URL,
        schema=schema,
        pool_max_size=THREADS + 4,
        middleware=build_middleware(retries=ClassifiedRetries(record_failures=record), middleware=[Idempotency()]),
    )
    dramatiq.set_broker(broker)
    queue = f"jobs_{uuid.uuid4().hex[:8]}"
    insert = sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(effects)

    @dramatiq.actor(queue_name=queue, actor_name=f"{queue}_work", broker=broker)
    def work(n: int) -> None:
        job_connection().execute(insert, (n,))

    try:
        with broker.transaction():
            for n in range(jobs):
                work.send(n)
        worker = dramatiq.Worker(broker, worker_threads=THREADS, worker_timeout=100)
        worker.start()
        try:
            broker.join(queue, timeout=600_000)
        finally:
            worker.stop()
        with psycopg.connect(DATABASE_URL) as conn:
            row = conn.execute(
                sql.SQL("SELECT count(*), extract(epoch FROM max(at) - min(at)) FROM {}").format(effects)
            ).fetchone()
        assert row is not None
        assert row[0] == jobs, row
        return (jobs - 1) / float(row[1])
    finally:
        broker.close()
        _drop(schema)


_LOAD = (
    # The outbox: every row published (the slowest answer: every reader runs before the last).
    "INSERT INTO {schema}.outbox (message_id, queue_name, actor_name, body, published_at) "
    "SELECT 'o-' || i, 'q', 'a', '\\x7b7d', now() FROM generate_series(1, %(rows)s) AS i",
    "INSERT INTO {schema}.queue (queue_name, message_id, actor_name, body) "
    "SELECT 'q', 'q-' || i, 'a', '\\x7b7d' FROM generate_series(1, %(rows)s) AS i",
    "INSERT INTO {schema}.job_attempts (message_id, queue_name, actor_name, attempts, outcome, expires_at) "
    "SELECT 'f-' || i, 'q', 'a', 1, 'retry', now() + interval '1 day' FROM generate_series(1, %(rows)s) AS i",
    "INSERT INTO {schema}.processed_jobs (actor_name, job_key, payload_hash, message_id, expires_at) "
    "SELECT 'actor_' || (i %% 20), 'k-' || i, '\\x00', 'p-' || i, now() + interval '1 day' "
    "FROM generate_series(1, %(rows)s) AS i",
    "INSERT INTO {schema}.dead_letters (message_id, queue_name, actor_name, message, reason, fingerprint, sent_at, "
    "first_failed_at, last_failed_at, worker_host, worker_pid) "
    "SELECT 'd-' || i, 'q', 'a', '{{}}', 'bench', 'fp', now(), now(), now(), 'h', 1 FROM generate_series(1, %(rows)s) AS i",
    "INSERT INTO {schema}.job_leases (message_id, queue_name, actor_name, body, owner, token, expires_at) "
    "SELECT 'l-' || i, 'q', 'a', '\\x7b7d', 'o', i, now() + interval '1 hour' FROM generate_series(1, %(rows)s) AS i",
)


def show_timings(*, rows: int, lookups: int) -> dict[str, Any]:
    schema = f"bench_show_{uuid.uuid4().hex[:8]}"
    migrate(DATABASE_URL, schema=schema)
    try:
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            started = time.perf_counter()
            for statement in _LOAD:
                conn.execute(sql.SQL(statement).format(schema=sql.Identifier(schema)), {"rows": rows})
            for table in ("outbox", "queue", "job_attempts", "processed_jobs", "dead_letters", "job_leases"):
                conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, table)))
            log(f"loaded {rows} rows into each of 6 tables in {time.perf_counter() - started:.1f}s")
            middle = rows // 2
            cases = {"published": f"o-{middle}", "key": f"k-{middle}", "unknown": "no-such-job"}
            result: dict[str, Any] = {}
            for name, job_id in cases.items():
                times = []
                for _ in range(lookups):
                    start = time.perf_counter()
                    with contextlib.suppress(LookupError):
                        show_job(conn, schema, job_id)
                    times.append((time.perf_counter() - start) * 1000)
                times.sort()
                result[name] = {
                    "median_ms": round(statistics.median(times), 2),
                    "p95_ms": round(times[int(len(times) * 0.95) - 1], 2),
                }
            return result
    finally:
        _drop(schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=50)
    args = parser.parse_args()

    rates: dict[str, list[float]] = {"on": [], "off": []}
    for round_number in range(args.rounds):
        # Alternate which goes first, so a warming cache favours neither.
        order = ("on", "off") if round_number % 2 == 0 else ("off", "on")
        for label in order:
            rate = drain_rate(record=label == "on", jobs=args.jobs)
            rates[label].append(rate)
            log(f"round {round_number + 1}: record_failures {label}: {rate:.0f} jobs/s")
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    shown = show_timings(rows=args.rows, lookups=args.lookups)
    deduped = measure_dedupe(dedupe_args([]))
    result = {
        "failure_record_ratio": round(on / off, 3),
        "rate_record_on": round(on, 1),
        "rate_record_off_baseline": round(off, 1),
        "rates_on": [round(rate, 1) for rate in rates["on"]],
        "rates_off": [round(rate, 1) for rate in rates["off"]],
        "show_ms": shown["published"]["median_ms"],
        "show": shown,
        "dedupe_send_ratio": deduped["dedupe_send_ratio"],
        "dedupe": deduped,
        "rows_per_table": args.rows,
        "jobs": args.jobs,
        "threads": THREADS,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
