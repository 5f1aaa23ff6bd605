"""The pure parts of jobs by id: the trace id and the error's frame kept in the failure record."""

from __future__ import annotations

import pytest

from dramatiq_reliable import JobNotFound, show_job
from dramatiq_reliable.jobs.attempts import error_where, trace_id_of


def test_the_trace_id_is_read_from_a_w3c_traceparent_and_nothing_else() -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id_of({"trace_context": {"traceparent": parent}}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of({"trace_context": {"traceparent": "garbage"}}) is None
    assert trace_id_of({"trace_context": "00-..."}) is None
    assert trace_id_of({}) is None


def test_where_is_the_innermost_frame_of_the_error() -> None:
    def send_email() -> None:
        raise ConnectionResetError("smtp down")

    try:
        send_email()
    except ConnectionResetError as error:
        where = error_where(error)
    assert where is not None and where.startswith(__file__) and where.endswith(" in send_email")
    assert error_where(RuntimeError("never raised")) is None


@pytest.mark.parametrize("bad", ["", "a\x00b"])
def test_an_empty_or_nul_id_is_refused_before_any_connection(bad: str) -> None:
    with pytest.raises(JobNotFound, match="not a message id or an idempotency key"):
        show_job("postgresql://nobody@127.0.0.1:1/none", "dramatiq_reliable", bad)
