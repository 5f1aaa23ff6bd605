"""Idempotency(job_connections=...): the hook is checked where it is given."""

from __future__ import annotations

import pytest

from dramatiq_reliable import ConfigurationError, Idempotency
from dramatiq_reliable.idempotency import JobConnections, PooledJobConnections


def test_the_default_is_a_connection_of_the_pool_per_job():
    assert isinstance(Idempotency().job_connections, PooledJobConnections)


def test_an_object_without_acquire_and_release_is_refused_naming_the_protocol():
    with pytest.raises(ConfigurationError, match=r"job_connections must have acquire\(\) and release\(\).*got 'str'"):
        Idempotency(job_connections="django")  # type: ignore[arg-type]


def test_any_object_with_acquire_and_release_is_accepted():
    class Mine:
        def acquire(self, database, timeout_s):
            raise NotImplementedError

        def release(self, conn, *, database, committed):
            raise NotImplementedError

    mine = Mine()
    assert isinstance(mine, JobConnections)
    assert Idempotency(job_connections=mine).job_connections is mine
