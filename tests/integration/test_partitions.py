"""Partitioned history of published outbox rows: made ahead, dropped behind, nothing unexpired lost."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import ConfigurationError, OutboxBroker, PostgresBroker, Relay, partitions
from dramatiq_reliable.cli import main
from dramatiq_reliable.doctor import diagnose
from dramatiq_reliable.jobs import show_job
from dramatiq_reliable.testing import drain_outbox

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


def _published(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NOT NULL").format(sql.Identifier(schema, table))
    row = db.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def _seed(db: psycopg.Connection[Any], schema: str, *, published_hours: int, waiting: int) -> None:
    """One published row per hour of age from 1 to ``published_hours`` hours ago, and ``waiting`` unpublished rows."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, published_at) "
            "SELECT 'old-' || n, 'q', 'a', 'x', now() - n * interval '1 hour' + interval '1 minute' "
            "FROM generate_series(1, %(n)s) AS n"
        ).format(sql.Identifier(schema, "outbox")),
        {"n": published_hours},
    )
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body) "
            "SELECT 'new-' || n, 'q', 'a', 'x' FROM generate_series(1, %(n)s) AS n"
        ).format(sql.Identifier(schema, "outbox")),
        {"n": waiting},
    )


def test_enable_makes_partitions_ahead_and_moves_the_published_rows_within_retention(database_url, db, db_schema):
    _seed(db, db_schema, published_hours=10, waiting=3)
    status = partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=2, retention_ms=6 * HOUR_MS)
    now = dt.datetime.now(dt.timezone.utc)
    assert status.enabled
    assert status.covered_until is not None and status.covered_until >= now + dt.timedelta(hours=2)
    assert status.partitions[0].lower <= now - dt.timedelta(hours=6)
    # Rows a partition holds (published from the oldest partition's lower bound on) are moved;
    # older ones stay for the row purge, which deletes them as before.  That is rows 1..6 hours
    # old, and the 7-hour-old one too when enable ran in an hour's last minute (the oldest
    # partition starts on the hour before the retention horizon).
    held = db.execute(
        sql.SQL(
            "SELECT count(*) FROM (SELECT published_at FROM {} UNION ALL SELECT published_at FROM {}) AS r "
            "WHERE published_at >= %s"
        ).format(sql.Identifier(db_schema, "outbox"), sql.Identifier(db_schema, "outbox_published")),
        (status.partitions[0].lower,),
    ).fetchone()
    assert held is not None and held[0] in (6, 7)
    assert status.moved == held[0]
    assert _published(db, db_schema, "outbox_published") == held[0]
    assert _published(db, db_schema, "outbox") == 10 - held[0]
    waiting = db.execute(
        sql.SQL("SELECT count(*) FROM {}.outbox WHERE published_at IS NULL").format(sql.Identifier(db_schema))
    ).fetchone()
    assert waiting == (3,)


def test_maintain_drops_only_partitions_past_retention(database_url, db, db_schema):
    _seed(db, db_schema, published_hours=8, waiting=0)
    partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=1, retention_ms=8 * HOUR_MS)
    unexpired = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at > now() - interval '3 hours'").format(
            sql.Identifier(db_schema, "outbox_published")
        )
    ).fetchone()
    # Shorter retention: the partitions wholly older than 3 hours go, nothing younger does.
    status = partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=1, retention_ms=3 * HOUR_MS)
    assert status.dropped
    assert partitions.maintain(database_url, schema=db_schema).dropped == ()
    cut = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=3)
    assert all(p.upper > cut for p in status.partitions)
    still = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE published_at > now() - interval '3 hours'").format(
            sql.Identifier(db_schema, "outbox_published")
        )
    ).fetchone()
    assert still == unexpired and still is not None and still[0] >= 2
    oldest = db.execute(
        sql.SQL("SELECT min(published_at) FROM {}").format(sql.Identifier(db_schema, "outbox_published"))
    ).fetchone()
    assert oldest is not None and oldest[0] >= cut - dt.timedelta(hours=1)
    tables = db.execute(
        "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename = ANY(%s)",
        (db_schema, list(status.dropped)),
    ).fetchone()
    assert tables == (0,)
    with pytest.raises(ConfigurationError, match="enable again with the same interval_ms"):
        partitions.enable(database_url, schema=db_schema, interval_ms=2 * HOUR_MS)


def test_the_relay_moves_what_it_publishes_and_jobs_show_still_finds_it(
    database_url, db, db_schema, broker: OutboxBroker, queue_name, rabbit
):
    partitions.enable(database_url, schema=db_schema)
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    messages = [task.send(i) for i in range(5)]
    assert drain_outbox(broker) == 5
    assert rabbit.count(queue_name) == 5
    assert _published(db, db_schema, "outbox") == 0
    assert _published(db, db_schema, "outbox_published") == 5
    assert show_job(database_url, db_schema, messages[0].message_id).state == "published_no_news"
    # The doctor's relay heartbeat reads the newest publish from the history too.
    relay = next(f for f in diagnose(database_url, schema_name=db_schema) if f.check == "relay")
    assert relay.details["last_published_at"] is not None


