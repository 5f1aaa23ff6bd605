"""Argument validation and pure helpers of the outbox, schema and CLI: no network."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any

import pytest
from dramatiq.brokers.stub import StubBroker
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable import ConfigurationError, OutboxBroker, Relay, RelayOptions, WorkerRelay, bind, schema
from dramatiq_reliable._sql import compose, validate_schema
from dramatiq_reliable.binding import bound_connection
from dramatiq_reliable.cli.common import duration_ms as _duration_ms
from dramatiq_reliable.database import Database
from dramatiq_reliable.outbox import wake
from dramatiq_reliable.testing import drain_outbox


def test_bind_rejects_what_is_not_a_psycopg_connection_and_says_what_to_pass():
    class SqlAlchemyLike:
        driver_connection = None

    with pytest.raises(ConfigurationError, match="SQLAlchemy Session"), bind(SqlAlchemyLike()):  # type: ignore[arg-type]
        pass
    assert bound_connection() is None


@pytest.mark.parametrize(
    ("schema_name", "fix"),
    [("", "non-empty"), ("x" * 57, "shorter"), (None, "non-empty"), ("a\x00b", "NUL")],
)
def test_bad_schema_names_are_refused(schema_name, fix):
    with pytest.raises(ConfigurationError, match=fix):
        validate_schema(schema_name)


def test_schema_names_are_quoted_identifiers_never_text():
    composed = compose("SELECT * FROM {schema}.outbox", 'evil"; DROP TABLE x; --')
    assert composed.as_string(None) == 'SELECT * FROM "evil""; DROP TABLE x; --".outbox'


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"on_unbound": "drop"}, "on_unbound must be 'autocommit' or 'error'"),
        ({"max_payload_bytes": 0}, "max_payload_bytes must be an int >= 1"),
        ({"schema": ""}, "schema must be a non-empty string"),
    ],
)
def test_outbox_broker_validates_its_arguments(kwargs, fix):
    with pytest.raises(ConfigurationError, match=fix):
        OutboxBroker(url="amqp://127.0.0.1:1", database="postgresql://127.0.0.1:1/x", **kwargs)


def test_outbox_broker_needs_a_database():
    with pytest.raises(TypeError, match="database"):
        OutboxBroker(url="amqp://127.0.0.1:1")  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="database= must be a Postgres URL, a psycopg_pool.ConnectionPool"):
        OutboxBroker(url="amqp://127.0.0.1:1", database=42)  # type: ignore[arg-type]


def test_constructing_a_broker_does_no_io():
    # Port 1 refuses connections: construction must still succeed, failing only on first use.
    broker = OutboxBroker(url="amqp://127.0.0.1:1", database="postgresql://127.0.0.1:1/x")
    broker.close()


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"batch_size": 0}, "batch_size must be an int from 1 to 2147483647, got 0"),
        ({"batch_size": True}, "batch_size must be an int from 1 to 2147483647, got True"),
        ({"on_published": "archive"}, "on_published must be 'mark' or 'delete', got 'archive'"),
        (
            {"backoff_min_ms": 500, "backoff_max_ms": 100},
            "backoff_max_ms must be an int >= 500 .milliseconds., got 100",
        ),
        ({"retention_ms": -1}, "retention_ms must be an int >= 0 .milliseconds. or None, got -1; None keeps"),
        ({"poll_interval_ms": 10**30}, "poll_interval_ms must be at most 3153600000000 milliseconds"),
        ({"statement_timeout_ms": 2**31}, "statement_timeout_ms must be at most 2147483647 milliseconds"),
        ({"max_attempts": 0}, "max_attempts must be an int from 1 to 2147483647 or None, got 0"),
        ({"max_priority": 256}, "max_priority must be an int from 1 to 255 or None, got 256"),
        ({"listen": 1}, "listen must be True or False, got 1"),
        ({"max_batch_bytes": "4MiB"}, "max_batch_bytes must be an int >= 1, got '4MiB'"),
    ],
)
def test_relay_validates_its_arguments(kwargs, fix):
    with pytest.raises(ConfigurationError, match=fix):
        Relay(rabbitmq_url="amqp://127.0.0.1:1", database="postgresql://127.0.0.1:1/x", **kwargs)


def _options(function: Any) -> dict[str, tuple[Any, Any]]:
    """The keyword-only parameters of ``function`` a relay option names: {name: (annotation, default)}."""
    fields = {field.name for field in dataclasses.fields(RelayOptions)}
    return {
        name: (parameter.annotation, parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
        if name in fields and parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize(
    "function",
    [Relay, Relay.from_broker, WorkerRelay, drain_outbox],
    ids=["Relay", "Relay.from_broker", "WorkerRelay", "drain_outbox"],
)
def test_every_relay_option_is_an_explicit_keyword_with_the_one_default(function):
    """Editors and mypy see every option: spelt out, typed, defaulting to RelayOptions' value, no **options."""
    expected = {field.name: (field.type, field.default) for field in dataclasses.fields(RelayOptions)}
    assert _options(function) == expected
    kinds = {parameter.kind for parameter in inspect.signature(function).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds


def test_a_misspelt_relay_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        Relay(rabbitmq_url="amqp://127.0.0.1:1", database="postgresql://127.0.0.1:1/x", batchsize=10)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        Relay.from_broker(StubBroker(), batchsize=10)  # type: ignore[call-arg]


def test_relay_from_broker_needs_an_outbox_broker():
    with pytest.raises(ConfigurationError, match="needs a broker that sends through the outbox"):
        Relay.from_broker(StubBroker())  # type: ignore[arg-type]


def test_database_refuses_both_or_neither_source():
    with pytest.raises(ConfigurationError):
        Database()
    with pytest.raises(ConfigurationError, match="max_size"):
        Database(url="postgresql://x", max_size=0)


def test_migrations_are_numbered_uniquely_and_name_their_tables():
    migrations = schema.migrations()
    versions = [m.version for m in migrations]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert versions[-1] == schema.LATEST_VERSION
    assert "outbox" in migrations[0].text


def test_migration_sql_records_every_version():
    text = schema.migration_sql(schema="s1")
    for migration in schema.migrations():
        assert f"VALUES ({migration.version}, '{migration.name}')" in text
    assert "VALUES (1," not in schema.migration_sql(schema="s1", since=1)


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("30s", 30_000), ("15m", 900_000), ("6h", 21_600_000), ("7d", 604_800_000), ("2", 2000)],
)
def test_cli_durations(text, ms):
    assert _duration_ms(text) == ms


