"""Batches and Workflows refuse a write timeout that is not a positive number of milliseconds."""

from __future__ import annotations

import pytest

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.workflows import Batches, Workflows


@pytest.mark.parametrize("middleware", [Batches, Workflows])
@pytest.mark.parametrize("bad", [0, -1, 1.5, "30s", True])
def test_write_timeout_ms_must_be_a_positive_int(middleware: type, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="write_timeout_ms"):
        middleware(write_timeout_ms=bad)


def test_write_timeout_ms_is_kept() -> None:
    assert Batches(write_timeout_ms=500).write_timeout_ms == 500
    assert Workflows().write_timeout_ms == 30_000
