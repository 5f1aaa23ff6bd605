"""Test-suite plugin: an embedded Postgres when DATABASE_URL is unset.

Imported by conftest.py before it reads DATABASE_URL.  With DATABASE_URL unset, it starts
:class:`~dramatiq_reliable.embedded.EmbeddedPostgres` in ``.dramatiq-reliable/postgres-tests`` of the
checkout, sets DATABASE_URL for the tests and the processes they start, and stops the server at
exit.  A real DATABASE_URL always wins (CI exports one).  conftest.py's ``pytest_terminal_summary``
names the server (output printed at import is captured) and any missing service.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from dramatiq_reliable.embedded import EmbeddedPostgres

#: The embedded server's URL when this plugin started one, else None.
embedded_url: str | None = None


def _start() -> None:
    global embedded_url
    if os.environ.get("DATABASE_URL"):
        return
    server = EmbeddedPostgres(data_dir=Path(__file__).resolve().parents[1] / ".dramatiq-reliable" / "postgres-tests")
    os.environ["DATABASE_URL"] = embedded_url = server.start()
    atexit.register(server.stop)


_start()
