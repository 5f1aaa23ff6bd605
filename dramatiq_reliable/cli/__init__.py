"""The ``dramatiq-reliable`` command: schema, relay, outbox, idempotency keys, dead letters, status.

The only place that reads the environment: ``DATABASE_URL`` and ``RABBITMQ_URL`` give the
defaults of ``--database-url`` and ``--rabbitmq-url``.  Errors print one line (the traceback
only with ``-v``) and exit with a named code.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from .. import _sql, schema
from ..database import Database
from ..errors import ReliableError
from .common import ExitCode, common_parents, duration_ms

__all__ = ["ExitCode", "common_parents", "duration_ms", "main"]

logger = logging.getLogger("dramatiq_reliable.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dramatiq-reliable", description="Outbox, retries and dead letters for Dramatiq on Postgres."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and debug logs")
    common, rabbit = common_parents()
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = commands.add_parser("migrate", parents=[common], help="create or upgrade the tables")
    migrate.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    migrate.add_argument("--since", type=int, default=0, help="with --sql: only migrations after this version")
    migrate.set_defaults(handler=_migrate)

    relay = commands.add_parser("relay", parents=[common, rabbit], help="forward outbox rows to RabbitMQ")
    relay.add_argument("--batch-size", type=int, default=500)
    relay.add_argument("--poll-interval", type=duration_ms, default=1000, help="fallback poll (default 1s)")
    relay.add_argument("--on-published", choices=["mark", "delete"], default="mark")
    relay.add_argument("--retention", type=duration_ms, default=86_400_000, help="keep published rows (default 1d)")
    relay.add_argument("--max-priority", type=int, default=None)
    relay.add_argument("--once", action="store_true", help="drain the backlog once and exit")
    relay.set_defaults(handler=_relay)

    outbox = commands.add_parser("outbox", help="inspect and maintain the outbox")
    outbox_commands = outbox.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    purge = outbox_commands.add_parser("purge", parents=[common], help="delete published rows past retention")
    purge.add_argument("--older-than", type=duration_ms, default=86_400_000, help="default 1d")
    purge.add_argument("--json", action="store_true")
    purge.set_defaults(handler=_outbox_purge)
    stats = outbox_commands.add_parser("stats", parents=[common], help="backlog, failing rows, oldest age")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=_outbox_stats)

    idempotency = commands.add_parser("idempotency", help="maintain processed-job keys")
    idempotency_commands = idempotency.add_subparsers(dest="idempotency_command", required=True, metavar="ACTION")
    keys_purge = idempotency_commands.add_parser("purge", parents=[common], help="delete expired idempotency keys")
    keys_purge.add_argument("--batch-size", type=int, default=5000)
    keys_purge.add_argument("--json", action="store_true")
    keys_purge.set_defaults(handler=_idempotency_purge)

    from . import dead_letters, status

    dead_letters.register(commands, [common])
    status.register(commands, [common, rabbit])
    return parser


Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        logging.getLogger("pika").setLevel(logging.CRITICAL)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ReliableError as error:
        _fail(args, error)
        from ..errors import SchemaNotReady

        return ExitCode.SCHEMA if isinstance(error, SchemaNotReady) else ExitCode.ERROR
    except (psycopg.OperationalError, psycopg.InterfaceError) as error:
        _fail(args, error, prefix="cannot reach Postgres: ")
        return ExitCode.UNAVAILABLE
    except KeyboardInterrupt:
        return ExitCode.ABORTED


def _fail(args: argparse.Namespace, error: BaseException, prefix: str = "") -> None:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    print(f"dramatiq-reliable: error: {prefix}{first}", file=sys.stderr)
    if args.verbose:
        import traceback

        traceback.print_exception(error)


def _database(args: argparse.Namespace) -> Database:
    return Database(url=args.database_url)


def _migrate(args: argparse.Namespace) -> int:
    _sql.validate_schema(args.schema)
    if args.sql:
        sys.stdout.write(schema.migration_sql(schema=args.schema, since=args.since))
        return ExitCode.OK
    applied = schema.migrate(args.database_url, schema=args.schema)
    if applied:
        print(f"schema {args.schema!r}: applied migrations {', '.join(str(v) for v in applied)}")
    else:
        print(f"schema {args.schema!r} is up to date (version {schema.LATEST_VERSION})")
    return ExitCode.OK


def _relay(args: argparse.Namespace) -> int:
    from ..errors import BrokerUnavailable
    from ..outbox.relay import Relay

    relay = Relay(
        rabbitmq_url=args.rabbitmq_url,
        database=_database(args),
        schema=args.schema,
        batch_size=args.batch_size,
        poll_interval_ms=args.poll_interval,
        on_published=args.on_published,
        retention_ms=args.retention,
        max_priority=args.max_priority,
    )
    if args.once:
        try:
            published = relay.drain()
        except BrokerUnavailable as error:
            _fail(args, error, prefix="cannot reach RabbitMQ: ")
            return ExitCode.UNAVAILABLE
        finally:
            relay.publisher.close()
        print(f"published {published} rows")
        return ExitCode.OK

    def stop(signum: int, _frame: Any) -> None:
        logger.info("received %s: finishing the batch in hand", signal.Signals(signum).name)
        relay.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    relay.run()
    return ExitCode.OK


def _outbox_purge(args: argparse.Namespace) -> int:
    from ..outbox.relay import purge_published

    database = _database(args)
    try:
        deleted = purge_published(database, schema=args.schema, older_than_ms=args.older_than)
    finally:
        database.close()
    print(json.dumps({"deleted": deleted}) if args.json else f"deleted {deleted} published rows")
    return ExitCode.OK


def _idempotency_purge(args: argparse.Namespace) -> int:
    from ..idempotency import purge_expired

    database = _database(args)
    try:
        deleted = purge_expired(database, schema=args.schema, batch_size=args.batch_size)
    finally:
        database.close()
    print(json.dumps({"deleted": deleted}) if args.json else f"deleted {deleted} expired idempotency keys")
    return ExitCode.OK


def _outbox_stats(args: argparse.Namespace) -> int:
    database = _database(args)
    try:
        with database.connection() as conn:
            schema.ensure_ready(conn, schema=args.schema, required=schema.OUTBOX_VERSION, feature="outbox")
            row = _sql.tuples(conn).execute(_sql.query("outbox_stats", args.schema)).fetchone()
    finally:
        database.close()
    assert row is not None
    stats = {"backlog": row[0], "failing": row[1], "oldest_age_s": round(row[2], 3)}
    if args.json:
        print(json.dumps(stats))
    else:
        for key, value in stats.items():
            print(f"{key:<14}{value}")
    return ExitCode.OK
