"""Connections we open bound every wait: connect timeout and TCP keepalives, unless the URL says otherwise."""

from __future__ import annotations

from dramatiq_reliable.database import CONNECTION_DEFAULTS, Database


def test_a_pool_we_create_bounds_connects_and_silent_partitions(monkeypatch):
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    database = Database(url="postgresql://app@db.invalid/app")
    assert database.pool.kwargs == CONNECTION_DEFAULTS
    assert (
        CONNECTION_DEFAULTS["keepalives_idle"]
        + CONNECTION_DEFAULTS["keepalives_interval"] * CONNECTION_DEFAULTS["keepalives_count"]
        < 25
    ), "a silent partition must be noticed well within 25 s"


def test_the_url_overrides_the_defaults(monkeypatch):
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    database = Database(url="postgresql://app@db.invalid/app?connect_timeout=2&keepalives=0")
    assert "connect_timeout" not in database.pool.kwargs and "keepalives" not in database.pool.kwargs
    assert database.pool.kwargs["tcp_user_timeout"] == CONNECTION_DEFAULTS["tcp_user_timeout"]
