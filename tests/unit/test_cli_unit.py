"""The command line's shape: help texts, defaults, environment, version, output helpers, logging.

No service is needed: these read the parser and the helpers, or run commands that stop before
connecting.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import logging
import subprocess
import sys

import pytest
from support_cli import LEAVES

from dramatiq_reliable import cli
from dramatiq_reliable.cli import ExitCode, main, output
from dramatiq_reliable.cli.common import duration_ms
from dramatiq_reliable.health import Health, QueueHealth


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.option_strings and action.help != argparse.SUPPRESS]


def test_top_level_help_lists_the_environment_and_every_exit_code(capsys):
    assert main(["--help"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "DATABASE_URL" in out and "RABBITMQ_URL" in out
    for code in ExitCode:
        assert f"  {int(code)}  " in out, code


def test_version_comes_from_the_installed_metadata(capsys):
    assert main(["--version"]) == ExitCode.OK
    assert capsys.readouterr().out == f"dramatiq-reliable {importlib.metadata.version('dramatiq-reliable')}\n"


@pytest.mark.parametrize(("path", "parser"), LEAVES, ids=[" ".join(path) for path, _ in LEAVES])
def test_every_command_has_a_description_and_every_option_help_and_its_default(path, parser):
    assert parser.description, f"{' '.join(path)} --help has no description"
    formatter = parser._get_formatter()
    for action in _options(parser):
        assert action.help, f"{' '.join(path)} {action.option_strings[0]} has no help"
        if action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in formatter._expand_help(action), (path, action.option_strings)


def test_relay_help_shows_the_defaults_of_its_options(capsys):
    assert main(["relay", "--help"]) == ExitCode.OK
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 500)", "(default: mark)", "(default: 250ms)", "(default: 1d)", "(default: none)"):
        assert shown in text


def test_help_names_the_environment_variables_and_never_prints_their_password(monkeypatch, capsys):
    monkeypatch.setenv("DATABASE_URL", "postgresql://app:hunter2@db.example:5432/app")
    monkeypatch.setenv("RABBITMQ_URL", "amqp://app:hunter2 x@mq.example:5672/%2F")
    assert main(["status", "--help"]) == ExitCode.OK
    text = " ".join(capsys.readouterr().out.split())
    assert "$DATABASE_URL, now postgresql://app:***@db.example:5432/app" in text
    assert "$RABBITMQ_URL, now amqp://app:***@mq.example:5672/%2F" in text
    assert "hunter2" not in text
    monkeypatch.delenv("DATABASE_URL")
    assert main(["outbox", "stats", "--help"]) == ExitCode.OK
    assert "$DATABASE_URL if set, else postgresql://postgres@127.0.0.1:5432/postgres" in " ".join(
        capsys.readouterr().out.split()
    )


def test_a_usage_error_is_one_line_naming_the_command_and_its_help(capsys):
    assert main(["relay", "--batch-size", "lots"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err == (
        "dramatiq-reliable relay: error: argument --batch-size: 'lots' is not a whole number; "
        "see 'dramatiq-reliable relay --help'\n"
    )


def test_migrate_since_needs_sql_and_with_it_prints_only_later_migrations(capsys):
    assert main(["migrate", "--since", "2"]) == ExitCode.USAGE
    assert "--since applies only with --sql" in capsys.readouterr().err
    assert main(["migrate", "--sql", "--since", "2", "--schema", "app_jobs"]) == ExitCode.OK
    printed = capsys.readouterr().out
    # 0003 onwards: the dead letters and 0006's change to the outbox, not 0001 that created it.
    assert '"app_jobs".dead_letters' in printed and 'CREATE TABLE "app_jobs".outbox (' not in printed
    assert "-- 0006_outbox_no_notify" in printed


def test_python_dash_m_runs_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "dramatiq_reliable", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and "exit codes:" in result.stdout and result.stderr == ""


@pytest.mark.parametrize(
    ("text", "ms"), [("500ms", 500), ("1.5s", 1500), ("2w", 1_209_600_000), ("36500d", 36_500 * 86_400_000)]
)
def test_durations_up_to_a_hundred_years(text, ms):
    assert duration_ms(text) == ms


@pytest.mark.parametrize("text", ["36501d", "999999999w", "9" * 400, "1e3s", "-1s", "soon"])
def test_durations_past_a_hundred_years_or_unreadable_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        duration_ms(text)


# -- output ----------------------------------------------------------------------------------


def test_tables_align_numbers_right_and_cut_the_last_column_to_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    lines = output.table(
        ["ID", "N", "ERROR"], [["1", "7", "ValueError: " + "x" * 100], ["22", "10", "short"]], right=[1], fit_last=True
    ).splitlines()
    assert lines[0] == "ID   N  ERROR"
    assert lines[1].startswith("1    7  ValueError: x") and lines[1].endswith("…") and len(lines[1]) <= 40
    assert lines[2] == "22  10  short"


def test_counts_agree_with_their_nouns():
    assert [output.count(n, "row") for n in (0, 1, 2, 1500)] == ["0 rows", "1 row", "2 rows", "1,500 rows"]
    assert output.count(1, "message waiting", "messages waiting") == "1 message waiting"


def test_a_listing_prints_json_for_scripts_a_line_when_empty_and_else_a_table(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")

    class Row:
        def __init__(self, id: str, n: int) -> None:
            self.id, self.n = id, n

        def asdict(self) -> dict[str, object]:
            return {"id": self.id, "n": self.n}

    def listing(rows: list[Row], as_json: bool) -> str:
        output.print_rows(
            rows, as_json=as_json, empty="no rows", headers=["ID", "N"], cells=lambda r: [r.id, str(r.n)], right=(1,)
        )
        return capsys.readouterr().out

    assert listing([], as_json=True) == "[]\n", "scripts read an empty list, never the sentence"
    assert listing([], as_json=False) == "no rows\n"
    assert listing([Row("a", 7), Row("bb", 10)], as_json=False) == "ID   N\na    7\nbb  10\n"
    assert listing([Row("a", 7)], as_json=True) == '[\n  {\n    "id": "a",\n    "n": 7\n  }\n]\n'


def test_one_record_lines_its_values_up_after_the_longest_label():
    assert output.labelled([("batch", "b1"), ("progress", "1 of 2 finished")]) == (
        "batch     b1\nprogress  1 of 2 finished"
    )


@pytest.mark.parametrize(("command", "noun"), [("jobs", "job"), ("batches", "batch"), ("workflows", "workflow")])
def test_cancel_without_yes_and_without_a_terminal_is_refused_before_connecting(command, noun, capsys):
    # An unreachable URL: a refused cancel must not even try to connect.
    argv = [command, "cancel", "x1", "--database-url", "postgresql://nobody@127.0.0.1:1/none"]
    assert main(argv) == ExitCode.ABORTED
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err
        == f"dramatiq-reliable: error: refusing to cancel {noun} x1 without confirmation: stdin is not a terminal; pass --yes\n"
    )


def test_ages_use_the_one_format():
    now = datetime.datetime(2024, 5, 2, 12, 0, tzinfo=datetime.timezone.utc)
    assert output.ago(now - datetime.timedelta(seconds=75), now) == "75s"
    assert output.ago(now + datetime.timedelta(seconds=5), now) == "0.0s"  # clocks disagree: never negative
    assert output.age(None) == "-"


def test_status_json_totals_are_zero_not_null_when_the_services_answered_with_no_queue():
    answered = Health(queues=(), collected_at=0.0, counted=frozenset({"depth", "outbox_backlog", "xq"}))
    assert answered.as_dict()["totals"]["depth"] == 0 and answered.totals()["xq"] == 0
    assert answered.totals()["outbox_oldest_age_s"] is None  # no row: no age
    assert answered.totals()["dead_letters"] is None  # not read: unknown
    summed = Health(queues=(QueueHealth("a", xq=2), QueueHealth("b", xq=3)), collected_at=0.0)
    assert summed.totals()["xq"] == 5


# -- logging ---------------------------------------------------------------------------------


def test_commands_log_warnings_only_the_relay_info_and_every_line_is_redacted(capsys):
    ours = logging.getLogger("dramatiq_reliable.cli.test")
    with cli._logging(verbose=False, level=logging.WARNING):
        ours.info("an info line")
        ours.warning("connecting to postgresql://app:hunter2@db/app failed")
        logging.getLogger("psycopg.pool").warning("error connecting in 'dramatiq-reliable'")
    err = capsys.readouterr().err
    assert "an info line" not in err and "error connecting" not in err
    assert "postgresql://app:***@db/app failed" in err and "hunter2" not in err
    with cli._logging(verbose=False, level=logging.INFO):
        ours.info("relay published 1 row")
    assert "relay published 1 row" in capsys.readouterr().err
    # Nothing is left behind for the next command (or test) in the process.
    ours.info("after")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("position", ["before", "after"])
def test_verbose_shows_the_traceback_with_the_password_masked(capsys, position):
    command = ["outbox", "stats", "--database-url", "postgresql://app:hunter2@127.0.0.1:1/app"]
    argv = ["-v", *command] if position == "before" else [*command, "-v"]
    assert main(argv) == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("dramatiq-reliable: error: cannot reach Postgres: ")
    assert "Traceback (most recent call last)" in err and "hunter2" not in err


def test_the_readme_lists_every_exit_code_as_the_help_does():
    from pathlib import Path

    from dramatiq_reliable.cli.common import EXIT_CODE_HELP

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("## Command line") : readme.index("## Documentation")]

    def plain(text: str) -> str:  # the README quotes code with backticks, the help with quotes
        return text.replace("`", "").replace("'", "")

    for code, text in EXIT_CODE_HELP.items():
        assert plain(f"| {int(code)} | {text} |") in plain(section), code


def test_event_log_lines_round_their_float_durations():
    from dramatiq_reliable.events import _format

    assert _format({"count": 1, "duration_ms": 16.89747400041597, "schema": "s"}) == (
        "count=1 duration_ms=16.897 schema='s'"
    )
