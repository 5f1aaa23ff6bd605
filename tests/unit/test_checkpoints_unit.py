"""Checkpoint input is refused before anything touches a database, with an error that names the fix."""

from __future__ import annotations

import datetime as dt

import pytest

from dramatiq_reliable import (
    CheckpointError,
    CheckpointWindow,
    ConfigurationError,
    NoCurrentJob,
    ReliableError,
    checkpoint,
)
from dramatiq_reliable.idempotency.context import Job, Running, current_running

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, tzinfo=UTC)


def _open(*args, **kwargs):
    """Enter and leave a checkpoint block that does nothing."""
    with checkpoint(*args, **kwargs):
        pass


def test_outside_a_job_without_conn_says_to_pass_conn():
    with pytest.raises(NoCurrentJob, match=r"outside a job with no conn=.*pass conn="):
        _open("orders-sync", initial=T0)


@pytest.mark.parametrize("initial", [None, "2026-01-01", 1.5, True, dt.date(2026, 1, 1)])
def test_an_initial_that_is_neither_an_aware_datetime_nor_an_int_is_refused(initial):
    with pytest.raises(CheckpointError, match=r"initial must be an aware datetime or an int.*pass e\.g\."):
        _open("orders-sync", initial=initial)


def test_a_naive_initial_datetime_is_refused():
    with pytest.raises(CheckpointError, match=r"naive datetime.*tzinfo=timezone.utc"):
        _open("orders-sync", initial=dt.datetime(2026, 1, 1))


def test_an_initial_outside_bigint_is_refused():
    with pytest.raises(CheckpointError, match="outside bigint"):
        _open("ids", initial=2**63)


@pytest.mark.parametrize("name", ["", "   ", None, 7, "a\x00b", "x" * 201])
def test_a_bad_name_is_refused(name):
    with pytest.raises(CheckpointError, match=r"checkpoint name must be .*'orders-sync'"):
        _open(name, initial=0)


@pytest.mark.parametrize("lag_ms", [-1, 1.5, True, 10**30])
def test_a_bad_lag_is_refused_by_the_one_argument_checker(lag_ms):
    with pytest.raises(ConfigurationError, match=r"lag_ms must be (an int >= 0|at most)"):
        _open("ids", initial=0, lag_ms=lag_ms)


@pytest.mark.parametrize("transactions", [1, "yes", None])
def test_transactions_must_be_a_bool(transactions):
    with pytest.raises(ConfigurationError, match=r"transactions must be True or False"):
        _open("ids", initial=0, transactions=transactions)


def test_a_transaction_id_checkpoint_takes_an_int_initial():
    with pytest.raises(CheckpointError, match=r"transactions=True counts transaction ids.*pass initial=0"):
        _open("events-export", initial=T0, transactions=True)


def test_a_conn_that_is_not_a_psycopg_connection_is_refused():
    with pytest.raises(CheckpointError, match=r"conn must be a psycopg Connection, got 'str'"):
        _open("ids", initial=0, conn="postgresql://x")  # type: ignore[arg-type]


def test_a_timestamp_window_refuses_to_move_backwards_or_past_until():
    window = CheckpointWindow("orders-sync", T0, T0 + dt.timedelta(hours=1))
    with pytest.raises(CheckpointError, match=r"cannot move backwards .*pass the highest watermark"):
        window.advance(to=T0 - dt.timedelta(seconds=1))
    with pytest.raises(CheckpointError, match=r"past the end of its window.*window.until"):
        window.advance(to=T0 + dt.timedelta(hours=2))
    window.advance(to=T0 + dt.timedelta(minutes=10))
    with pytest.raises(CheckpointError, match="cannot move backwards"):
        window.advance(to=T0 + dt.timedelta(minutes=5))
    assert window.watermark == T0 + dt.timedelta(minutes=10)


def test_a_timestamp_window_records_until_unless_advanced():
    window = CheckpointWindow("orders-sync", T0, T0 + dt.timedelta(hours=1))
    assert window.watermark == T0 + dt.timedelta(hours=1)


def test_an_integer_window_keeps_its_watermark_until_advanced_and_refuses_other_types():
    window = CheckpointWindow("ids", 10, None)
    assert window.watermark == 10
    with pytest.raises(CheckpointError, match="holds integers, but advance"):
        window.advance(to=T0)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="holds integers"):
        window.advance(to=True)
    with pytest.raises(CheckpointError, match="cannot move backwards from 10 to 9"):
        window.advance(to=9)
    window.advance(to=25)
    assert window.watermark == 25


def test_checkpoint_errors_are_reliable_errors_and_value_errors():
    assert issubclass(CheckpointError, ReliableError)
    assert issubclass(CheckpointError, ValueError)


def test_in_a_record_mode_job_without_conn_says_there_is_no_job_connection():
    job = Job("sync", "k", "record", "m-1")
    token = current_running.set(Running(job, None, b"", 0.0))  # type: ignore[arg-type]
    try:
        with pytest.raises(NoCurrentJob, match=r"in a job of mode 'record' with no conn="):
            _open("ids", initial=0)
    finally:
        current_running.reset(token)
