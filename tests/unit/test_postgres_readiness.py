"""SchemaGate: one error while the queue table is missing, checks at a growing interval, opens by itself."""

from __future__ import annotations

import itertools
import logging

import psycopg
import pytest

from dramatiq_reliable import SchemaNotReady
from dramatiq_reliable.postgres.readiness import FIRST_RECHECK_MS, MAX_RECHECK_MS, REMINDER_MS, SchemaGate


class Schema:
    """A schema that is missing until ``migrated`` is set; counts the checks."""

    def __init__(self) -> None:
        self.migrated = False
        self.down = False
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if self.down:
            raise psycopg.OperationalError("connection refused")
        if not self.migrated:
            raise SchemaNotReady(
                "the queue tables in schema 's' do not exist; run 'dramatiq-reliable migrate --schema s'"
            )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def schema() -> Schema:
    return Schema()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def gate(schema: Schema, clock: Clock) -> SchemaGate:
    return SchemaGate(schema.check, schema="s", clock=clock)


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_missing_table_is_said_once_and_checked_again_less_and_less_often(
    gate: SchemaGate, schema: Schema, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    due: list[float] = []
    for _ in range(200):  # ten minutes of a consumer asking every 3 s
        before = schema.checks
        assert gate.is_open() is False
        if schema.checks > before:
            due.append(clock.now)
        clock.now += 3
    intervals = [later - earlier for earlier, later in itertools.pairwise(due)]
    assert intervals[0] == pytest.approx(3)  # 1 s, asked again 3 s later
    assert intervals == sorted(intervals)
    assert max(intervals) <= MAX_RECHECK_MS / 1000 + 3
    assert len(due) < 30  # not every 3 s
    (error,) = _errors(caplog)
    assert error.levelno == logging.ERROR
    assert "run 'dramatiq-reliable migrate --schema s'" in error.getMessage()
    assert "starts consuming by itself" in error.getMessage()


def test_the_error_is_repeated_only_after_the_reminder_interval(
    gate: SchemaGate, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    gate.is_open()
    clock.now += REMINDER_MS / 1000 - 1
    gate.nudge()
    gate.is_open()
    assert len(_errors(caplog)) == 1
    clock.now += 1
    gate.nudge()
    gate.is_open()
    assert len(_errors(caplog)) == 2


def test_it_opens_once_migrated_and_then_asks_nothing(
    gate: SchemaGate, schema: Schema, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert gate.is_open() is False
    schema.migrated = True
    assert gate.is_open() is False  # not due yet
    clock.now += FIRST_RECHECK_MS / 1000
    assert gate.is_open() is True
    assert "starts consuming" in caplog.records[-1].getMessage()
    checks = schema.checks
    for _ in range(10):
        assert gate.is_open() is True
    assert schema.checks == checks


def test_a_nudge_checks_at_once(gate: SchemaGate, schema: Schema) -> None:
    assert gate.is_open() is False
    schema.migrated = True
    gate.nudge()  # a queue notification: the table is there
    assert gate.is_open() is True


def test_a_table_lost_while_running_closes_the_gate_until_it_is_back(
    gate: SchemaGate, schema: Schema, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    schema.migrated = True
    assert gate.is_open() is True
    gate.lost(psycopg.errors.UndefinedTable('relation "s.queue" does not exist'))
    assert gate.is_open() is False
    (error,) = _errors(caplog)
    assert 'relation "s.queue" does not exist' in error.getMessage()
    assert "run 'dramatiq-reliable migrate --schema s'" in error.getMessage()
    clock.now += FIRST_RECHECK_MS / 1000
    assert gate.is_open() is True


def test_an_unreachable_database_is_not_a_missing_schema(
    gate: SchemaGate, schema: Schema, caplog: pytest.LogCaptureFixture
) -> None:
    schema.down = True
    with pytest.raises(psycopg.OperationalError):
        gate.is_open()
    assert _errors(caplog) == []
    schema.down = False
    schema.migrated = True
    assert gate.is_open() is True
