"""Rate limits on real Postgres: the bucket rows, what status, the health reading and the web page show,
and postponement through the outbox."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Callbacks, CurrentMessage, SkipMessage
from psycopg import sql
from starlette.testclient import TestClient

from dramatiq_reliable import Idempotency, WorkerRelay
from dramatiq_reliable.cli.status import render_table
from dramatiq_reliable.flow import RateLimit, RateLimits, limited_keys
from dramatiq_reliable.flow.middleware import LATE_KEY, SLOT_KEY
from dramatiq_reliable.flow.rate_limit import pause, take
from dramatiq_reliable.health import collect_health
from dramatiq_reliable.testing import wait_for
from dramatiq_reliable.web import create_app

pytestmark = pytest.mark.integration

LIMIT = RateLimit("mailer", per_second=10, burst=2)
API = RateLimit("api", per_second=10)


@pytest.fixture
def conn(database_url: str, db_schema: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        yield connection


def test_a_take_grants_the_burst_then_reserves_one_step_apart(conn: psycopg.Connection[Any], db_schema: str) -> None:
    takes = [take(conn, db_schema, LIMIT, "mailer:a") for _ in range(5)]
    assert [t.granted for t in takes] == [True, True, False, False, False]
    slots = [t.slot_ms for t in takes[2:]]
    assert [b - a for a, b in itertools.pairwise(slots)] == [100, 100]  # 10/s: one token per 100 ms
    assert 0 < takes[2].wait_ms <= 100
    (state,) = limited_keys(conn, db_schema)
    assert (state.key, state.waiting, state.granted, state.postponed) == ("mailer:a", 3, 2, 3)
    assert state.paused_until_ms is None
    assert take(conn, db_schema, LIMIT, "mailer:b").granted  # another key has its own bucket


def test_a_pause_holds_every_take_until_it_ends_and_status_shows_it(
    conn: psycopg.Connection[Any], db_schema: str, database_url: str
) -> None:
    take(conn, db_schema, LIMIT, "mailer:a")
    pause(conn, db_schema, LIMIT, "mailer:a", pause_ms=5_000, status=429, message_id="m-1")
    pause(conn, db_schema, LIMIT, "mailer:a", pause_ms=1_000, status=429, message_id="m-2")  # never shortens
    held = take(conn, db_schema, LIMIT, "mailer:a")
    assert not held.granted and held.paused
    assert 4_000 < held.wait_ms <= 5_000
    (state,) = limited_keys(conn, db_schema)
    assert state.paused_status == 429 and state.slow_factor == 0.5
    assert state.waiting == 1
    health = collect_health(database=database_url, schema=db_schema, discover_queues=False)
    assert [item.key for item in health.rate_limits] == ["mailer:a"]
    assert health.as_dict()["rate_limits"][0]["paused_status"] == 429
    table = render_table(health)
    assert "rate limit 'mailer:a' (10/s, burst 2): paused by a 429 until " in table
    assert "1 job waiting" in table


def test_the_web_page_lists_the_limited_keys(conn: psycopg.Connection[Any], db_schema: str, database_url: str) -> None:
    app = create_app(database_url, schema=db_schema)
    with TestClient(app, client=("127.0.0.1", 50000), base_url="http://localhost") as client:
        assert "No key is limited now" in client.get("/rate-limits").text
        pause(conn, db_schema, LIMIT, "mailer:a", pause_ms=60_000, status=503, message_id="m-1")
        page = client.get("/rate-limits")
    assert page.status_code == 200
    assert 'data-key="mailer:a"' in page.text
    assert "(503)" in page.text


def test_on_an_outbox_broker_jobs_without_a_token_are_postponed_through_the_outbox_not_retried(
    broker: Any, queue_name: str, worker: Any, seen: list[Any]
) -> None:
    # hold_ms=0: no token is waited for in a thread, every wait goes through the outbox.
    broker.add_middleware(RateLimits([RateLimit("api", per_second=10)], hold_ms=0), before=Callbacks)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    broker.add_middleware(CurrentMessage())
    runs: list[tuple[float, int, int]] = []

    @dramatiq.actor(queue_name=queue_name, broker=broker, rate_limit="api", max_retries=0)
    def call(n: int) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        runs.append((time.monotonic(), message.options.get("retries", 0), n))

    worker.start()
    with broker.transaction():
        for n in range(6):
            call.send(n)
    wait_for(lambda: len(runs) >= 6, timeout_ms=15_000, message="the six calls did not all run")
    assert sorted(n for _, _, n in runs) == list(range(6))  # each once: postponed, not lost nor doubled
    assert all(retries == 0 for _, retries, _ in runs)  # a postponement is no retry
    times = sorted(at for at, _, _ in runs)
    assert times[-1] - times[0] >= 0.5 - 0.05  # 6 calls at 10/s, burst 1: half a second at least
    postponed = [e for e in seen if e.name == "rate_limit.postponed"]
    assert postponed and {e.key for e in postponed} == {"api"}


def _proxy_with_slot(actor: Any, at_ms: int) -> MessageProxy:
    proxy = MessageProxy(actor.message(1))
    proxy.options[SLOT_KEY] = {"key": "api", "at_ms": at_ms}
    return proxy


def test_a_job_that_reserved_a_token_inside_a_later_pause_does_not_call_during_it(
    pg_broker: Any, conn: psycopg.Connection[Any], db_schema: str
) -> None:
    limits = RateLimits([API], hold_ms=0)
    pg_broker.add_middleware(limits)
    actor = dramatiq.actor(lambda n: None, actor_name="api_call", broker=pg_broker, rate_limit="api")
    now_ms = int(time.time() * 1000)
    pause(conn, db_schema, API, "api", pause_ms=5_000, status=429, message_id="m-1")
    with pytest.raises(SkipMessage, match=r"rate limit 'api': no token; the message was postponed by \d+ ms"):
        limits.before_process_message(pg_broker, _proxy_with_slot(actor, now_ms))
    (state,) = limited_keys(conn, db_schema)
    assert state.paused_until_ms is not None
    assert state.waiting == 1  # it took a token after the pause instead


def test_a_job_back_far_too_late_for_its_token_takes_a_new_one_once_then_runs(
    pg_broker: Any, conn: psycopg.Connection[Any], db_schema: str
) -> None:
    limits = RateLimits([API], hold_ms=0)
    pg_broker.add_middleware(limits)
    actor = dramatiq.actor(lambda n: None, actor_name="api_call", broker=pg_broker, rate_limit="api")
    for _ in range(3):  # the bucket is busy: a new take is postponed
        take(conn, db_schema, API, "api")
    stale = int(time.time() * 1000) - 2_000
    first = _proxy_with_slot(actor, stale)
    with pytest.raises(SkipMessage):
        limits.before_process_message(pg_broker, first)  # late: its old token would bunch, a new one is due
    assert first.options[LATE_KEY] is True
    again = _proxy_with_slot(actor, stale)
    again.options[LATE_KEY] = True
    limits.before_process_message(pg_broker, again)  # late twice: it runs rather than wait for ever
    assert LATE_KEY not in again.options


def test_a_redelivery_of_a_job_already_done_takes_no_token(
    pg_broker: Any, conn: psycopg.Connection[Any], db_schema: str
) -> None:
    limits = RateLimits([API], hold_ms=0)
    idempotency = Idempotency(default_mode="transactional")
    pg_broker.add_middleware(limits)
    pg_broker.add_middleware(idempotency)
    actor = dramatiq.actor(lambda n: None, actor_name="api_call", broker=pg_broker, rate_limit="api")
    done = MessageProxy(actor.message(1))
    limits.before_process_message(pg_broker, done)
    idempotency.before_process_message(pg_broker, done)
    idempotency.after_process_message(pg_broker, done, result=None)  # its key commits: it is done

    def granted() -> int:
        row = conn.execute(
            sql.SQL("SELECT granted FROM {} WHERE key = 'api'").format(sql.Identifier(db_schema, "rate_limit_buckets"))
        ).fetchone()
        assert row is not None
        return int(row[0])

    assert granted() == 1
    limits.before_process_message(pg_broker, MessageProxy(done._message))  # redelivered
    assert granted() == 1, "the duplicate took a token"
    with pytest.raises(SkipMessage, match="postponed"):  # a new job still takes one (the burst is 1)
        limits.before_process_message(pg_broker, MessageProxy(actor.message(2)))
    with pytest.raises(SkipMessage):  # and Idempotency skips the duplicate unrun
        idempotency.before_process_message(pg_broker, MessageProxy(done._message))