def test_a_relay_that_maintained_the_partitions_moves_rows_itself_while_a_partition_covers_now(
    database_url, db, db_schema, broker: OutboxBroker, queue_name, rabbit
):
    partitions.enable(database_url, schema=db_schema)
    # Without the trigger, only the relay's own statement can move the rows.
    db.execute(sql.SQL("DROP TRIGGER outbox_move_published ON {}").format(sql.Identifier(db_schema, "outbox")))
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    relay = Relay.from_broker(broker)
    try:
        relay.purge()  # what every relay runs each purge_interval_ms: it learns partitions are on
        for i in range(3):
            task.send(i)
        assert relay.drain() == 3
        assert _published(db, db_schema, "outbox") == 0
        assert _published(db, db_schema, "outbox_published") == 3
        # Past the newest partition the relay marks in place instead of failing its batch.
        db.execute(
            sql.SQL("UPDATE {} SET covered_until = now() - interval '1 hour'").format(
                sql.Identifier(db_schema, "partitioned_tables")
            )
        )
        task.send(3)
        assert relay.drain() == 1
        assert _published(db, db_schema, "outbox") == 1
    finally:
        relay.publisher.close()
    assert rabbit.count(queue_name) == 4


def test_a_relay_whose_maintenance_fails_keeps_publishing_and_marks_in_place(
    database_url, db, db_schema, broker: OutboxBroker, queue_name, rabbit, caplog
):
    partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=1, retention_ms=HOUR_MS)
    newest = partitions.partition_status(database_url, schema=db_schema).partitions[-1]
    db.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(db_schema, newest.name)))
    # A table of that name that cannot be attached: every maintenance now fails.
    db.execute(sql.SQL("CREATE TABLE {} (id text)").format(sql.Identifier(db_schema, newest.name)))
    task = dramatiq.actor(lambda n: None, actor_name=f"{queue_name}_a", queue_name=queue_name, broker=broker)
    relay = Relay.from_broker(broker)
    try:
        relay.purge()
        assert "partition maintenance of schema" in caplog.text
        task.send(1)
        assert relay.drain() == 1
    finally:
        relay.publisher.close()
    assert rabbit.count(queue_name) == 1


def test_rows_marked_with_no_partition_stay_in_the_outbox_until_maintenance_moves_them(database_url, db, db_schema):
    partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=1, retention_ms=HOUR_MS)
    for info in partitions.partition_status(database_url, schema=db_schema).partitions:
        db.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(db_schema, info.name)))
    _seed(db, db_schema, published_hours=0, waiting=4)
    # The relay's mark must not fail for want of a partition: the rows stay, marked.
    db.execute(sql.SQL("UPDATE {} SET published_at = now()").format(sql.Identifier(db_schema, "outbox")))
    assert _published(db, db_schema, "outbox") == 4
    status = partitions.maintain(database_url, schema=db_schema)
    assert status.created and status.moved == 4 and status.left_in_outbox == 0
    assert _published(db, db_schema, "outbox_published") == 4


def test_doctor_fails_when_no_partition_covers_now_and_is_happy_after_maintenance(database_url, db, db_schema):
    def finding() -> Any:
        return next(f for f in diagnose(database_url, schema_name=db_schema) if f.check == "partitions")

    assert finding().severity == "ok" and "not enabled" in finding().summary
    assert partitions.maintain(database_url, schema=db_schema).enabled is False
    partitions.enable(database_url, schema=db_schema, interval_ms=HOUR_MS, ahead=2, retention_ms=HOUR_MS)
    assert finding().severity == "ok"
    for info in partitions.partition_status(database_url, schema=db_schema).partitions:
        db.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(db_schema, info.name)))
    broken = finding()
    assert broken.severity == "fail" and "partitions maintain" in broken.fix
    partitions.maintain(database_url, schema=db_schema)
    assert finding().severity == "ok"


def test_postgres_broker_runs_jobs_on_a_schema_with_partitions_enabled(database_url, db_schema):
    partitions.enable(database_url, schema=db_schema)
    broker = PostgresBroker(database=database_url, schema=db_schema)
    dramatiq.set_broker(broker)
    done: list[int] = []
    job = dramatiq.actor(done.append, actor_name="p26_job", queue_name=f"p26_{db_schema}"[:40], broker=broker)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    try:
        for n in range(5):
            job.send(n)
        worker.start()
        broker.join(job.queue_name, timeout=10_000)
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert sorted(done) == list(range(5))


def test_cli_enables_shows_and_refuses_a_zero_interval(database_url, db_schema, capsys):
    common = ["--database-url", database_url, "--schema", db_schema]
    assert main(["partitions", "enable", "--interval", "0", *common]) == 2
    assert "interval_ms must be" in capsys.readouterr().err
    assert main(["partitions", "enable", "--interval", "6h", "--retention", "1d", "--json", *common]) == 0
    enabled = json.loads(capsys.readouterr().out)
    assert enabled["interval_ms"] == 6 * HOUR_MS and enabled["partitions"]
    assert main(["partitions", "status", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["partitions"] == enabled["partitions"]
    assert main(["partitions", "disable", *common]) == 0
    capsys.readouterr()
    assert main(["partitions", "status", *common]) == 0
    assert "not enabled" in capsys.readouterr().out
