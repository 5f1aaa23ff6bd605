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
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Callbacks, Middleware
from psycopg import sql
from rabbitmq_nodes import RabbitNode
from support import Rabbit

from dramatiq_reliable import Idempotency, WorkerRelay, job_connection
from dramatiq_reliable.errors import ActorOptionError, ConfigurationError
from dramatiq_reliable.health import collect_health
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
            health = collect_health(database=db, schema=db_schema)
            assert (health.queue(queue_name).long_jobs, health.totals()["long_jobs_expired"]) == (1, 0)
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


class _Skips(Middleware):
    def __init__(self) -> None:
        self.skipped = threading.Event()

    def after_skip_message(self, broker: dramatiq.Broker, message: dramatiq.MessageProxy) -> None:
        self.skipped.set()


def test_a_second_delivery_of_a_message_whose_lease_is_live_is_acked_and_skipped(
    broker: OutboxBroker, queue_name: str, db: psycopg.Connection[Any], db_schema: str, rabbit: Rabbit
) -> None:
    skips = _Skips()
    broker.add_middleware(LongJobs(lease_ms=2000, heartbeat_ms=500))
    broker.add_middleware(skips)
    runs: Counter[str] = Counter()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"long_{queue_name}", long_running=True)
    def long_job() -> None:
        runs["long"] += 1

    message = long_job.message()
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, owner, token, expires_at) "
            "VALUES (%s, %s, %s, %s, 'elsewhere:1:x', 1, now() + interval '1 hour')"
        ).format(sql.Identifier(db_schema, "job_leases")),
        (message.message_id, queue_name, message.actor_name, message.encode()),
    )
    db.commit()
    RabbitmqBroker.enqueue(broker, message)  # a copy RabbitMQ delivers while another worker runs the job
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        assert skips.skipped.wait(10), "the copy was not skipped"
    finally:
        worker.stop(timeout=10_000)
    assert runs["long"] == 0
    assert [job["owner"] for job in leased_jobs(db, db_schema)] == ["elsewhere:1:x"]
    assert rabbit.count(queue_name) == 0, "the skipped copy was not acked"


def test_under_transactional_idempotency_the_lease_ends_in_the_jobs_transaction(
    broker: OutboxBroker, queue_name: str, db: psycopg.Connection[Any], db_schema: str, monkeypatch: Any
) -> None:
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(LongJobs(lease_ms=2000, heartbeat_ms=500), after=Idempotency)
    broker.add_middleware(WorkerRelay(poll_interval_ms=50))
    # As if the worker died right after the job's commit: the release after the ack never comes.
    monkeypatch.setattr(LongJobs, "_release", lambda self, message: None)
    effects = sql.Identifier(db_schema, "effects")
    db.execute(sql.SQL("CREATE TABLE {} (n int)").format(effects))
    db.commit()
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"long_{queue_name}", long_running=True)
    def long_job() -> None:
        job_connection().execute(sql.SQL("INSERT INTO {} VALUES (1)").format(effects))
        release.wait(10)

    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    worker.start()
    try:
        long_job.send()
        wait_for(lambda: leased_jobs(db, db_schema), message="the long job holds a lease")
        release.set()
        wait_for(
            lambda: db.execute(sql.SQL("SELECT count(*) FROM {}").format(effects)).fetchone() == (1,),
            message="the job committed",
        )
        assert not leased_jobs(db, db_schema), "the lease outlived the job's commit"
    finally:
        release.set()
        worker.stop(timeout=10_000)


def test_an_actor_longer_than_the_consumer_timeout_is_warned_about_unless_it_runs_under_a_lease(
    rabbitmq_url: str, database_url: str, db_schema: str, queue_name: str, caplog: Any
) -> None:
    plain = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, consumer_timeout_ms=1000)
    leased = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema, consumer_timeout_ms=1000)
    long_jobs = LongJobs()
    leased.add_middleware(long_jobs)
    try:
        with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.outbox"):
            dramatiq.actor(lambda: None, broker=plain, queue_name=queue_name, actor_name="slow", time_limit=5000)
            assert "longer than RabbitMQ's consumer_timeout (1000 ms)" in caplog.text
            assert "add LongJobs()" in caplog.text
            caplog.clear()
            slow = dramatiq.actor(
                lambda: None, broker=leased, queue_name=queue_name, actor_name="slow", time_limit=5000
            )
            quick = dramatiq.actor(
                lambda: None, broker=leased, queue_name=queue_name, actor_name="quick", time_limit=500
            )
            assert not caplog.text
        assert long_jobs.is_long_running(leased, slow)  # automatic: its time limit is over the timeout
        assert not long_jobs.is_long_running(leased, quick)
    finally:
        plain.close()
        leased.close()


def test_long_jobs_refuses_a_postgres_broker(pg_broker: Any) -> None:
    pg_broker.add_middleware(LongJobs())
    with pytest.raises(ActorOptionError, match="PostgresBroker already holds running jobs under a lease"):
        dramatiq.actor(lambda: None, broker=pg_broker, actor_name="job", long_running=True)


def test_without_the_lease_table_a_long_job_still_runs_on_its_delivery_with_a_warning(
    broker: OutboxBroker, queue_name: str, db_schema: str, rabbit: Rabbit, caplog: Any
) -> None:
    broker.add_middleware(LongJobs(schema=f"{db_schema}_never_migrated"))  # a schema never created
    ran = threading.Event()

    @dramatiq.actor(broker=broker, queue_name=queue_name, actor_name=f"long_{queue_name}", long_running=True)
    def long_job() -> None:
        ran.set()

    RabbitmqBroker.enqueue(broker, long_job.message())
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.outbox"):
        worker.start()
        try:
            assert ran.wait(10), "the job did not run"
        finally:
            worker.stop(timeout=10_000)
    assert "runs without a lease: SchemaNotReady" in caplog.text
    assert rabbit.count(queue_name) == 0, "the delivery was not acked after the job"
