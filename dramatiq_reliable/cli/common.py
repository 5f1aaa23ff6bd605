"""What every command shares: exit codes, the duration parser and the common options."""

from __future__ import annotations

import argparse
import enum
import os
import re

from .. import _sql

__all__ = ["DEFAULT_DATABASE_URL", "DEFAULT_RABBITMQ_URL", "DURATION", "ExitCode", "common_parents", "duration_ms"]

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


class ExitCode(enum.IntEnum):
    """Exit codes of the command, stable for scripts."""

    OK = 0
    ERROR = 1
    USAGE = 2
    UNAVAILABLE = 3  # Postgres or RabbitMQ cannot be reached
    SCHEMA = 4  # tables missing or behind: run migrate
    CHECK_FAILED = 5  # a health check crossed a threshold
    ABORTED = 6  # the user declined a confirmation
    NOT_FOUND = 7  # an id asked for does not exist
    REFUSED = 8  # some rows were left alone (too old, already handled); the rest were handled


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")


def duration_ms(text: str) -> int:
    """``500ms``, ``30s``, ``15m``, ``6h``, ``7d``, ``2w`` (a bare number is seconds) as ms."""
    match = DURATION.match(text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write e.g. 30s, 15m, 7d")
    return int(float(match[1]) * _UNITS_MS[match[2] or "s"])


def common_parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The shared option parsers: (``--database-url`` and ``--schema``, ``--rabbitmq-url``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL),
        help="Postgres URL (default: $DATABASE_URL or the local server)",
    )
    common.add_argument("--schema", default=_sql.DEFAULT_SCHEMA, help="schema of the tables (default: %(default)s)")
    rabbit = argparse.ArgumentParser(add_help=False)
    rabbit.add_argument(
        "--rabbitmq-url",
        default=os.environ.get("RABBITMQ_URL", DEFAULT_RABBITMQ_URL),
        help="RabbitMQ URL (default: $RABBITMQ_URL or the local server)",
    )
    return common, rabbit
