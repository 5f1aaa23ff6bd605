"""``dramatiq-reliable doctor``: check a deployment from the outside and say what will hurt."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..doctor import Finding, diagnose
from . import output
from .common import Duration, ExitCode, configured_rabbitmq_url, database_url, print_error

__all__ = ["exit_code", "register", "render"]

_COMMAND_DESCRIPTION = """\
Check a deployment from the outside, reading only: the pooler before Postgres and what it
disables, the schema version, missing or invalid indexes, bloat of our tables, whether a relay
publishes (the oldest due outbox row), RabbitMQ's consumer_timeout against the longest delay and
job, the clock of this host against Postgres', and the statement and idle-in-transaction
timeouts against what our statements and jobs need.  Each finding says what to do.

Exit 0 when nothing is wrong (warnings are printed; --strict makes them count), 5 when a check
found a problem, 4 when the schema is missing or behind, 3 when Postgres or RabbitMQ cannot be
reached.  RabbitMQ is checked when --rabbitmq-url or $RABBITMQ_URL is given.
"""


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``doctor`` command; ``parents`` supply the database, schema and RabbitMQ options."""
    parser = subparsers.add_parser(
        "doctor",
        parents=list(parents),
        help="check a deployment's settings and say what will hurt, with the fix",
        description=_COMMAND_DESCRIPTION,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--strict", action="store_true", help="exit 5 on warnings too")
    parser.add_argument(
        "--consumer-timeout",
        type=Duration(minimum_ms=1),
        metavar="DURATION",
        help="RabbitMQ's consumer_timeout, e.g. 30m (AMQP does not tell it; RabbitMQ's default is assumed)",
    )
    parser.add_argument(
        "--longest-job",
        type=Duration(),
        metavar="DURATION",
        help="the longest an actor may run (its time_limit), e.g. 2h, checked against the timeouts",
    )
    parser.set_defaults(handler=_handle)
    return parser


def _handle(args: argparse.Namespace) -> int:
    findings = diagnose(
        database_url(args),
        schema_name=args.schema,
        rabbitmq_url=configured_rabbitmq_url(args),
        consumer_timeout_ms=args.consumer_timeout,
        longest_job_ms=args.longest_job,
    )
    code = exit_code(findings, strict=args.strict)
    # What cannot be reached is said on stderr too, in one line, as every command does.
    unreachable = [f.summary for f in findings if f.check in _SERVICES and f.severity == "fail"]
    if unreachable:
        print_error("; ".join(unreachable))
    if args.json:
        output.print_json({"ok": code == ExitCode.OK, "findings": [finding.as_dict() for finding in findings]})
    else:
        print(render(findings))
    return code


def exit_code(findings: Sequence[Finding], *, strict: bool = False) -> ExitCode:
    """The command's exit code: what cannot be reached first, then the schema, then any problem."""
    failed = {finding.check for finding in findings if finding.severity == "fail"}
    if failed & _SERVICES:
        return ExitCode.UNAVAILABLE
    if "schema" in failed:
        return ExitCode.SCHEMA
    if failed or (strict and any(finding.severity == "warn" for finding in findings)):
        return ExitCode.CHECK_FAILED
    return ExitCode.OK


_SERVICES = frozenset({"postgres", "rabbitmq"})
_MARKS = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


def render(findings: Sequence[Finding]) -> str:
    """One line per check, and under each warning or problem its fix."""
    rows = [(finding.check, _MARKS[finding.severity], finding.summary) for finding in findings]
    lines = [output.table(("check", "", "finding"), rows, fit_last=False)]
    fixes = [finding for finding in findings if finding.severity != "ok" and finding.fix]
    if fixes:
        lines.append("")
        lines.extend(f"fix {finding.check}: {finding.fix}" for finding in fixes)
    problems = sum(finding.severity == "fail" for finding in findings)
    warnings = sum(finding.severity == "warn" for finding in findings)
    lines.append("")
    lines.append(
        "no problems found"
        if not problems and not warnings
        else f"{output.count(problems, 'problem')}, {output.count(warnings, 'warning')}"
    )
    return "\n".join(lines)
