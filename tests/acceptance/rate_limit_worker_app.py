"""A worker process for the rate-limit acceptance tests: a PostgresBroker worker with ``RateLimits``.

Every run of ``call`` records its start time (Postgres' clock, one clock for every process) and
this process's pid in ``calls``; a run of ``call`` with ``n < 0`` then fails as a provider's
HTTP 429 with ``Retry-After: RETRY_AFTER`` seconds, once.
"""

from __future__ import annotations

import os
from typing import Any

import dramatiq
import psycopg
from psycopg import sql
from worker_apps import run_until_stdin_closes

from dramatiq_reliable import ClassifiedRetries, PostgresBroker, build_middleware
from dramatiq_reliable.flow import RateLimit, RateLimits

DATABASE_URL, SCHEMA, QUEUE = os.environ["DATABASE_URL"], os.environ["SCHEMA"], os.environ["QUEUE"]
RATE, BURST = int(os.environ["RATE"]), int(os.environ["BURST"])
limits = RateLimits([RateLimit("api", per_second=RATE, burst=BURST, slow_factor=1)])
broker = PostgresBroker(
    database=DATABASE_URL,
    schema=SCHEMA,
    lease_ms=5000,
    # Idle consumers poll at least this often, so both processes race for every postponed job
    # as it falls due (with the default 250 ms the busy one, probing fast, takes nearly all).
    poll_interval_ms=20,
    middleware=build_middleware(retries=ClassifiedRetries(max_retries=0), middleware=[limits]),
)
dramatiq.set_broker(broker)
CALLS = sql.Identifier(SCHEMA, "calls")


class TooManyRequests(Exception):
    """What an HTTP client raises for a 429: a status and the response's headers."""

    status_code = 429

    def __init__(self, retry_after: str) -> None:
        super().__init__(f"429 Too Many Requests (Retry-After: {retry_after})")
        self.headers = {"Retry-After": retry_after}


@dramatiq.actor(queue_name=QUEUE, actor_name="call", rate_limit=lambda n, **_: "api:shared")
def call(n: int, **_: Any) -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} (n, pid) VALUES (%s, %s)").format(CALLS), (n, os.getpid()))
    if n < 0:
        raise TooManyRequests(os.environ.get("RETRY_AFTER", "2"))


if __name__ == "__main__":
    run_until_stdin_closes(broker, threads=4)
