"""Workflow results that Postgres cannot store are refused with the fix, before any SQL (no service)."""

from __future__ import annotations

from typing import Any

import pytest

from dramatiq_reliable.workflows.workflow import MAX_RESULT_BYTES, _result_json


@pytest.mark.parametrize(
    ("result", "fix"),
    [
        (object(), "is not JSON"),
        (float("nan"), "is not JSON"),
        ("x" * MAX_RESULT_BYTES, f"over the limit of {MAX_RESULT_BYTES}; store the data in a table"),
        ({"name": "a\x00b"}, "holds a NUL character"),
        (["\ud800"], "holds a lone surrogate"),
    ],
)
def test_a_result_postgres_cannot_store_is_refused_with_the_fix(result: Any, fix: str) -> None:
    stored, error = _result_json(result)
    assert stored is None
    assert error is not None and fix in error


@pytest.mark.parametrize("result", [None, 0, "a\\u0000b", {"ids": [1, 2]}, "é" * 100, "x" * (MAX_RESULT_BYTES - 2)])
def test_a_small_json_result_is_kept_as_it_is(result: Any) -> None:
    stored, error = _result_json(result)
    assert error is None and stored is not None and stored.obj == result
