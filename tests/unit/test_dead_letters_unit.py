"""Dead letters without a network: fingerprints, culprits, what a failure records, formatting, the parser."""

from __future__ import annotations

import argparse
import datetime
import io
import json
import traceback

import pytest
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import SkipMessage
from dramatiq.middleware.time_limit import TimeLimitExceeded
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable import CommitOutcomeUnknown, ConfigurationError, JobCommitFailed, Unrecoverable
from dramatiq_reliable._util import type_name
from dramatiq_reliable.cli import dead_letters as cli
from dramatiq_reliable.dead_letters import (
    Culprit,
    DeadLetterFilter,
    DeadLetters,
    PostgresDeadLetterStore,
    find_culprit,
    fingerprint,
    format_traceback,
    notify_channel,
)
from dramatiq_reliable.dead_letters.analysis import _describe_failure, _json_text
from dramatiq_reliable.dead_letters.cursor import decode_cursor, encode_cursor

UTC = datetime.timezone.utc


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as error:
        return error
    raise AssertionError("did not raise")


def _parse_json() -> None:
    json.loads("{not json")


def _charge(amount: int) -> None:
    if amount > 0:
        raise ValueError("card declined")


def _charge_moved(amount: int) -> None:
    # Same bug, one line lower after an unrelated edit.

    if amount > 0:
        raise ValueError("card declined")


def _data(**options) -> dict:
    return {
        "queue_name": "default",
        "actor_name": "charge",
        "args": [1],
        "kwargs": {},
        "options": options,
        "message_id": "m-1",
        "message_timestamp": 1_700_000_000_000,
    }


# -- culprit and fingerprint ------------------------------------------------------------------


def test_the_culprit_is_the_innermost_frame_of_user_code_not_the_library_that_raised():
    error = _raised(_parse_json)
    culprit = find_culprit(error)
    assert culprit is not None and culprit.user
    assert culprit.function == "_parse_json" and culprit.module.endswith("test_dead_letters_unit")
    assert str(culprit) == f"{culprit.module}:{culprit.lineno} in _parse_json"


def test_an_error_with_no_user_frame_is_blamed_on_its_innermost_frame():
    error = _raised(lambda: json.loads("{"))
    tb = error.__traceback__
    while tb is not None and not tb.tb_frame.f_globals["__name__"].startswith("json"):
        tb = tb.tb_next
    culprit = find_culprit(error.with_traceback(tb))  # only the json module's frames are left
    assert culprit is not None and not culprit.user and culprit.module.startswith("json")
    assert find_culprit(ActorNotFound("ghost")) is None


def test_one_bug_keeps_one_fingerprint_across_lines_and_differs_from_other_bugs():
    a = _raised(lambda: _charge(1))
    b = _raised(lambda: _charge(2))
    moved = find_culprit(_raised(lambda: _charge_moved(1)))
    assert fingerprint("ValueError", find_culprit(a)) == fingerprint("ValueError", find_culprit(b))
    same_function_other_line = Culprit(moved.module, "_charge", moved.lineno + 7)  # type: ignore[union-attr]
    assert fingerprint("ValueError", same_function_other_line) == fingerprint("ValueError", find_culprit(a))
    assert fingerprint("ValueError", moved) != fingerprint("ValueError", find_culprit(a))
    assert fingerprint("KeyError", find_culprit(a)) != fingerprint("ValueError", find_culprit(a))
    assert len(fingerprint(None, None)) == 16


def test_error_types_are_named_unambiguously():
    class Declined(Exception):
        pass

    assert type_name(ValueError) == "ValueError"
    assert type_name(ActorNotFound) == "dramatiq.errors.ActorNotFound"
    assert type_name(Declined).endswith(
        "test_dead_letters_unit.test_error_types_are_named_unambiguously.<locals>.Declined"
    )


def test_long_tracebacks_keep_their_head_and_the_error_at_the_tail():
    def fails() -> None:
        raise RuntimeError("x" * 10_000 + " the real error")

    error = _raised(fails)
    full = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    clipped = format_traceback(error, max_chars=4000)
    assert len(full) > 4000 and len(clipped) <= 4000
    assert clipped.startswith("Traceback") and clipped.rstrip().endswith("x the real error")
    assert "characters cut" in clipped
    assert format_traceback(None) == ""


