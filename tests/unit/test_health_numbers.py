"""The health reading's numbers say where they came from, and the checks and the table read them right (no service)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable.cli.status import render_table
from dramatiq_reliable.errors import ConfigurationError
from dramatiq_reliable.health import (
    Health,
    QueueHealth,
    SourceCounts,
    Thresholds,
    check_health,
    collect_health,
    is_queue_name,
)

BOTH = frozenset({"postgres", "rabbitmq"})


def _reading(*queues: QueueHealth, sources: frozenset[str] = BOTH, **fields: object) -> Health:
    return Health(queues=queues, collected_at=0.0, queue_sources=sources, dead_letters_table=True, **fields)  # type: ignore[arg-type]


def _line(table: str, queue: str) -> str:
    return next(row for row in table.splitlines() if row.split()[:1] == [queue])


def test_a_depth_over_its_limit_names_both_places_when_both_hold_some():
    item = QueueHealth("q", depth=5, in_postgres=SourceCounts(depth=2), in_rabbitmq=SourceCounts(depth=3))
    assert check_health(_reading(item), Thresholds(max_queue_depth=4)) == [
        "queue 'q': 5 messages waiting (2 in Postgres, 3 in RabbitMQ), over --max-queue-depth 4"
    ]
    only_postgres = QueueHealth("q", depth=2, in_postgres=SourceCounts(depth=2), in_rabbitmq=SourceCounts())
    assert check_health(_reading(only_postgres), Thresholds(max_queue_depth=1)) == [
        "queue 'q': 2 messages waiting, over --max-queue-depth 1"
    ]


def test_a_part_over_the_limit_is_reported_while_the_other_place_cannot_be_read():
    item = QueueHealth("q", depth=None, xq=None, in_postgres=SourceCounts(depth=2, xq=4), in_rabbitmq=None)
    assert check_health(_reading(item), Thresholds(max_queue_depth=1, max_xq=3)) == [
        "queue 'q': at least 2 messages waiting (in Postgres; RabbitMQ could not be read), over --max-queue-depth 1",
        "queue 'q': at least 4 messages in its .XQ (in Postgres; RabbitMQ could not be read), over --max-xq 3",
    ]
    # Nothing known at all: nothing crossed (the outage is the exit code's business).
    assert check_health(_reading(QueueHealth("q")), Thresholds(max_queue_depth=0)) == []


def test_the_oldest_ready_message_has_its_own_threshold():
    item = QueueHealth("q", queue_oldest_age_s=301.0)
    assert check_health(_reading(item), Thresholds(max_queue_age_ms=300_000)) == [
        "queue 'q': oldest ready message has waited 5m, over --max-queue-age 5m (are its workers running?)"
    ]
    assert check_health(_reading(item), Thresholds(max_queue_age_ms=302_000)) == []
    assert check_health(_reading(QueueHealth("q")), Thresholds(max_queue_age_ms=0)) == []


@pytest.mark.parametrize(
    "limits",
    [{"max_queue_depth": True}, {"max_queue_depth": -1}, {"max_queue_age_ms": 1.5}, {"max_outbox_age_ms": "60s"}],
)
def test_thresholds_refuse_what_is_not_a_count_or_a_duration(limits):
    with pytest.raises(ConfigurationError):
        Thresholds(**limits)  # type: ignore[arg-type]


def test_the_table_splits_a_sum_only_where_postgres_holds_part_of_it():
    moving = QueueHealth(
        "moving", depth=5, delayed=1, xq=0, in_postgres=SourceCounts(2, 1, 0), in_rabbitmq=SourceCounts(3, 0, 0)
    )
    rabbit_only = QueueHealth(
        "rabbit", depth=3, delayed=0, xq=0, in_postgres=SourceCounts(), in_rabbitmq=SourceCounts(3)
    )
    table = render_table(_reading(moving, rabbit_only))
    assert "5 = 2 pg + 3 mq" in _line(table, "moving") and "1 = 1 pg + 0 mq" in _line(table, "moving")
    assert " pg" not in _line(table, "rabbit")
    assert "(pg: rows in the Postgres queue table (PostgresBroker); mq: messages in RabbitMQ)" in table
    # An outbox-only reading (Postgres's parts all zero) reads as it always did: no split, no legend.
    plain = render_table(_reading(rabbit_only))
    assert " pg" not in plain and "mq:" not in plain


def test_the_table_marks_the_part_of_a_place_that_could_not_be_read():
    down = QueueHealth("down", in_postgres=SourceCounts(depth=2), in_rabbitmq=None)
    empty = QueueHealth("empty", in_postgres=SourceCounts(), in_rabbitmq=None)
    table = render_table(_reading(down, empty, rabbitmq_error="cannot reach RabbitMQ at h:1: refused"))
    assert "2 pg + ? mq" in _line(table, "down")
    assert _line(table, "empty").split()[1] == "-"


def test_a_reading_of_one_place_shows_plain_numbers_and_says_why_rabbitmq_was_not_read():
    item = QueueHealth("q", depth=2, delayed=0, xq=0, queue_oldest_age_s=90.0, in_postgres=SourceCounts(depth=2))
    table = render_table(
        _reading(item, sources=frozenset({"postgres"}), rabbitmq_skipped="the outbox of schema 's' was never used")
    )
    assert _line(table, "q").split()[1:5] == ["2", "0", "0", "90s"]
    assert "(RabbitMQ not read: the outbox of schema 's' was never used)" in table


def test_totals_include_the_oldest_ready_message():
    reading = _reading(QueueHealth("a", queue_oldest_age_s=3.0), QueueHealth("b", queue_oldest_age_s=9.0))
    assert reading.totals()["queue_oldest_age_s"] == 9.0
    assert reading.as_dict()["rabbitmq"] == {"ok": True, "error": None, "skipped": None}


@pytest.mark.parametrize(
    "arguments",
    [
        {"statement_timeout_ms": True},
        {"statement_timeout_ms": 0},
        {"connect_timeout_ms": "5s"},
        {"discover_queues": 1},
        {"rabbitmq_only_if_used": "yes"},
        {"xq_scan_limit": 0},
        {"queues": [""]},
        {"queues": ["q" * 253]},
    ],
)
def test_collect_health_refuses_bad_arguments_before_any_io(arguments):
    with pytest.raises(ConfigurationError):
        collect_health(database="postgresql://nobody@127.0.0.1:1/none", **arguments)


@given(st.text(max_size=300))
def test_a_queue_name_is_one_rabbitmq_can_hold_with_its_suffixes(name):
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        size = None
    assert is_queue_name(name) == (size is not None and 0 < size <= 252)


@pytest.mark.parametrize("arguments", [{"ttl_ms": -1}, {"statement_timeout_ms": True}, {"statement_timeout_ms": 0}])
def test_a_health_monitor_refuses_bad_durations(arguments):
    from dramatiq_reliable.health import HealthMonitor

    with pytest.raises(ConfigurationError):
        HealthMonitor(database=None, **arguments)
