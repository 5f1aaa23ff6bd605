"""``dramatiq-reliable web`` as a process: it serves the page on loopback and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import schema
from dramatiq_reliable.testing import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def web_schema(database_url: str) -> Iterator[str]:
    name = f"web_{uuid.uuid4().hex[:12]}"
    schema.migrate(database_url, schema=name)
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.TransportError:
        return None


def test_the_command_serves_the_page_and_exits_0_on_sigterm(database_url, web_schema):
    port = _free_port()
    command = [sys.executable, "-m", "dramatiq_reliable", "web", "--port", str(port)]
    command += ["--database-url", database_url, "--schema", web_schema, "--skip-rabbitmq"]
    command += ["--allowed-host", "jobs.internal"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        page = wait_for(lambda: _get(f"http://127.0.0.1:{port}/dead-letters"), timeout_ms=20_000)
        assert page.status_code == 200
        assert 'data-testid="access-mode"' in page.text and "read-only" in page.text
        assert page.headers["x-frame-options"] == "DENY"
        assert _get(f"http://127.0.0.1:{port}/static/htmx.min.js").status_code == 200  # type: ignore[union-attr]
        # A name pointed at this machine by another site is refused; the one allowed passes.
        rebound = httpx.get(f"http://127.0.0.1:{port}/dead-letters", headers={"Host": "evil.example"}, timeout=5)
        assert rebound.status_code == 400
        allowed = httpx.get(f"http://127.0.0.1:{port}/dead-letters", headers={"Host": "jobs.internal"}, timeout=5)
        assert allowed.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err
    assert f"serving the web page for schema {web_schema!r} on http://127.0.0.1:{port}/" in err
    assert "also answering to jobs.internal" in err
    assert "web page stopped" in err
