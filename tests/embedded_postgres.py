"""Test-suite plugin: an embedded Postgres when DATABASE_URL is unset, and one line for skipped RabbitMQ tests.

Imported by conftest.py before it reads DATABASE_URL.  With DATABASE_URL unset, it starts
:class:`~dramatiq_reliable.embedded.EmbeddedPostgres` in ``.dramatiq-reliable/postgres-tests`` of the
checkout, sets DATABASE_URL for the tests and the processes they start, says so in one line,
and stops the server at exit.  A real DATABASE_URL always wins (CI exports one).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dramatiq_reliable.embedded import EmbeddedPostgres

_RABBITMQ_SKIP = "RabbitMQ is not reachable"


def _start() -> None:
    if os.environ.get("DATABASE_URL"):
        return
    server = EmbeddedPostgres(data_dir=Path(__file__).resolve().parents[1] / ".dramatiq-reliable" / "postgres-tests")
    os.environ["DATABASE_URL"] = server.start()
    atexit.register(server.stop)
    print(f"DATABASE_URL is not set: tests use an embedded Postgres at {os.environ['DATABASE_URL']}", file=sys.stderr)


_start()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line for every test skipped for want of a RabbitMQ, naming the variable to set."""
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if _RABBITMQ_SKIP in str(getattr(report, "longrepr", ""))
    ]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} tests skipped: no RabbitMQ reachable; start one or set RABBITMQ_URL to run them"
        )