# -- what a failure records ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "ran", "prior", "options", "reason", "attempts"),
    [
        (ValueError("x"), True, 2, {"retries": 3}, "retries_exhausted", 3),
        (KeyError("x"), True, 0, {}, "unrecoverable", 1),
        (SkipMessage("Message age limit exceeded"), False, None, {"retries": 1}, "age_limit", 1),
        (ActorNotFound("ghost"), False, None, {}, "failed", 0),
        # The retry middleware did not count this run: no evidence the budget was spent.
        (ValueError("x"), True, 2, {"retries": 2}, "failed", 3),
        (Unrecoverable("gone"), True, 0, {"retries": 1}, "unrecoverable", 1),
        (TimeLimitExceeded(), True, 0, {"retries": 1}, "time_limit", 1),
        (
            TimeLimitExceeded(),
            True,
            2,
            {"retries": 3, "retry_decision": {"retry": False, "outcome": "exhausted", "attempt": 3}},
            "time_limit",
            3,
        ),
        (CommitOutcomeUnknown("connection lost during COMMIT"), True, 0, {}, "commit_outcome_unknown", 1),
        (
            JobCommitFailed("x"),
            True,
            0,
            {"retry_decision": {"retry": False, "outcome": "outcome_unknown", "attempt": 3}},
            "commit_outcome_unknown",
            1,
        ),
        (JobCommitFailed("serialization failure at COMMIT"), True, 0, {}, "failed", 1),
        (
            ValueError("x"),
            True,
            0,
            {"retry_decision": {"retry": False, "outcome": "fail", "category": "unknown", "reason": "retry_error"}},
            "failed",
            1,
        ),
        (
            ValueError("x"),
            True,
            0,
            {
                "retry_decision": {
                    "retry": False,
                    "outcome": "fail",
                    "category": "permanent",
                    "reason": "unrecoverable",
                    "attempt": 1,
                }
            },
            "unrecoverable",
            1,
        ),
        (
            ValueError("x"),
            True,
            None,
            {"retry_decision": {"retry": False, "outcome": "exhausted", "reason": "timeout", "attempt": 4}},
            "retries_exhausted",
            4,
        ),
        # A "retry" decision left from an earlier attempt does not explain an age-limit death.
        (
            SkipMessage("Message age limit exceeded"),
            False,
            None,
            {"retries": 2, "retry_decision": {"retry": True, "reason": "timeout"}},
            "age_limit",
            2,
        ),
        (None, False, None, {}, "failed", 0),
    ],
)
def test_each_way_of_dying_gets_its_reason_and_attempt_count(error, ran, prior, options, reason, attempts):
    failure = _describe_failure(
        _data(**options), error, ran=ran, prior_retries=prior, throws=(KeyError,), max_traceback_chars=10_000
    )
    assert (failure.reason, failure.attempts) == (reason, attempts)


def test_every_reason_has_its_own_explanation_and_nothing_else_is_a_reason():
    from dramatiq_reliable.dead_letters import REASONS

    assert set(REASONS) == {
        "retries_exhausted",
        "unrecoverable",
        "commit_outcome_unknown",
        "time_limit",
        "age_limit",
        "imported_from_xq",
        "delivery_limit",
        "failed",
    }
    assert len(set(REASONS.values())) == len(REASONS)


def test_the_http_status_comes_from_the_decision_or_from_the_error_chain():
    class Response:
        status_code = 503

    class HttpError(Exception):
        response = Response()

    def wrapped() -> None:
        try:
            raise HttpError("upstream")
        except HttpError as inner:
            raise RuntimeError("sync failed") from inner

    failure = _describe_failure(
        _data(), _raised(wrapped), ran=True, prior_retries=0, throws=None, max_traceback_chars=9999
    )
    assert failure.http_status == 503
    decided = _describe_failure(
        _data(
            retry_decision={
                "retry": False,
                "outcome": "fail",
                "category": "permanent",
                "reason": "http_404",
                "http_status": 404,
            }
        ),
        ValueError("x"),
        ran=True,
        prior_retries=0,
        throws=None,
        max_traceback_chars=9999,
    )
    assert (decided.reason, decided.http_status) == ("unrecoverable", 404)
    assert decided.retry_decision is not None and decided.retry_decision["reason"] == "http_404"


def test_a_replayed_job_keeps_its_original_send_time_and_first_failure():
    failure = _describe_failure(
        _data(replay_of={"sent_at_ms": 1_600_000_000_000}, first_failure_ms=1_700_000_000_500),
        ValueError("x"),
        ran=True,
        prior_retries=0,
        throws=None,
        max_traceback_chars=9999,
    )
    assert failure.sent_ms == 1_600_000_000_000 and failure.first_failed_ms == 1_700_000_000_500


def test_values_jsonb_cannot_hold_are_stored_readably_instead_of_losing_the_dead_letter():
    assert _json_text({"args": [1, "a"]}) == ('{"args":[1,"a"]}', True)
    text, exact = _json_text({"args": ["nul\x00", float("nan"), object()]})
    assert not exact
    args = json.loads(text)["args"]
    assert args[0] == "nul\\x00" and args[1] == "nan" and args[2].startswith("<object object")
    failure = _describe_failure(
        _data(), ValueError("bad\x00byte"), ran=True, prior_retries=0, throws=None, max_traceback_chars=9999
    )
    assert "\x00" not in failure.error_message and "\x00" not in failure.traceback


# -- configuration ------------------------------------------------------------------------------


def test_the_notify_channel_is_named_after_the_schema_and_fits_postgres():
    assert notify_channel("app") == "app.dead_letters"
    notify_channel("s" * 50)
    with pytest.raises(ConfigurationError, match="longer than 50 bytes"):
        notify_channel("s" * 51)


