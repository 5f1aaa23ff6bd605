"""Partition settings are checked before anything touches the database."""

from __future__ import annotations

import pytest

from dramatiq_reliable import ConfigurationError, partitions


@pytest.mark.parametrize("interval_ms", [0, -1, 1000])
def test_a_partition_interval_of_zero_or_less_than_a_minute_is_refused_with_the_fix(
    database_url, db_schema, interval_ms
):
    with pytest.raises(
        ConfigurationError, match=r"interval_ms must be .* got -?\d+; .*e\.g\. one day, interval_ms=86400000"
    ):
        partitions.enable("postgresql://unused.invalid/db", schema="app", interval_ms=interval_ms)
