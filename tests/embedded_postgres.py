"""Test-suite plugin: an embedded Postgres when DATABASE_URL is unset.

Imported by conftest.py before it reads DATABASE_URL.  With DATABASE_URL unset, it starts
:class:`~dramatiq_reliable.embedded.EmbeddedPostgres` in ``.dramatiq-reliable/postgres-tests`` of the
checkout, sets DATABASE_URL for the tests and the processes they start, says so in one line,
and stops the server at exit.  A real DATABASE_URL always wins (CI exports one).  The line
naming missing services (RabbitMQ) is conftest.py's ``pytest_terminal_summary``.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from dramatiq_reliable.embedded import EmbeddedPostgres


def _start() -> None:
    if os.environ.get("DATABASE_URL"):
        return
    server = EmbeddedPostgres(data_dir=Path(__file__).resolve().parents[1] / ".dramatiq-reliable" / "postgres-tests")
    os.environ["DATABASE_URL"] = server.start()
    atexit.register(server.stop)
    print(f"DATABASE_URL is not set: tests use an embedded Postgres at {os.environ['DATABASE_URL']}", file=sys.stderr)


_start()
