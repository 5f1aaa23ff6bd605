"""backoff_ms(): bounded, capped, never instant, and growing with the attempt number."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable.classify import Jitter, backoff_ceiling_ms, backoff_ms
from dramatiq_reliable.retries import DEFAULT_MAX_BACKOFF, DEFAULT_MIN_BACKOFF

JITTERS: list[Jitter] = ["full", "proportional", "none"]

attempts = st.integers(min_value=1, max_value=10_000)
units = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
ratios = st.floats(min_value=0.0, max_value=1.0)


@st.composite
def bounds(draw: st.DrawFn) -> tuple[int, int]:
    minimum = draw(st.integers(min_value=1, max_value=10**7))
    maximum = draw(st.integers(min_value=minimum, max_value=7 * 24 * 3600 * 1000))
    return minimum, maximum


@given(attempts, bounds(), st.sampled_from(JITTERS), units, ratios)
def test_delay_is_between_half_min_backoff_and_the_cap(
    attempt: int, limits: tuple[int, int], jitter: Jitter, u: float, ratio: float
) -> None:
    """Every delay is at least 1 ms and min_backoff // 2, and at most the ceiling, itself at most max_backoff."""
    minimum, maximum = limits
    delay = backoff_ms(
        attempt, min_backoff=minimum, max_backoff=maximum, jitter=jitter, jitter_ratio=ratio, rand=lambda: u
    )
    ceiling = backoff_ceiling_ms(attempt, min_backoff=minimum, max_backoff=maximum)
    assert delay >= 1
    assert delay >= minimum // 2
    assert delay <= ceiling <= maximum


@given(attempts, bounds())
def test_ceiling_doubles_until_the_cap_and_never_shrinks(attempt: int, limits: tuple[int, int]) -> None:
    """The un-jittered delay is min_backoff * 2 ** (attempt - 1), capped, and non-decreasing."""
    minimum, maximum = limits
    current = backoff_ceiling_ms(attempt, min_backoff=minimum, max_backoff=maximum)
    following = backoff_ceiling_ms(attempt + 1, min_backoff=minimum, max_backoff=maximum)
    assert current <= following <= maximum
    assert following == min(maximum, 2 * current) or current == maximum


@given(attempts, bounds(), st.sampled_from(JITTERS), units, ratios)
def test_for_the_same_random_draw_delays_never_shrink(
    attempt: int, limits: tuple[int, int], jitter: Jitter, u: float, ratio: float
) -> None:
    """With the jitter draw fixed, a later attempt never waits less than an earlier one."""
    minimum, maximum = limits

    def delay(n: int) -> int:
        return backoff_ms(
            n, min_backoff=minimum, max_backoff=maximum, jitter=jitter, jitter_ratio=ratio, rand=lambda: u
        )

    assert delay(attempt) <= delay(attempt + 1)


@given(attempts, bounds(), units, ratios)
def test_proportional_jitter_stays_within_its_ratio_below_the_ceiling(
    attempt: int, limits: tuple[int, int], u: float, ratio: float
) -> None:
    """BullMQ-style jitter takes at most jitter_ratio off the ceiling (or down to the floor)."""
    minimum, maximum = limits
    ceiling = backoff_ceiling_ms(attempt, min_backoff=minimum, max_backoff=maximum)
    delay = backoff_ms(
        attempt, min_backoff=minimum, max_backoff=maximum, jitter="proportional", jitter_ratio=ratio, rand=lambda: u
    )
    assert delay >= ceiling * (1 - ratio) - 1  # -1: the delay is truncated to whole ms


@given(bounds())
def test_huge_attempt_numbers_are_capped_not_overflowing(limits: tuple[int, int]) -> None:
    """Attempt one million is simply the cap."""
    minimum, maximum = limits
    assert backoff_ceiling_ms(10**6, min_backoff=minimum, max_backoff=maximum) == maximum


def test_full_jitter_spans_floor_to_ceiling() -> None:
    """A draw of 0 gives the floor (half of min_backoff) and a draw near 1 gives nearly the ceiling."""
    low = backoff_ms(4, min_backoff=1000, max_backoff=60_000, rand=lambda: 0.0)
    high = backoff_ms(4, min_backoff=1000, max_backoff=60_000, rand=lambda: 0.999999)
    assert low == 500
    assert 7990 <= high <= 8000


def test_min_backoff_of_one_ms_still_never_gives_zero() -> None:
    """The floor is at least 1 ms, so no retry is instant."""
    assert backoff_ms(1, min_backoff=1, max_backoff=1, rand=lambda: 0.0) == 1


@pytest.mark.parametrize(
    ("attempt", "ceiling"),
    [(1, 15_000), (2, 30_000), (3, 60_000), (4, 120_000), (5, 240_000), (6, 480_000), (7, 600_000), (20, 600_000)],
)
def test_default_ceilings_match_the_documented_table(attempt: int, ceiling: int) -> None:
    """The defaults (15 s doubling to a 10 min cap) give the table in docs/retries.md."""
    assert backoff_ceiling_ms(attempt, min_backoff=DEFAULT_MIN_BACKOFF, max_backoff=DEFAULT_MAX_BACKOFF) == ceiling


def test_default_cap_is_below_rabbitmq_consumer_timeout() -> None:
    """The default max_backoff leaves RabbitMQ's 30-minute consumer_timeout well clear."""
    assert DEFAULT_MAX_BACKOFF <= 30 * 60 * 1000 / 2
