"""Jobs longer than RabbitMQ's consumer_timeout: run once under a Postgres lease, others never stalled.

The node the tests start closes a channel whose delivery stays unacked for ~3 s; a job of three
times that, on a broker without ``LongJobs``, is delivered again to the worker's other thread
while it still runs.  With ``LongJobs`` the delivery is acked as the job starts and the lease in
Postgres holds it instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from rabbitmq_nodes import RabbitNode

from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.outbox import LongJobs, OutboxBroker
from dramatiq_reliable.outbox.long_jobs import leased_jobs, reap_expired_leases
from dramatiq_reliable.testing import drain_outbox, wait_for

pytestmark = pytest.mark.integration

#: Three times the test node's consumer_timeout.
LONG_JOB_S = 9.0


@pytest.fixture
def long_broker(rabbitmq_short_timeout_node: RabbitNode, database_url: str, db_schema: str) -> Iterator[OutboxBroker]:
    broker = OutboxBroker(
        url=rabbitmq_short_timeout_node.url, database=database_url, schema=db_schema, consumer_timeout_ms=3000
    )
    broker.add_middleware(LongJobs(lease_ms=2000, heartbeat_ms=500))
    yield broker
    broker.close()


def test_a_job_three_times_the_consumer_timeout_runs_once_and_other_messages_are_not_stalled(
    long_broker: OutboxBroker, queue_name: str, db: psycopg.Connection[Any], db_schema: str, caplog: Any
) -> None:
    runs: Counter[str] = Counter()
    long_done = threading.Event()

    @dramatiq.actor(broker=long_broker, queue_name=queue_name, actor_name=f"long_{queue_name}", long_running=True)
    def long_job() -> None:
        runs["long"] += 1
        # The job's own work: nothing to wait for but the time it takes.
        time.sleep(LONG_JOB_S)
        long_done.set()

    @dramatiq.actor(broker=long_broker, queue_name=queue_name, actor_name=f"quick_{queue_name}")
    def quick(n: int) -> None:
        runs["quick"] += 1

    worker = dramatiq.Worker(long_broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        with caplog.at_level(logging.WARNING):
            long_job.send()
            drain_outbox(long_broker)
            wait_for(lambda: runs["long"] == 1, message="the long job started")
            wait_for(lambda: leased_jobs(db, db_schema), message="the long job holds a lease")
            for n in range(5):
                quick.send(n)
            drain_outbox(long_broker)
            wait_for(lambda: runs["quick"] == 5, message="the quick messages ran beside the long job")
            assert not long_done.is_set(), "the quick messages waited for the long job"

            assert long_done.wait(LONG_JOB_S + 10), "the long job ended"
            wait_for(lambda: not leased_jobs(db, db_schema), message="the lease ended with the job")
            # A redelivered copy would have reached the idle thread by now (the channel closes
            # ~3-4 s into an unacked job); none came.
            assert runs["long"] == 1
            assert not [r for r in caplog.records if "connection error" in r.getMessage()], "a channel was closed"
    finally:
        worker.stop(timeout=20_000)


def test_a_lease_that_ran_out_goes_back_to_the_outbox_once(
    long_broker: OutboxBroker, queue_name: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    @dramatiq.actor(broker=long_broker, queue_name=queue_name, actor_name=f"long_{queue_name}", long_running=True)
    def long_job() -> None:
        pass

    message = long_job.message()
    leases = sql.Identifier(db_schema, "job_leases")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, owner, token, expires_at) "
            "VALUES (%s, %s, %s, %s, 'gone:1:x', 1, now() - interval '1 second')"
        ).format(leases),
        (message.message_id, queue_name, message.actor_name, message.encode()),
    )
    db.commit()

    assert reap_expired_leases(db, db_schema) == 1
    assert reap_expired_leases(db, db_schema) == 0
    rows = db.execute(
        sql.SQL("SELECT message_id, queue_name FROM {} WHERE published_at IS NULL").format(
            sql.Identifier(db_schema, "outbox")
        )
    ).fetchall()
    assert rows == [(message.message_id, queue_name)]
    assert not leased_jobs(db, db_schema)


def test_a_heartbeat_slower_than_half_the_lease_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at most half of lease_ms"):
        LongJobs(lease_ms=2000, heartbeat_ms=1500)
