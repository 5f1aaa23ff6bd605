"""join_until_empty: RabbitmqBroker.join's contract, shared by both Postgres-backed brokers."""

from __future__ import annotations

import time

import pytest
from dramatiq.errors import QueueJoinTimeout
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable import ConfigurationError
from dramatiq_reliable.joining import join_until_empty


class Counts:
    """Answers the given counts in turn (then 0), and records the sleeps between them."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = list(counts)
        self.asked = 0
        self.sleeps: list[float] = []

    def __call__(self) -> int:
        self.asked += 1
        return self.counts.pop(0) if self.counts else 0

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@given(
    counts=st.lists(st.integers(min_value=0, max_value=3), max_size=30),
    min_successes=st.integers(min_value=1, max_value=5),
)
def test_it_returns_at_the_first_count_that_ends_min_successes_empty_counts_in_a_row(
    counts: list[int], min_successes: int
) -> None:
    answers = Counts(counts)
    join_until_empty("q", answers, min_successes=min_successes, idle_time=100, timeout=None, sleep=answers.sleep)
    seen = [*counts, *[0] * min_successes][: answers.asked]
    assert seen[-min_successes:] == [0] * min_successes
    assert not any(seen[end - min_successes : end] == [0] * min_successes for end in range(min_successes, len(seen)))
    # idle_time between counts, none after the last
    assert answers.sleeps == [0.1] * (answers.asked - 1)


def test_a_queue_that_never_empties_times_out_after_timeout_milliseconds() -> None:
    started = time.monotonic()
    with pytest.raises(QueueJoinTimeout):
        join_until_empty("q", lambda: 1, min_successes=1, idle_time=10, timeout=200)
    assert time.monotonic() - started >= 0.2


def test_timeout_zero_counts_once() -> None:
    answers = Counts([])
    join_until_empty("q", answers, min_successes=1, idle_time=100, timeout=0, sleep=answers.sleep)
    assert answers.asked == 1
    with pytest.raises(QueueJoinTimeout):
        join_until_empty("q", Counts([1]), min_successes=1, idle_time=100, timeout=0)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"min_successes": 0}, "min_successes"),
        ({"min_successes": True}, "min_successes"),
        ({"idle_time": -1}, "idle_time"),
        ({"idle_time": 0.5}, "idle_time"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": "10s"}, "timeout"),
        ({"timeout": 10**30}, "timeout"),
    ],
)
def test_bad_arguments_are_refused_naming_them(options: dict[str, object], named: str) -> None:
    arguments: dict[str, object] = {"min_successes": 1, "idle_time": 0, "timeout": None, **options}
    with pytest.raises(ConfigurationError, match=named):
        join_until_empty("q", lambda: 0, **arguments)  # type: ignore[arg-type]