def test_filters_refuse_naive_times_and_empty_ranges():
    now = datetime.datetime.now(UTC)
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        DeadLetterFilter(since=datetime.datetime(2024, 1, 1))
    with pytest.raises(ConfigurationError, match="not before"):
        DeadLetterFilter(since=now, until=now)
    with pytest.raises(ConfigurationError, match="non-empty string"):
        DeadLetterFilter(actor_name="")
    assert DeadLetterFilter().is_empty and DeadLetterFilter().describe() == "all"
    assert DeadLetterFilter(actor_name="a").describe() == "actor_name='a'"


def test_the_store_and_middleware_name_the_fix_for_bad_arguments():
    with pytest.raises(ConfigurationError, match="database= must be a Postgres URL, a psycopg_pool.ConnectionPool"):
        PostgresDeadLetterStore(database=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="replay_max_age_ms"):
        PostgresDeadLetterStore(database="postgresql://x@localhost/x", replay_max_age_ms=-1)
    with pytest.raises(ConfigurationError, match="batch_size"):
        PostgresDeadLetterStore(database="postgresql://x@localhost/x", batch_size=0)
    with pytest.raises(ConfigurationError, match="database= must be a Postgres URL"):
        DeadLetters(database=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="timeout_ms"):
        DeadLetters(timeout_ms=0)
    with pytest.raises(ConfigurationError, match="cursor"):
        decode_cursor("page-2")


@given(
    st.datetimes(
        min_value=datetime.datetime(1971, 1, 1), max_value=datetime.datetime(2200, 1, 1), timezones=st.just(UTC)
    ),
    st.integers(min_value=1, max_value=2**62),
)
def test_cursors_round_trip_exactly(moment, dead_letter_id):
    assert decode_cursor(encode_cursor(moment, dead_letter_id)) == (moment, dead_letter_id)


# -- the command's pieces -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("30s", 30_000), ("15m", 900_000), ("7d", 604_800_000), ("2w", 1_209_600_000), ("90", 90_000)],
)
def test_durations_read_as_people_write_them(text, ms):
    assert cli.duration_ms(text) == ms


def test_times_are_iso_dates_in_utc_or_durations_ago():
    now = datetime.datetime(2024, 5, 2, 12, 0, tzinfo=UTC)
    assert cli.point_in_time("2h", now=now) == datetime.datetime(2024, 5, 2, 10, 0, tzinfo=UTC)
    assert cli.point_in_time("2024-05-01", now=now) == datetime.datetime(2024, 5, 1, tzinfo=UTC)
    assert cli.point_in_time("2024-05-01T12:00:00+02:00").utcoffset() == datetime.timedelta(hours=2)
    assert cli.point_in_time("2024-05-01T10:00:00Z") == datetime.datetime(2024, 5, 1, 10, tzinfo=UTC)
    with pytest.raises(argparse.ArgumentTypeError, match="ISO date"):
        cli.point_in_time("yesterday")


def test_register_adds_every_action_with_the_common_options():
    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url")
    common.add_argument("--schema")
    cli.register(parser.add_subparsers(dest="command"), [common])
    args = parser.parse_args(
        ["dead-letters", "replay", "--actor", "a", "--since", "1h", "--delay", "10m", "--yes", "--schema", "s"]
    )
    assert (args.actor_name, args.delay, args.yes, args.schema, args.ids) == ("a", 600_000, True, "s", [])
    for action in ("list", "stats", "purge"):
        assert callable(parser.parse_args(["dead-letters", action]).handler)
    assert parser.parse_args(["dead-letters", "show", "12"]).id == 12
    assert parser.parse_args(["dead-letters", "discard", "3", "4", "--reason", "dup"]).ids == [3, 4]


def test_progress_rewrites_one_line_on_a_terminal_and_prints_lines_otherwise():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    progress = cli._Progress("replayed", terminal)
    progress(5000, 12000)
    progress(10000, 12000)
    progress(12000, 12000)
    progress.finish()
    assert (
        terminal.getvalue()
        == "\rreplayed 5,000/12,000 (41%)\rreplayed 10,000/12,000 (83%)\rreplayed 12,000/12,000 (100%)\n"
    )
    plain = io.StringIO()
    single = cli._Progress("replayed", plain)
    single(3, 3)  # done in one batch: nothing to show
    assert plain.getvalue() == ""


def test_capture_without_a_database_logs_critically_and_never_raises(caplog):
    from dramatiq import Message
    from dramatiq.broker import MessageProxy
    from dramatiq.brokers.stub import StubBroker

    proxy = MessageProxy(Message(queue_name="default", actor_name="charge", args=(), kwargs={}, options={}))
    proxy.stuff_exception(ValueError("boom"))
    proxy.fail()
    with caplog.at_level("CRITICAL", logger="dramatiq_reliable.dead_letters"):
        assert DeadLetters().capture(StubBroker(), proxy) is None
        DeadLetters().before_nack(StubBroker(), proxy)  # returns normally: the nack still happens
    assert "NOT stored" in caplog.text and proxy.message_id in caplog.text and "database=" in caplog.text
