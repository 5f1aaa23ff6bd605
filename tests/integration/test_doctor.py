"""The doctor finds each problem a test creates for real, and a healthy deployment reads all ok."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from pgbouncer import pgbouncer
from psycopg import sql
from support import closed_port, proxied

from dramatiq_reliable import _sql, schema
from dramatiq_reliable.cli import ExitCode, main
from dramatiq_reliable.doctor import CHECKS, Finding, Thresholds, _expected_indexes, diagnose
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration

# A healthy role's bounds: the server's default idle_in_transaction_session_timeout (0) is a
# finding of its own, so the healthy deployment sets one, as the docs advise.
_HEALTHY = {"idle_in_transaction_session_timeout": "600000"}


# Every test builds the deployment it checks (settings through libpq ``options``, a PgBouncer of
# its own in either mode) on Postgres itself: ``direct_database_url``, also under THROUGH_PGBOUNCER=1.


def with_settings(url: str, **settings: str) -> str:
    """``url`` whose sessions start with ``settings`` (libpq's ``options=-c name=value``)."""
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{url}{'&' if '?' in url else '?'}options={quote(options)}"


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {finding.check: finding for finding in findings}


@pytest.fixture
def healthy_url(direct_database_url: str) -> str:
    return with_settings(direct_database_url, **_HEALTHY)


def _outbox_row(db: psycopg.Connection[Any], schema_name: str, **times: str) -> None:
    """One unpublished outbox row whose timestamps are SQL expressions (``available_at="now() - ..."``)."""
    columns = ["message_id", "queue_name", "actor_name", "body", *times]
    values = [sql.Literal("m-1"), sql.Literal("q"), sql.Literal("a"), sql.Literal(b"{}")]
    values += [sql.SQL(expression) for expression in times.values()]  # the test's own constants
    db.execute(
        sql.SQL("INSERT INTO {}.outbox ({}) VALUES ({})").format(
            sql.Identifier(schema_name),
            sql.SQL(", ").join(map(sql.Identifier, columns)),
            sql.SQL(", ").join(values),
        )
    )


def test_a_healthy_deployment_reads_all_ok(healthy_url: str, rabbitmq_url: str, db_schema: str) -> None:
    findings = diagnose(healthy_url, schema_name=db_schema, rabbitmq_url=rabbitmq_url)
    assert [finding.check for finding in findings] == list(CHECKS)
    assert {finding.check: finding.severity for finding in findings} == dict.fromkeys(CHECKS, "ok"), findings
    assert by_check(findings)["indexes"].details["expected"] == len(_expected_indexes(schema.LATEST_VERSION)) > 20


def test_the_indexes_expected_are_exactly_those_the_migrations_create(
    db: psycopg.Connection[Any], db_schema: str
) -> None:
    """The statements are read from the migration files: none may be missed (nor invented)."""
    rows = db.execute(
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND NOT EXISTS (SELECT FROM pg_constraint WHERE conindid = i.indexrelid)",
        (db_schema,),
    ).fetchall()
    assert {name for (name,) in rows} == set(_expected_indexes(schema.LATEST_VERSION))


def test_a_schema_behind_the_package_is_a_problem_naming_migrate(
    healthy_url: str, direct_database_url: str, unmigrated_schema: str
) -> None:
    with psycopg.connect(direct_database_url) as conn, conn.transaction():
        conn.execute(_sql.query("schema_header", unmigrated_schema))
        for migration in schema.migrations()[:10]:
            conn.execute(_sql.compose(migration.text, unmigrated_schema))
            conn.execute(schema._record(unmigrated_schema, migration))
    found = by_check(diagnose(healthy_url, schema_name=unmigrated_schema))
    assert found["schema"].severity == "fail"
    assert f"is at version 10, the package needs {schema.LATEST_VERSION}" in found["schema"].summary
    assert f"dramatiq-reliable migrate --schema {unmigrated_schema}" in found["schema"].fix
    # The indexes of version 10 are all there: an older schema is not "missing" later ones.
    assert found["indexes"].severity == "ok"


def test_a_schema_newer_than_the_package_is_a_warning(
    healthy_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    later = schema.Migration(schema.LATEST_VERSION + 1, "from_the_future", "")
    db.execute(schema._record(db_schema, later))
    finding = by_check(diagnose(healthy_url, schema_name=db_schema))["schema"]
    assert finding.severity == "warn"
    assert "upgrade dramatiq-reliable" in finding.fix


def test_a_dropped_index_is_found_and_the_fix_given_recreates_it(
    healthy_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    db.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(db_schema, "outbox_due")))
    finding = by_check(diagnose(healthy_url, schema_name=db_schema))["indexes"]
    assert finding.severity == "fail"
    assert finding.details["missing"] == ["outbox_due"]
    assert finding.fix.startswith("run CREATE INDEX CONCURRENTLY outbox_due ON")
    db.execute(finding.fix.removeprefix("run ").encode())
    assert by_check(diagnose(healthy_url, schema_name=db_schema))["indexes"].severity == "ok"


def test_dead_rows_past_the_ratio_are_bloat(healthy_url: str, db: psycopg.Connection[Any], db_schema: str) -> None:
    outbox = sql.Identifier(db_schema, "outbox")
    db.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(outbox))
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, published_at) "
            "SELECT 'm' || i, 'q', 'a', '\\x00', now() FROM generate_series(1, 3000) AS i"
        ).format(outbox)
    )
    db.execute(sql.SQL("DELETE FROM {} WHERE id % 4 <> 0").format(outbox))
    db.execute("SELECT pg_stat_force_next_flush()")
    db.execute("SELECT 1")  # the flush happens after a statement
    limits = Thresholds(bloat_min_dead_rows=1000)

    def bloat() -> Finding | None:
        finding = by_check(diagnose(healthy_url, schema_name=db_schema, thresholds=limits))["bloat"]
        return finding if finding.severity == "warn" else None

    finding = wait_for(bloat, timeout_ms=10_000, interval_ms=200, message="dead rows never reached the statistics")
    assert "outbox (2,250 dead rows, 75%)" in finding.summary
    assert "VACUUM" in finding.fix
    assert by_check(diagnose(healthy_url, schema_name=db_schema))["bloat"].severity == "ok"  # under 10,000 rows


