"""Command lines for the CLI's property tests, drawn from the parser's own actions.

Shared by the closed-port test (tests/unit/test_cli_hostile.py) and the one against a real
Postgres (tests/integration/test_cli_arguments.py).  Every URL drawn here points at port 1 of
the loopback or cannot be parsed, so nothing it draws reaches a server by accident.
"""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass

from hypothesis import strategies as st

from dramatiq_reliable.cli import ExitCode, build_parser, main
from dramatiq_reliable.cli.common import BIGINT_MAX, Duration, Integer, queue_name, schema_name

SECRET = "Pw7f3a9c"
CLOSED_PG = f"postgresql://app:{SECRET}@127.0.0.1:1/app"
CLOSED_AMQP = f"amqp://app:{SECRET}@127.0.0.1:1/%2F"
DOCUMENTED = {int(code) for code in ExitCode}
# Exits that are errors, said in one line; NOT_FOUND, REFUSED and CHECK_FAILED are results,
# reported row by row (or threshold by threshold) on their own lines.
_ERRORS = {ExitCode.USAGE, ExitCode.UNAVAILABLE, ExitCode.SCHEMA, ExitCode.ABORTED}


class Terminal(io.StringIO):
    """A stdin that says it is a terminal, holding the user's answers (``Terminal("y\\n")``)."""

    def isatty(self) -> bool:
        return True


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def run(argv: list[str]) -> Outcome:
    """``main(argv)`` with stdout and stderr encoded as a terminal's are (strict / backslashreplace)."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True)
    saved = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO()
    try:
        code = main(argv)
    finally:
        sys.stdout, sys.stderr, sys.stdin = saved
    return Outcome(code, out_bytes.getvalue().decode(), err_bytes.getvalue().decode())


def assert_well_behaved(outcome: Outcome, argv: list[str]) -> None:
    """Never a traceback or a password; a documented code other than 1; an error in one line."""
    everything = outcome.out + outcome.err
    # 1 is for the unexpected: no command line, however odd, should get it.
    assert outcome.code in DOCUMENTED - {ExitCode.ERROR}, (argv, outcome)
    assert "Traceback" not in everything, (argv, outcome)
    assert SECRET not in everything, (argv, outcome)
    if outcome.code in _ERRORS:
        assert len(outcome.err.splitlines()) == 1, (argv, outcome)
        assert outcome.err.startswith("dramatiq-reliable"), (argv, outcome)


_odd_text = st.one_of(
    st.text(max_size=30),
    st.binary(max_size=12).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
    st.sampled_from(["", " ", "-", "--", "0", "-1", "1e400", "nan", "inf", "9" * 30, "x" * 300, "pg_catalog"]),
)
_durations = st.builds(
    lambda n, unit: f"{n}{unit}",
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "ms", "s", "m", "h", "d", "w"]),
)
_odd_durations = st.one_of(
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(min_value=10**6), st.sampled_from(["", "ms", "w", "y"])),
    st.sampled_from(["999999999w", "0.5s", "2024-05-01", "9999-12-31T23:59:59-23:59", "0001-01-01", "1e3s"]),
)
_integers = st.integers(min_value=-(2**70), max_value=2**70).map(str)
_cursors = st.builds(lambda a, b: f"{a}.{b}", st.integers(min_value=0, max_value=2**60), st.integers(1, 10**6))
_queue_names = st.from_regex(r"[a-z_][a-z0-9._-]{0,20}", fullmatch=True)
_schema_names = st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True)

# Every URL points at port 1 of the loopback (or cannot be parsed): nothing can reach a server.
_pg_urls = st.one_of(
    st.just(CLOSED_PG),
    st.builds(
        lambda scheme, user, password, host, port, tail: f"{scheme}{user}:{password}@{host}{port}/{tail}",
        st.sampled_from(["postgresql://", "postgres://", "", "mysql://", "postgresql:/"]),
        st.sampled_from(["app", "", "a b", "%zz"]),
        st.sampled_from([SECRET, f"{SECRET} x", f"{SECRET}:x", f"{SECRET}%zz", f"'{SECRET}"]),
        st.sampled_from(["127.0.0.1", "[::1", "[::1]"]),
        st.sampled_from([":1", ":abc", ":99999", ":1,x"]),
        st.sampled_from(["app", "app?foo=bar", "app?connect_timeout=abc", "app?sslmode=nope"]),
    ),
    st.sampled_from(
        [
            f"host=127.0.0.1 port=1 password={SECRET}",
            f"host=127.0.0.1 port=1 password={SECRET} x",
            f"host=127.0.0.1 port=1 password='{SECRET}",
            f"host=127.0.0.1 port=x password={SECRET}",
        ]
    ),
)
_amqp_urls = st.one_of(
    st.just(CLOSED_AMQP),
    st.builds(
        lambda scheme, password, port, tail: f"{scheme}app:{password}@127.0.0.1{port}/{tail}",
        st.sampled_from(["amqp://", "amqps://", "http://", "", "amqp:/"]),
        st.sampled_from([SECRET, f"{SECRET} x", f"{SECRET}:x", f"{SECRET}@x"]),
        st.sampled_from([":1", ":abc", ":99999", ""]).map(lambda port: port or ":1"),
        st.sampled_from(["%2F", "%2F?heartbeat=x", "%2F?bogus=1", "vhost"]),
    ),
    st.just(f"{CLOSED_AMQP};"),
)


def _values(action: argparse.Action) -> st.SearchStrategy[str]:
    """Values for one option: mostly what its type expects, sometimes past its limits or odd text.

    Mostly valid, so that most command lines get past the parser to where a URL, a bound or
    the database is checked; one hostile value is enough to test what the parser does.
    """
    kind = action.type
    if action.dest == "database_url":
        return _pg_urls
    if action.dest == "rabbitmq_url":
        return _amqp_urls
    edge: st.SearchStrategy[str] = _odd_text
    if action.choices:
        valid: st.SearchStrategy[str] = st.sampled_from([str(choice) for choice in action.choices])
    elif isinstance(kind, Duration) or getattr(kind, "__name__", "") in ("duration_ms", "point_in_time"):
        valid, edge = _durations, _odd_durations
    elif isinstance(kind, Integer):
        valid = st.integers(min_value=kind.minimum, max_value=min(kind.maximum, 10**6)).map(str)
        limits = [kind.maximum, kind.maximum + 1, BIGINT_MAX + 1, kind.minimum - 1, 10**25]
        edge = st.one_of(st.sampled_from([str(value) for value in limits]), _integers)
    elif kind is queue_name:
        valid, edge = _queue_names, st.sampled_from(["q" * 253, "a b", "", ".XQ"])
    elif getattr(kind, "__name__", "") == "module_name":
        # Never a module that exists: importing one could do anything (antigravity opens a browser).
        valid = st.sampled_from(["dr_no_such_module", "dr_no_such.module", "dr_missing:broker"])
        edge = st.sampled_from(["1abc", "a..b", "a:b:c", "", "x" * 201])
    elif kind is schema_name:
        valid, edge = _schema_names, st.sampled_from(["pg_x", "x" * 64, ""])
    elif getattr(kind, "__name__", "") == "_cursor":
        valid, edge = _cursors, st.builds(lambda a, b: f"{a}.{b}", _integers, _integers)
    else:
        valid = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)
    return st.integers(min_value=0, max_value=9).flatmap(lambda n: _odd_text if n == 0 else edge if n <= 2 else valid)


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.extend(_leaves(child, (*path, name)))
    return found or [(path, parser)]


# `dev` starts an embedded Postgres and serves until interrupted: drawn here, it would start a
# server in a directory named by hypothesis and block the run forever.
_LEAVES = [(path, parser) for path, parser in _leaves(build_parser()) if path[:1] != ("dev",)]
# -v asks for tracebacks, --help and --version for other output: not what this test is about.
_SKIPPED = {"help", "verbose", "version"}


LEAVES = _LEAVES
# `web` and `metrics` serve until interrupted, so command_lines() never draws them either (their
# refusals are tested in tests/unit/test_web_cli.py and tests/unit/test_prometheus_unit.py).
_DRAWN = [(path, parser) for path, parser in _LEAVES if path[:1] not in (("web",), ("metrics",))]


@st.composite
def command_lines(draw: st.DrawFn, *, database_url: str | None = None, schema: str | None = None) -> list[str]:
    """A command line of any command, with options drawn from its actions.

    ``database_url`` and ``schema``, when given, replace whatever would be drawn for them: a
    test against a real database keeps every command inside its own schema.
    """
    fixed = {"database_url": database_url, "schema": schema}
    path, parser = draw(st.sampled_from(_DRAWN))
    argv = list(path)
    options: list[list[str]] = []
    dests = set()
    for action in parser._actions:
        if action.dest in _SKIPPED or action.help == argparse.SUPPRESS or fixed.get(action.dest):
            continue
        if not action.option_strings:  # a positional: ids, or one id
            many = action.nargs in ("*", "+")
            values = draw(
                st.lists(_values(action), min_size=0 if action.nargs == "*" else 1, max_size=3 if many else 1)
            )
            argv.extend(values)
            continue
        if draw(st.integers(min_value=0, max_value=3)):  # each option in one line out of four
            continue
        dests.add(action.dest)
        flag = draw(st.sampled_from(action.option_strings))
        options.append([flag] if action.nargs == 0 else [flag, draw(_values(action))])
    options = draw(st.permutations(options))
    for tokens in options:
        argv.extend(tokens)
    # A command line without its own URLs uses closed ports; a relay drains once, never forever.
    known = {action.dest for action in parser._actions}
    if "schema" in known and schema:
        argv += ["--schema", schema]
    if "database_url" in known and "database_url" not in dests:
        argv += ["--database-url", database_url or CLOSED_PG]
    if "rabbitmq_url" in known and "rabbitmq_url" not in dests:
        argv += ["--rabbitmq-url", CLOSED_AMQP]
    if path in (("relay",), ("scheduler",)) and "--once" not in argv:
        argv.append("--once")
    return argv
