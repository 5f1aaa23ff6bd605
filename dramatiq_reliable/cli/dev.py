"""``dramatiq-reliable dev``: an embedded Postgres for development, migrated, until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .. import _sql, schema
from ..embedded import DEFAULT_DATA_DIR, EmbeddedPostgres
from .common import ExitCode, Integer

__all__ = ["register"]

_DESCRIPTION = """\
Start a Postgres server shipped as a Python package (the 'embedded' extra) with its data in
--data-dir, apply the migrations, print one line with its URL, and stop it at exit (Ctrl-C or
SIGTERM).  Point DATABASE_URL at that URL and run the demo, a worker or the tests: nothing
else needs to be installed.  A development server: it listens on 127.0.0.1 only, with trust
authentication.
"""


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``dev`` (it takes no connection options: it starts the server they would name)."""
    parser = subparsers.add_parser(
        "dev", parents=list(parents), help="run an embedded Postgres for development", description=_DESCRIPTION
    )
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help=f"the data directory (default: {DEFAULT_DATA_DIR})"
    )
    parser.add_argument("--port", type=Integer(minimum=1, maximum=65535), help="the TCP port (default: a free one)")
    parser.add_argument(
        "--schema", default=_sql.DEFAULT_SCHEMA, help=f"the schema to migrate (default: {_sql.DEFAULT_SCHEMA})"
    )
    parser.set_defaults(handler=_dev)
    return parser


def _dev(args: argparse.Namespace) -> int:
    server = EmbeddedPostgres(data_dir=args.data_dir, port=args.port)
    url = server.start()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # SIGINT too: a shell starts background jobs with SIGINT ignored, so no KeyboardInterrupt.
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        schema.migrate(url, schema=args.schema)
        print(f"embedded Postgres running at {url} (data in {server.data_dir}); Ctrl-C stops it", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.stop()
        print("embedded Postgres stopped", file=sys.stderr)
    return ExitCode.OK
