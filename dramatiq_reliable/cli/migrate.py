"""``dramatiq-reliable migrate``: create or upgrade the tables, or print the SQL to apply elsewhere."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import schema
from .common import ExitCode, Integer, UsageError, connect

__all__ = ["register"]

_DESCRIPTION = """\
Create the tables in --schema, or bring them up to the latest version.  Safe to run from
several processes at once (an advisory lock serialises them) and again and again (applied
migrations are skipped).  Run it before starting workers and relays of a new version.

With --sql, print the SQL instead of running it, for migration tools such as Alembic,
Django or Flyway; --since N prints only the migrations after version N.  The script is
safe to run twice: each migration is guarded by the schema's version table, so on a schema
that already has it nothing changes.
"""


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``migrate``; ``parents`` supply ``--database-url`` and ``--schema``."""
    parser = subparsers.add_parser(
        "migrate", parents=list(parents), help="create or upgrade the tables", description=_DESCRIPTION
    )
    parser.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    parser.add_argument(
        "--since",
        type=Integer(minimum=0),
        metavar="VERSION",
        help="with --sql: only the migrations after this version (default: all)",
    )
    parser.set_defaults(handler=_migrate)
    return parser


def _migrate(args: argparse.Namespace) -> int:
    if args.sql:
        sys.stdout.write(schema.migration_sql(schema=args.schema, since=args.since or 0))
        return ExitCode.OK
    if args.since is not None:
        raise UsageError("--since applies only with --sql; 'migrate' alone applies every missing migration")
    with connect(args, autocommit=True) as conn:
        applied = schema.migrate(conn, schema=args.schema)
    if len(applied) == 1:
        print(f"schema {args.schema!r}: applied migration {applied[0]}")
    elif applied:
        print(f"schema {args.schema!r}: applied migrations {', '.join(str(v) for v in applied)}")
    else:
        print(f"schema {args.schema!r} is up to date (version {schema.LATEST_VERSION})")
    return ExitCode.OK
