"""Test-suite plugin: an embedded Postgres when DATABASE_URL is unset, and one line for skipped RabbitMQ tests.

Imported by conftest.py before it reads DATABASE_URL.  With DATABASE_URL unset, it starts
:class:`~dramatiq_reliable.embedded.EmbeddedPostgres` in ``.dramatiq-reliable/postgres-tests`` of the
checkout, sets DATABASE_URL for the tests and the processes they start, says so in one line,
and stops the server at exit.  A real DATABASE_URL always wins (CI exports one).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import pytest

from dramatiq_reliable.embedded import EmbeddedPostgres

_RABBITMQ_SKIP = "RabbitMQ is not reachable"
_embedded_url: str | None = None


def _start() -> None:
    global _embedded_url
    if os.environ.get("DATABASE_URL"):
        return
    server = EmbeddedPostgres(data_dir=Path(__file__).resolve().parents[1] / ".dramatiq-reliable" / "postgres-tests")
    os.environ["DATABASE_URL"] = _embedded_url = server.start()
    atexit.register(server.stop)


_start()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line naming the embedded Postgres if one ran, and one for the tests skipped for want of a RabbitMQ."""
    if _embedded_url is not None:
        terminalreporter.write_line(f"DATABASE_URL is not set: the tests ran on an embedded Postgres at {_embedded_url}")
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if _RABBITMQ_SKIP in str(getattr(report, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} tests skipped: no RabbitMQ reachable; start one or set RABBITMQ_URL to run them"
        )