def test_indexes_that_kept_the_pages_of_deleted_rows_are_bloat(
    healthy_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    outbox = sql.Identifier(db_schema, "outbox")
    db.execute(
        sql.SQL(
            "INSERT INTO {} (message_id, queue_name, actor_name, body, published_at) "
            "SELECT 'message-' || i, 'q', 'a', '\\x00', now() FROM generate_series(1, 20000) AS i"
        ).format(outbox)
    )
    # The table's tail is deleted and vacuumed away; the b-trees keep every page they had.
    db.execute(sql.SQL("DELETE FROM {} WHERE id > 1000").format(outbox))
    limits = Thresholds(index_bloat_min_table_bytes=16_384)

    def indexes_only() -> Finding | None:
        # VACUUM's count of dead rows reaches the statistics up to a second later (Postgres
        # flushes them at most once a second), and a snapshot older than the DELETE (another
        # session's transaction) keeps them: VACUUM again until the table itself reads clean.
        db.execute(sql.SQL("VACUUM {}").format(outbox))
        found = by_check(diagnose(healthy_url, schema_name=db_schema, thresholds=limits))["bloat"]
        return found if found.details["tables"]["outbox"]["dead_rows"] == 0 else None

    finding = wait_for(indexes_only, timeout_ms=20_000, interval_ms=300, message="VACUUM never reached the statistics")
    assert finding.severity == "warn"
    assert "outbox indexes (" in finding.summary
    table = finding.details["tables"]["outbox"]
    assert table["index_bytes"] > 4 * table["table_bytes"]
    assert "REINDEX CONCURRENTLY" in finding.fix


def test_a_due_row_nobody_publishes_means_no_relay(
    healthy_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    _outbox_row(db, db_schema, created_at="now() - interval '10 minutes'", available_at="now() - interval '10 minutes'")
    finding = by_check(diagnose(healthy_url, schema_name=db_schema))["relay"]
    assert finding.severity == "fail"
    assert "no relay is publishing: 1 outbox row due, the oldest for 10m" in finding.summary
    assert "dramatiq-reliable relay" in finding.fix
    # A relay that keeps up: the same row due a second ago is no finding.
    relaxed = Thresholds(relay_stale_ms=3_600_000)
    assert by_check(diagnose(healthy_url, schema_name=db_schema, thresholds=relaxed))["relay"].severity == "ok"


def test_a_delay_or_job_longer_than_consumer_timeout_is_a_problem(
    healthy_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    # A row published before its eta (as versions before migration 8 did) waits in a worker.
    _outbox_row(db, db_schema, eta="now() + interval '2 hours'")
    finding = by_check(diagnose(healthy_url, schema_name=db_schema, consumer_timeout_ms=1_800_000))["consumer_timeout"]
    assert finding.severity == "fail"
    assert finding.summary.startswith("longest delay held by a worker: 120m against consumer_timeout 30m (given)")
    assert "LongJobs" in finding.fix
    db.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(db_schema, "outbox")))
    job = by_check(diagnose(healthy_url, schema_name=db_schema, longest_job_ms=1_700_000))["consumer_timeout"]
    assert job.severity == "warn"
    assert "RabbitMQ's default, assumed" in job.summary


def test_a_transaction_open_longer_than_consumer_timeout_is_a_job_too_long(
    healthy_url: str, direct_database_url: str, db_schema: str
) -> None:
    """A transactional job is an open transaction for its whole run: the doctor sees it running."""
    with psycopg.connect(direct_database_url) as job:
        job.execute("SELECT 1")  # opens the transaction and leaves it open, as a running job does

        def too_long() -> Finding | None:
            found = by_check(diagnose(healthy_url, schema_name=db_schema, consumer_timeout_ms=300))
            finding = found["consumer_timeout"]
            return finding if finding.severity == "fail" else None

        finding = wait_for(too_long, timeout_ms=5_000, interval_ms=50, message="the open transaction was not seen")
        assert finding.summary.startswith("longest open transaction (a transactional job)")
        assert finding.details["longest_transaction_ms"] > 300
        job.rollback()


def test_a_clock_off_from_postgres_is_found(healthy_url: str, db_schema: str) -> None:
    late = by_check(diagnose(healthy_url, schema_name=db_schema, clock=lambda: time.time() - 30))["clock"]
    assert late.severity == "fail"
    assert "ahead of this host's" in late.summary
    assert late.details["skew_ms"] == pytest.approx(30_000, abs=1_000)
    early = by_check(diagnose(healthy_url, schema_name=db_schema, clock=lambda: time.time() + 3))["clock"]
    assert early.severity == "warn"
    assert "behind this host's" in early.summary


def test_timeouts_that_cut_our_work_or_never_end_a_stuck_job(direct_database_url: str, db_schema: str) -> None:
    short = with_settings(direct_database_url, statement_timeout="50", idle_in_transaction_session_timeout="600000")
    finding = by_check(diagnose(short, schema_name=db_schema))["timeouts"]
    assert finding.severity == "fail"
    assert finding.summary.startswith("statement_timeout is 50 ms")
    # The doctor's own reads ran under its own bound, not the 50 ms it reports.
    assert all(f.severity == "ok" for f in diagnose(short, schema_name=db_schema) if f.check != "timeouts")

    idle = with_settings(direct_database_url, idle_in_transaction_session_timeout="60000")
    finding = by_check(diagnose(idle, schema_name=db_schema, longest_job_ms=3_600_000))["timeouts"]
    assert finding.severity == "fail"
    assert "shorter than the longest job (3600000 ms)" in finding.summary

    never = by_check(diagnose(direct_database_url, schema_name=db_schema))["timeouts"]
    assert never.severity == "warn"
    assert "idle_in_transaction_session_timeout is 0: a stuck job holds" in never.summary


def test_pgbouncer_in_transaction_mode_is_found_and_every_check_still_runs(
    direct_database_url: str, db_schema: str
) -> None:
    with pgbouncer(direct_database_url) as pooled:
        findings = diagnose(pooled, schema_name=db_schema)
    found = by_check(findings)
    assert found["pooler"].severity == "warn"
    assert found["pooler"].details["pool_mode"] == "transaction"
    assert "LISTEN/NOTIFY wake-ups" in found["pooler"].summary
    assert "a direct Postgres URL" in found["pooler"].fix
    assert {found[name].severity for name in ("schema", "indexes", "relay", "clock")} == {"ok"}


def test_a_session_pooler_is_no_finding(direct_database_url: str, db_schema: str) -> None:
    with pgbouncer(direct_database_url, pool_mode="session") as pooled:
        finding = by_check(diagnose(pooled, schema_name=db_schema))["pooler"]
    assert (finding.severity, finding.details["pool_mode"]) == ("ok", "session")


def test_services_that_cannot_be_reached_are_findings(
    direct_database_url: str, rabbitmq_url: str, db_schema: str
) -> None:
    down = diagnose(proxied(direct_database_url, closed_port()), schema_name=db_schema, rabbitmq_url=rabbitmq_url)
    assert [(f.check, f.severity) for f in down] == [("postgres", "fail"), ("rabbitmq", "ok")]
    assert down[0].summary.startswith("cannot reach Postgres")
    rabbit = by_check(
        diagnose(direct_database_url, schema_name=db_schema, rabbitmq_url=proxied(rabbitmq_url, closed_port()))
    )
    assert rabbit["rabbitmq"].severity == "fail"
    assert rabbit["rabbitmq"].summary.startswith("cannot reach RabbitMQ")


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Any:
    def invoke(*args: str) -> tuple[int, str]:
        code = main(["doctor", *args])
        return code, capsys.readouterr().out

    return invoke


def test_cli_exit_codes_and_json(
    run: Any, healthy_url: str, direct_database_url: str, rabbitmq_url: str, db: psycopg.Connection[Any], db_schema: str
) -> None:
    common = ["--schema", db_schema, "--rabbitmq-url", rabbitmq_url]
    code, out = run("--database-url", healthy_url, *common)
    assert code == ExitCode.OK, out
    assert out.rstrip().endswith("no problems found")
    code, out = run("--database-url", direct_database_url, *common)
    assert code == ExitCode.OK  # the idle-in-transaction warning alone
    assert "fix timeouts: set idle_in_transaction_session_timeout" in out
    assert run("--database-url", direct_database_url, "--strict", *common)[0] == ExitCode.CHECK_FAILED

    _outbox_row(db, db_schema, available_at="now() - interval '1 hour'")
    code, out = run("--database-url", healthy_url, "--json", *common)
    assert code == ExitCode.CHECK_FAILED
    document = json.loads(out)
    assert document["ok"] is False
    assert {f["check"]: f["severity"] for f in document["findings"]}["relay"] == "fail"

    code, _ = run("--database-url", healthy_url, "--schema", "never_migrated_here")
    assert code == ExitCode.SCHEMA
    code, _ = run("--database-url", proxied(direct_database_url, closed_port()), "--schema", db_schema)
    assert code == ExitCode.UNAVAILABLE
