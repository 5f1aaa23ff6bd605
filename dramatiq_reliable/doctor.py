"""The doctor: checks a deployment from the outside and says what will hurt, each with its fix.

:func:`diagnose` connects to Postgres (and RabbitMQ when given) as the application would, reads
only (catalogs, statistics, our tables) and returns one :class:`Finding` per check, ``ok``,
``warn`` or ``fail``.  A service it cannot reach is a finding too, never an exception, so a
probe or a person always gets the whole picture at once (``dramatiq-reliable doctor``).

The checks, and what each one reads:

* ``pooler``: whether a pooler sits between the app and Postgres (the port the client dialled
  is not the server's) and whether it pools by transaction (one client connection's statements
  land on different server processes while another client holds one).  Transaction pooling
  disables ``LISTEN``: wake-ups become polling.  Every advisory lock of ours is
  transaction-level (``pg_advisory_xact_lock``), so none breaks.
* ``schema``: the schema's migration version against the package's latest.
* ``indexes``: the indexes the applied migrations create, against ``pg_index`` (missing, or left
  invalid by a failed ``CREATE INDEX CONCURRENTLY``).
* ``bloat``: dead rows against all rows per table of ours (``pg_stat_user_tables``; the
  ``pgstattuple`` extension is not assumed), and indexes larger than their table several times.
* ``relay``: the outbox is its own heartbeat: the oldest row due and unpublished.
* ``partitions``: once partitions are enabled, that a partition is made ahead of the clock (else
  published rows stay in the outbox, purged row by row, until maintenance runs again).
* ``consumer_timeout``: RabbitMQ's ``consumer_timeout`` (given; AMQP does not tell it) against the
  longest delay a worker would hold unacked and the longest job seen (open transactions, leases).
* ``clock``: the app's clock against Postgres' (``clock_timestamp()``, half a round trip
  allowed): delays and leases compare times written by one with ``now()`` of the other.
  RabbitMQ's clock is not read: nothing of ours compares a time with it.
* ``timeouts``: ``statement_timeout`` and ``idle_in_transaction_session_timeout`` as the app's
  role sees them, against the bounds our statements and jobs need.

>>> findings = diagnose("postgresql://app@db/app")  # doctest: +SKIP
>>> [f.check for f in findings if f.severity == "fail"]  # doctest: +SKIP
[]
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import re
import time
from collections.abc import Callable
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import _sql, schema
from ._checks import check_ms
from ._util import first_line, format_age, rabbitmq_reason, redact
from .outbox.long_jobs import DEFAULT_CONSUMER_TIMEOUT_MS

__all__ = [
    "CHECKS",
    "Finding",
    "Severity",
    "Thresholds",
    "diagnose",
]

Severity = Literal["ok", "warn", "fail"]

#: The checks in the order they run and print.
CHECKS = (
    "postgres",
    "pooler",
    "schema",
    "indexes",
    "bloat",
    "relay",
    "partitions",
    "rabbitmq",
    "consumer_timeout",
    "clock",
    "timeouts",
)

# How long the doctor's own statements may run: a catalog read that takes longer is a finding
# in itself, and a doctor must never hang a probe.
_OWN_STATEMENT_TIMEOUT_MS = 10_000
#: The migration that made the partitioned history of published outbox rows.
_PARTITIONS_VERSION = 16


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's verdict: what it found (``summary``), what to do (``fix``), the numbers read."""

    check: str
    severity: Severity
    summary: str
    fix: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Where a reading turns into a warning or a problem; each default says why."""

    #: A due outbox row older than this means no relay publishes (a live relay takes a due row
    #: within its poll interval, 250 ms by default, even behind a pooler).
    relay_stale_ms: int = 60_000
    #: Clock skew that shifts delays and leases noticeably (warn), and enough to fire delayed
    #: jobs early or reap live leases (fail).
    clock_warn_ms: int = 1_000
    clock_fail_ms: int = 10_000
    #: Bloat: dead rows over all rows, on tables with at least ``bloat_min_dead_rows`` dead rows
    #: (small tables are vacuumed cheaply whatever their ratio).
    bloat_ratio: float = 0.2
    bloat_min_dead_rows: int = 10_000
    #: An index this many times larger than its table has kept pages of rows long gone (a
    #: b-tree never gives pages back); tables under ``index_bloat_min_table_bytes`` are ignored.
    index_bloat_factor: float = 4.0
    index_bloat_min_table_bytes: int = 1_048_576
    #: Our longest statements (a relay's claim and mark of a batch, a retention batch) take
    #: seconds on a large backlog: a ``statement_timeout`` below this cuts them.
    min_statement_timeout_ms: int = 5_000
    #: How close to ``consumer_timeout`` a delay or job may come before a warning.
    consumer_timeout_margin: float = 0.8


def diagnose(
    database_url: str,
    *,
    schema_name: str = _sql.DEFAULT_SCHEMA,
    rabbitmq_url: str | None = None,
    consumer_timeout_ms: int | None = None,
    longest_job_ms: int | None = None,
    thresholds: Thresholds | None = None,
    clock: Callable[[], float] = time.time,
) -> list[Finding]:
    """Run every check against the deployment at ``database_url`` (and ``rabbitmq_url``).

    ``consumer_timeout_ms`` is RabbitMQ's ``consumer_timeout`` (RabbitMQ's default, 30 minutes,
    when not given, and said so); ``longest_job_ms`` the longest an actor may run (its
    ``time_limit``) when you know it better than what the doctor sees running.  ``clock``
    returns the app's time in seconds since the epoch (tests shift it).  Nothing is written.
    """
    _sql.validate_schema(schema_name)
    if consumer_timeout_ms is not None:
        check_ms("consumer_timeout_ms", consumer_timeout_ms, minimum=1, fix="pass RabbitMQ's consumer_timeout")
    check_ms("longest_job_ms", longest_job_ms, allow_none=True, fix="pass the longest time_limit of your actors")
    limits = thresholds or Thresholds()
    findings: list[Finding] = []
    try:
        conn = psycopg.connect(database_url, autocommit=True, connect_timeout=5)
    except psycopg.Error as error:
        findings.append(
            Finding(
                "postgres",
                "fail",
                f"cannot reach Postgres: {redact(first_line(error))}",
                "check the URL, that the server runs and that this host may connect; nothing else was checked",
            )
        )
        findings.extend(_rabbitmq(rabbitmq_url))
        return findings
    with conn:
        settings = _one(conn, "doctor_settings", schema_name)
        findings.append(
            Finding("postgres", "ok", "Postgres reachable", details={"server_port": settings["server_port"]})
        )
        findings.append(_pooler(database_url, conn, settings))
        version = _checked(conn, "schema", lambda: schema.current_version(conn, schema=schema_name))
        if isinstance(version, Finding):
            return [*findings, version, *_rabbitmq(rabbitmq_url)]
        findings.append(_schema(schema_name, version))
        applied = version or 0
        checks: list[tuple[str, Callable[[], Finding]]] = [
            ("indexes", lambda: _indexes(conn, schema_name, applied)),
            ("bloat", lambda: _bloat(conn, schema_name, limits)),
            ("relay", lambda: _relay(conn, schema_name, applied, limits)),
            ("partitions", lambda: _partitions(conn, schema_name, applied)),
        ]
        for name, check in checks:
            findings.append(_as_finding(_checked(conn, name, check)))
        findings.extend(_rabbitmq(rabbitmq_url))
        later: list[tuple[str, Callable[[], Finding]]] = [
            (
                "consumer_timeout",
                lambda: _consumer_timeout(conn, schema_name, applied, consumer_timeout_ms, longest_job_ms, limits),
            ),
            ("clock", lambda: _clock(conn, schema_name, clock, limits)),
        ]
        for name, check in later:
            findings.append(_as_finding(_checked(conn, name, check)))
        findings.append(_timeouts(settings, longest_job_ms, limits))
    return findings


def _one(conn: psycopg.Connection[Any], name: str, schema_name: str, **params: Any) -> dict[str, Any]:
    row = conn.cursor(row_factory=dict_row).execute(_sql.query(name, schema_name), params).fetchone()
    return dict(row or {})


def _all(conn: psycopg.Connection[Any], name: str, schema_name: str, **params: Any) -> list[dict[str, Any]]:
    return list(conn.cursor(row_factory=dict_row).execute(_sql.query(name, schema_name), params).fetchall())


def _checked(conn: psycopg.Connection[Any], check: str, read: Callable[[], Any]) -> Any:
    """``read()`` in a transaction of its own bounded to a few seconds (``SET LOCAL``, so also
    behind a transaction pooler); a Postgres error becomes the check's finding.

    The app's own bounds were read first: the doctor's statements must not inherit a
    ``statement_timeout`` of 50 ms it is there to report.
    """
    try:
        with conn.transaction():
            _sql.set_local_timeouts(conn, statement_timeout_ms=_OWN_STATEMENT_TIMEOUT_MS)
            return read()
    except psycopg.Error as error:
        return Finding(
            check,
            "warn",
            f"could not check: {redact(first_line(error))}",
            "run the doctor as a role that may read the schema's tables and pg_stat_activity",
        )


def _as_finding(result: Any) -> Finding:
    if not isinstance(result, Finding):
        raise TypeError(f"a check returned {result!r}, not a Finding")
    return result


# --------------------------------------------------------------------------------------------
# pooler
# --------------------------------------------------------------------------------------------

#: What a transaction pooler disables, for the finding's text.
_POOLER_DISABLES = (
    "LISTEN/NOTIFY wake-ups (the relay, PostgresBroker's consumers and the flow middleware "
    "poll instead: latency up to their poll interval)"
)


def _pooler(database_url: str, conn: psycopg.Connection[Any], settings: dict[str, Any]) -> Finding:
    dialled = conn.info.port
    server = settings["server_port"]
    # Probed whatever the ports say: a pooler may listen on 5432 of its own host, or on a socket.
    mode = _pool_mode(database_url)
    details: dict[str, Any] = {"client_port": dialled, "server_port": server, "pool_mode": mode}
    if mode == "transaction":
        return Finding(
            "pooler",
            "warn",
            f"a pooler in transaction mode sits before Postgres: it disables {_POOLER_DISABLES}; "
            "session advisory locks: none of ours (all are transaction-level)",
            "point the relay, PostgresBroker's workers and the flow middleware at a direct Postgres URL (they "
            "LISTEN), or accept polling (the relay's and PostgresBroker's poll_interval_ms bound the wait); "
            "sends, idempotency and migrate work through the pooler",
            details,
        )
    if server is not None and dialled != server:
        return Finding(
            "pooler",
            "ok",
            f"a pooler or proxy in session mode sits before Postgres (port {dialled} -> {server}): every "
            "feature works, one server connection per client connection",
            details=details,
        )
    return Finding("pooler", "ok", "no transaction pooler before Postgres", details=details)


def _pool_mode(database_url: str) -> str:
    """``transaction`` when statements of one client connection run on different server processes.

    A session pooler pins a client to one server process; a transaction pooler hands the server
    process back after each transaction, so while a second client holds it in a transaction the
    first client's next statement must run on another process.
    """
    try:
        with (
            psycopg.connect(database_url, autocommit=True, connect_timeout=5) as first,
            psycopg.connect(database_url, autocommit=True, connect_timeout=5) as second,
        ):
            for _ in range(3):
                before = _one(first, "doctor_backend", _sql.DEFAULT_SCHEMA)["backend_pid"]
                with second.transaction():
                    held = _one(second, "doctor_backend", _sql.DEFAULT_SCHEMA)["backend_pid"]
                    after = _one(first, "doctor_backend", _sql.DEFAULT_SCHEMA)["backend_pid"]
                if before != after or before == held:
                    return "transaction"
    except psycopg.Error:
        return "unknown"
    return "session"


# --------------------------------------------------------------------------------------------
# schema and indexes
# --------------------------------------------------------------------------------------------


def _schema(schema_name: str, version: int | None) -> Finding:
    latest = schema.LATEST_VERSION
    command = schema.migrate_command(schema_name)
    details = {"version": version, "latest": latest}
    if version is None:
        return Finding("schema", "fail", f"schema {schema_name!r} was never migrated", f"run {command!r}", details)
    if version < latest:
        return Finding(
            "schema",
            "fail",
            f"schema {schema_name!r} is at version {version}, the package needs {latest}: parts that need the "
            "newer tables refuse to start",
            f"run {command!r} (or apply 'dramatiq-reliable migrate --sql' through your migration tool)",
            details,
        )
    if version > latest:
        return Finding(
            "schema",
            "warn",
            f"schema {schema_name!r} is at version {version}, newer than this package knows ({latest})",
            "upgrade dramatiq-reliable on this host to the version that migrated the schema",
            details,
        )
    return Finding("schema", "ok", f"schema {schema_name!r} is at the latest version ({latest})", details=details)


_CREATE_INDEX = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?(\w+)\s+ON\s+[^;]*;",
    re.IGNORECASE,
)
_DROP_INDEX = re.compile(r"DROP\s+INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+EXISTS\s+)?(?:\{schema\}\.)?(\w+)", re.IGNORECASE)


@functools.cache
def _expected_indexes(version: int) -> dict[str, str]:
    """The named indexes migrations 1..``version`` leave, each with the statement that makes it."""
    found: dict[str, str] = {}
    for migration in schema.migrations():
        if migration.version > version:
            break
        text = re.sub(r"--[^\n]*", "", migration.text)
        for match in _DROP_INDEX.finditer(text):
            found.pop(match[1], None)
        for match in _CREATE_INDEX.finditer(text):
            found[match[1]] = " ".join(match[0].split())
    return found


def _indexes(conn: psycopg.Connection[Any], schema_name: str, version: int) -> Finding:
    if version == 0:
        return Finding("indexes", "ok", "no tables to check (schema not migrated)")
    expected = _expected_indexes(version)
    present = {row["name"]: row["valid"] for row in _all(conn, "doctor_indexes", schema_name, schema=schema_name)}
    missing = sorted(name for name in expected if name not in present)
    invalid = sorted(name for name, valid in present.items() if not valid)
    details = {"expected": len(expected), "missing": missing, "invalid": invalid}
    if not missing and not invalid:
        return Finding("indexes", "ok", f"all {len(expected)} indexes of the migrations are present", details=details)
    parts = []
    if missing:
        parts.append(f"missing: {', '.join(missing)} (queries on these tables scan them whole)")
    if invalid:
        parts.append(f"invalid: {', '.join(invalid)} (a failed CREATE INDEX CONCURRENTLY; unused, yet maintained)")
    fixes = [
        expected[name]
        .replace("{schema}", f'"{schema_name}"')
        .replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1)
        .replace("CREATE UNIQUE INDEX", "CREATE UNIQUE INDEX CONCURRENTLY", 1)
        for name in missing
    ]
    fixes += [f'REINDEX INDEX CONCURRENTLY "{schema_name}"."{name}";' for name in invalid]
    return Finding("indexes", "fail", "; ".join(parts), "run " + " ".join(fixes), details)


def _bloat(conn: psycopg.Connection[Any], schema_name: str, limits: Thresholds) -> Finding:
    rows = _all(conn, "doctor_bloat", schema_name, schema=schema_name)
    bloated: list[str] = []
    tables: dict[str, Any] = {}
    for row in rows:
        live, dead = int(row["live_rows"] or 0), int(row["dead_rows"] or 0)
        ratio = dead / (live + dead) if live + dead else 0.0
        table_bytes, index_bytes = int(row["table_bytes"] or 0), int(row["index_bytes"] or 0)
        tables[row["table_name"]] = {
            "live_rows": live,
            "dead_rows": dead,
            "dead_ratio": round(ratio, 3),
            "table_bytes": table_bytes,
            "index_bytes": index_bytes,
        }
        if dead >= limits.bloat_min_dead_rows and ratio >= limits.bloat_ratio:
            bloated.append(f"{row['table_name']} ({dead:,} dead rows, {ratio:.0%})")
        if table_bytes >= limits.index_bloat_min_table_bytes and index_bytes > limits.index_bloat_factor * table_bytes:
            bloated.append(f"{row['table_name']} indexes ({_size(index_bytes)} for a {_size(table_bytes)} table)")
    details = {"tables": tables, "method": "pg_stat_user_tables dead rows; index size against table size"}
    if not bloated:
        return Finding("bloat", "ok", f"no bloat found in {len(rows)} tables", details=details)
    return Finding(
        "bloat",
        "warn",
        f"bloated: {'; '.join(bloated)}: scans read dead rows and pages",
        f"run VACUUM (ANALYZE) on them (REINDEX CONCURRENTLY for indexes); if it recurs, look for long "
        f"transactions holding back vacuum and lower autovacuum_vacuum_scale_factor on schema {schema_name!r}'s tables",
        details,
    )


def _size(size: int) -> str:
    return f"{size / 1_048_576:.1f} MB" if size >= 1_048_576 else f"{size // 1024} kB"


# --------------------------------------------------------------------------------------------
# relay, RabbitMQ, consumer_timeout
# --------------------------------------------------------------------------------------------


def _relay(conn: psycopg.Connection[Any], schema_name: str, version: int, limits: Thresholds) -> Finding:
    if version < schema.OUTBOX_VERSION:
        return Finding("relay", "ok", "no outbox to relay (schema not migrated)")
    # Since migration 16 published rows may live in the partitioned history instead.
    row = _one(conn, "doctor_relay_history" if version >= _PARTITIONS_VERSION else "doctor_relay", schema_name)
    age_s = row["oldest_due_age_s"]
    published = row["last_published_at"]
    details = {"due": int(row["due"]), "oldest_due_age_s": age_s, "last_published_at": published}
    if age_s is not None and age_s * 1000 > limits.relay_stale_ms:
        return Finding(
            "relay",
            "fail",
            f"no relay is publishing: {_rows(int(row['due']))} due, the oldest for {format_age(age_s)} "
            f"(a live relay takes them within seconds)",
            "start 'dramatiq-reliable relay' (or the WorkerRelay middleware) with this schema, and check it "
            "reaches RabbitMQ and Postgres (its log says which is down)",
            details,
        )
    summary = "the relay keeps up" if row["due"] else "no outbox row waits for the relay"
    return Finding("relay", "ok", summary, details=details)


def _partitions(conn: psycopg.Connection[Any], schema_name: str, version: int) -> Finding:
    """Whether the partitioned history of published rows has partitions ahead of the clock."""
    if version < _PARTITIONS_VERSION:
        return Finding("partitions", "ok", "published rows are purged row by row (partitions need migration 16)")
    parent = sql.Identifier(schema_name, "outbox_published").as_string(conn)
    row = _one(conn, "doctor_partitions", schema_name, parent=parent)
    if not row:
        return Finding("partitions", "ok", "not enabled: published rows are purged row by row")
    ahead_s, interval_s = row["ahead_s"], int(row["interval_ms"]) / 1000
    details = {"covered_until": row["covered_until"], "maintained_at": row["maintained_at"], "ahead_s": ahead_s}
    fix = "run 'dramatiq-reliable partitions maintain', and keep a relay (or a cron job of that command) running"
    if ahead_s is None or ahead_s <= 0:
        return Finding(
            "partitions",
            "fail",
            "no partition holds rows published now: they stay in the outbox and are purged row by row",
            fix,
            details,
        )
    if ahead_s < interval_s:
        return Finding(
            "partitions",
            "warn",
            f"partitions end in {format_age(ahead_s)}: less than one partition ahead",
            fix,
            details,
        )
    return Finding("partitions", "ok", f"partitions made {format_age(ahead_s)} ahead", details=details)


def _rows(count: int) -> str:
    return f"{count:,} outbox row{'' if count == 1 else 's'}"


def _rabbitmq(rabbitmq_url: str | None) -> list[Finding]:
    if rabbitmq_url is None:
        return [Finding("rabbitmq", "ok", "RabbitMQ not checked (no URL given)")]
    import pika

    from ._tcp import bound_tcp

    try:
        parameters = [pika.URLParameters(part.strip()) for part in rabbitmq_url.split(";") if part.strip()]
        connection = pika.BlockingConnection(bound_tcp(parameters))
    except Exception as error:  # pika raises many types for an unreachable or refusing server
        return [
            Finding(
                "rabbitmq",
                "fail",
                f"cannot reach RabbitMQ: {redact(rabbitmq_reason(error))}",
                "check the URL, its user and vhost, and that the server runs",
            )
        ]
    connection.close()
    return [Finding("rabbitmq", "ok", "RabbitMQ reachable")]


def _consumer_timeout(
    conn: psycopg.Connection[Any],
    schema_name: str,
    version: int,
    consumer_timeout_ms: int | None,
    longest_job_ms: int | None,
    limits: Thresholds,
) -> Finding:
    timeout = consumer_timeout_ms or DEFAULT_CONSUMER_TIMEOUT_MS
    source = "given" if consumer_timeout_ms else "RabbitMQ's default, assumed: pass the server's"
    # (what, key in details) -> milliseconds
    seen: dict[tuple[str, str], float] = {}
    if version >= schema.OUTBOX_VERSION:
        delay = _one(conn, "doctor_delays", schema_name)["longest_delay_ms"]
        seen["delay held by a worker", "longest_delay_ms"] = float(delay)
    transaction = _one(conn, "doctor_transactions", schema_name)["longest_transaction_ms"]
    seen["open transaction (a transactional job)", "longest_transaction_ms"] = float(transaction)
    if longest_job_ms is not None:
        seen["job (given)", "longest_job_ms"] = float(longest_job_ms)
    details: dict[str, Any] = {"consumer_timeout_ms": timeout, "source": source}
    details.update({key: round(value) for (_, key), value in seen.items()})
    if version >= schema.LONG_JOBS_VERSION:
        # Leased jobs are acked at once: shown, never held against the timeout.
        details["longest_lease_ms"] = round(float(_one(conn, "doctor_leases", schema_name)["longest_lease_ms"]))
    (what, _), longest = max(seen.items(), key=lambda item: item[1])
    text = (
        f"longest {what}: {format_age(longest / 1000)} against consumer_timeout {format_age(timeout / 1000)} ({source})"
    )
    fix = (
        "run long actors under LongJobs (long_running=True) so their delivery is acked at once, keep delays in the "
        "outbox (migrate to version 8+ and let the relay hold them), or raise RabbitMQ's consumer_timeout"
    )
    if longest > timeout:
        return Finding(
            "consumer_timeout",
            "fail",
            f"{text}: RabbitMQ closes the channel and delivers its messages again",
            fix,
            details,
        )
    if longest > limits.consumer_timeout_margin * timeout:
        return Finding("consumer_timeout", "warn", f"{text}: close to the limit", fix, details)
    return Finding("consumer_timeout", "ok", text, details=details)


# --------------------------------------------------------------------------------------------
# clock and timeouts
# --------------------------------------------------------------------------------------------


def _clock(conn: psycopg.Connection[Any], schema_name: str, clock: Callable[[], float], limits: Thresholds) -> Finding:
    best: tuple[float, float] | None = None  # (round trip, skew) of the fastest of three reads
    for _ in range(3):
        sent = clock()
        server = _one(conn, "doctor_clock", schema_name)["server_now"]
        received = clock()
        server_s = server.timestamp() if isinstance(server, datetime.datetime) else float(server)
        skew = server_s - (sent + received) / 2
        if best is None or received - sent < best[0]:
            best = (received - sent, skew)
    round_trip, skew = best or (0.0, 0.0)
    skew_ms = skew * 1000
    details = {"skew_ms": round(skew_ms, 1), "round_trip_ms": round(round_trip * 1000, 1)}
    ahead = "ahead of" if skew_ms > 0 else "behind"
    text = f"Postgres' clock is {abs(skew_ms):.0f} ms {ahead} this host's (±{round_trip * 500:.0f} ms)"
    fix = "run NTP (chrony, systemd-timesyncd) on the app hosts and the database host"
    why = "delayed jobs fire early or late and leases lapse by as much"
    if abs(skew_ms) - round_trip * 500 > limits.clock_fail_ms:
        return Finding("clock", "fail", f"{text}: {why}", fix, details)
    if abs(skew_ms) - round_trip * 500 > limits.clock_warn_ms:
        return Finding("clock", "warn", f"{text}: {why}", fix, details)
    return Finding("clock", "ok", text, details=details)


def _timeouts(settings: dict[str, Any], longest_job_ms: int | None, limits: Thresholds) -> Finding:
    statement = int(settings["statement_timeout_ms"] or 0)
    idle = int(settings["idle_in_transaction_ms"] or 0)
    details = {"statement_timeout_ms": statement, "idle_in_transaction_session_timeout_ms": idle}
    fails, warns, fixes = [], [], []
    if 0 < statement < limits.min_statement_timeout_ms:
        fails.append(
            f"statement_timeout is {statement} ms: it cancels the relay's batch statements and retention purges "
            f"on a large backlog (they need up to {limits.min_statement_timeout_ms} ms)"
        )
        fixes.append(f"raise statement_timeout for the app's role to at least {limits.min_statement_timeout_ms} ms")
    if idle > 0 and longest_job_ms is not None and idle < longest_job_ms:
        fails.append(
            f"idle_in_transaction_session_timeout is {idle} ms, shorter than the longest job ({longest_job_ms} ms): "
            "a transactional job that waits on anything but Postgres is killed and its work rolled back"
        )
        fixes.append("raise idle_in_transaction_session_timeout above your longest time_limit")
    elif 0 < idle < limits.min_statement_timeout_ms:
        fails.append(
            f"idle_in_transaction_session_timeout is {idle} ms: a transactional job that calls an API or sleeps "
            "that long between statements is killed and its work rolled back"
        )
        fixes.append("raise idle_in_transaction_session_timeout above your longest time_limit")
    if idle == 0:
        warns.append(
            "idle_in_transaction_session_timeout is 0: a stuck job holds its transaction, its idempotency key "
            "and the rows it locked for ever, and vacuum cannot reclaim dead rows behind it"
        )
        fixes.append("set idle_in_transaction_session_timeout a little above your longest time_limit")
    if fails:
        return Finding("timeouts", "fail", "; ".join(fails + warns), "; ".join(fixes), details)
    if warns:
        return Finding("timeouts", "warn", "; ".join(warns), "; ".join(fixes), details)
    return Finding("timeouts", "ok", "statement and idle-in-transaction timeouts leave our work room", details=details)