def test_cli_rejects_a_garbage_duration_with_an_example():
    with pytest.raises(argparse.ArgumentTypeError, match="e.g. 30s"):
        _duration_ms("soon")


def test_worker_relay_options_are_checked_where_they_are_written():
    with pytest.raises(ConfigurationError, match="batch_size must be an int from 1"):
        WorkerRelay(batch_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        WorkerRelay(batchsize=10)  # type: ignore[call-arg]
    # Where the relay publishes and reads comes from the broker, never from the middleware.
    for taken in ("database", "schema", "rabbitmq_url", "max_priority", "queue_type", "delivery_limit"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{taken}'"):
            WorkerRelay(**{taken: "x"})
    assert WorkerRelay(on_published="delete", max_attempts=None).options == RelayOptions(
        on_published="delete", max_attempts=None
    )


def test_purge_refuses_a_batch_that_would_never_finish():
    from dramatiq_reliable.outbox import purge_published

    database = Database(url="postgresql://127.0.0.1:1/x")
    with pytest.raises(ConfigurationError, match="batch_size must be an int from 1"):
        purge_published(database, schema="s", older_than_ms=0, batch_size=0)
    with pytest.raises(ConfigurationError, match="older_than_ms must be at most"):
        purge_published(database, schema="s", older_than_ms=10**30)


def test_a_relay_that_keeps_rows_purges_only_when_told_how_old():
    relay = Relay(rabbitmq_url="amqp://127.0.0.1:1", database="postgresql://127.0.0.1:1/x", retention_ms=None)
    with pytest.raises(ConfigurationError, match="pass older_than_ms="):
        relay.purge()


@given(
    st.integers(min_value=0, max_value=10_000),
    st.floats(min_value=0.001, max_value=3600.0),
    st.floats(min_value=0.0001, max_value=1.0),
)
def test_an_idle_sleep_is_within_the_upper_half_of_its_growing_bound_and_never_past_the_ceiling(
    step: int, ceiling_s: float, first_s: float
) -> None:
    """The idle backoff grows from first_s, is capped at the ceiling, and keeps at least half its bound."""
    bound = min(ceiling_s, first_s * wake.GROWTH ** min(step, 400))
    delay = wake.idle_delay_s(step, ceiling_s=ceiling_s, first_s=first_s)
    assert bound / 2 <= delay <= bound <= ceiling_s


def test_idle_sleeps_are_jittered_so_relays_do_not_probe_in_lockstep() -> None:
    """Two relays at the same idle step draw different sleeps."""
    draws = {wake.idle_delay_s(5, ceiling_s=1.0) for _ in range(50)}
    assert len(draws) > 1


def test_the_wake_channel_is_named_after_the_schema() -> None:
    """The channel the relays listen on and wake_relays() notifies."""
    assert wake.channel("app") == "app.outbox"


def test_outbox_admin_refuses_bad_bounds_before_touching_the_connection():
    from dramatiq_reliable.outbox.admin import failing_rows, outbox_stats, published_older_than

    untouched: Any = object()  # any use of the connection would fail with AttributeError
    for limit in (0, True, 2**63):
        with pytest.raises(ConfigurationError, match="limit must be an int from 1 to"):
            failing_rows(untouched, limit=limit)
    with pytest.raises(ConfigurationError, match="statement_timeout_ms must be at most 2147483647"):
        outbox_stats(untouched, statement_timeout_ms=2**31)
    with pytest.raises(ConfigurationError, match="older_than_ms must be an int >= 0"):
        published_older_than(untouched, older_than_ms=-1)


def test_wait_for_refuses_an_interval_that_would_spin():
    from dramatiq_reliable.testing import wait_for

    with pytest.raises(ConfigurationError, match="interval_ms must be an int >= 1"):
        wait_for(lambda: True, interval_ms=0)
    with pytest.raises(ConfigurationError, match="timeout_ms must be an int >= 0"):
        wait_for(lambda: True, timeout_ms=-1)


def test_wait_for_describes_the_state_at_the_failure_when_given_a_callable():
    from dramatiq_reliable.testing import wait_for

    seen: list[int] = []

    def poll() -> bool:
        seen.append(len(seen))
        return False

    with pytest.raises(AssertionError, match=r"within 0 ms: polled 1 time\(s\)$"):
        wait_for(poll, timeout_ms=0, message=lambda: f"polled {len(seen)} time(s)")
    with pytest.raises(AssertionError, match=r"within 0 ms: \(describing the failure raised KeyError: 'x'\)"):
        wait_for(poll, timeout_ms=0, message=lambda: {}["x"])
    with pytest.raises(AssertionError, match=r"within 0 ms: as given$"):
        wait_for(poll, timeout_ms=0, message="as given")
