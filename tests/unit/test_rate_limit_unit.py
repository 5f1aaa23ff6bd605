"""Rate limits without services: limits, actor options and keys are checked before anything runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import SkipMessage

from dramatiq_reliable import ActorOptionError, ConfigurationError, Database
from dramatiq_reliable.flow import RateLimit, RateLimits
from dramatiq_reliable.flow.middleware import _provider_pause

# Never opened: a test that reached Postgres would fail on this closed port.
URL = "postgresql://postgres@127.0.0.1:9/postgres"


@pytest.fixture
def stub() -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.add_middleware(
        RateLimits(
            [RateLimit("stripe", per_second=25), RateLimit("mail", per_minute=600, burst=10)],
            database=Database(url=URL, timeout_ms=100),
        )
    )
    yield broker
    broker.close()


def _middleware(broker: StubBroker) -> RateLimits:
    return next(m for m in broker.middleware if isinstance(m, RateLimits))


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"name": "x"}, r"needs exactly one of per_second, per_minute, per_hour, got none"),
        ({"name": "x", "per_second": 5, "per_hour": 9}, r"exactly one .* got \['per_second', 'per_hour'\]"),
        ({"name": "x", "per_second": 0}, r"per_second must be an int from 1 to 1000000, got 0"),
        ({"name": "x", "per_second": True}, r"per_second must be an int .* got True"),
        ({"name": "x", "per_second": 5, "burst": 0}, r"burst must be an int from 1 .* got 0; e.g. burst=1"),
        ({"name": "x", "per_second": 5, "slow_factor": 0}, r"slow_factor must be a number above 0 .* got 0"),
        ({"name": "x", "per_second": 5, "pause_ms": 0}, r"pause_ms must be an int >= 1"),
        ({"name": "a:b", "per_second": 5}, r"rate limit name 'a:b' holds ':'"),
        ({"name": "", "per_second": 5}, r"name must be a non-empty string"),
    ],
)
def test_bad_limits_are_refused_with_the_fix(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RateLimit(**arguments)


def test_the_rate_is_kept_as_the_milliseconds_between_two_tokens() -> None:
    assert RateLimit("a", per_second=50).interval_ms == 20.0
    assert RateLimit("a", per_minute=600).interval_ms == 100.0
    assert RateLimit("a", per_hour=3600).interval_ms == 1000.0


def test_one_name_declared_with_two_limits_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"rate limit 'a' is declared twice with different limits"):
        RateLimits([RateLimit("a", per_second=5), RateLimit("a", per_second=6)])
    RateLimits([RateLimit("a", per_second=5), RateLimit("a", per_second=5)])  # the same twice is one


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ("stripes", r"actor 'bad': rate_limit names rate limit 'stripes', which RateLimits does not know"),
        ("nope:cust_1", r"names rate limit 'nope'.*declare it: RateLimits\(\[RateLimit\('nope'"),
        (25, r"rate_limit must be a limiter's name or a callable .* got 25"),
        ("", r"gave '', not a non-empty string"),
    ],
)
def test_an_unknown_limiter_fails_at_actor_declaration(stub: StubBroker, option: Any, match: str) -> None:
    with pytest.raises(ActorOptionError, match=match):
        dramatiq.actor(lambda *a: None, actor_name="bad", broker=stub, rate_limit=option)


def test_rate_limits_on_a_broker_without_a_database_asks_for_one() -> None:
    broker = StubBroker()
    broker.add_middleware(RateLimits([RateLimit("a", per_second=1)]))
    with pytest.raises(ActorOptionError, match=r"RateLimits has no database on a StubBroker; pass database="):
        dramatiq.actor(lambda: None, actor_name="lonely", broker=broker, rate_limit="a")


def test_the_key_is_the_name_or_what_the_key_function_returns(stub: StubBroker) -> None:
    middleware = _middleware(stub)
    named = dramatiq.actor(lambda: None, actor_name="charge", broker=stub, rate_limit="stripe")
    keyed = dramatiq.actor(lambda c: None, actor_name="mail", broker=stub, rate_limit=lambda c: f"mail:{c}")
    plain = dramatiq.actor(lambda: None, actor_name="plain", broker=stub)
    assert middleware.key_for(named, named.message()) == (RateLimit("stripe", per_second=25), "stripe")
    limit, key = middleware.key_for(keyed, keyed.message("c42")) or (None, None)
    assert (limit and limit.name, key) == ("mail", "mail:c42")
    assert middleware.key_for(plain, plain.message()) is None


@pytest.mark.parametrize(
    ("derive", "match"),
    [
        (lambda c: 1 / 0, r"actor 'mail': rate_limit of message .* raised ZeroDivisionError: division by zero"),
        (lambda c: 7, r"actor 'mail': rate_limit of message .* gave 7, not a non-empty string"),
        (lambda c: None, r"gave None, not a non-empty string"),
        (lambda c: f"other:{c}", r"names rate limit 'other', which RateLimits does not know"),
    ],
)
def test_a_key_function_that_fails_keeps_the_job_from_running_unlimited(
    stub: StubBroker, derive: Any, match: str
) -> None:
    ran: list[str] = []
    actor = dramatiq.actor(ran.append, actor_name="mail", broker=stub, rate_limit=derive, max_retries=0)
    proxy = MessageProxy(actor.message("c42"))
    with pytest.raises(SkipMessage, match=match):
        _middleware(stub).before_process_message(stub, proxy)
    assert proxy.failed  # dead-lettered, not retried into the same error
    # Through a real worker: the message ends dead, the actor never ran.
    actor.send("c42")
    worker = dramatiq.Worker(stub, worker_timeout=50)
    worker.start()
    try:
        stub.join(actor.queue_name, fail_fast=False)
        worker.join()
    finally:
        worker.stop()
    assert ran == []
    assert len(stub.dead_letters) == 1


def test_an_actor_without_a_limit_never_touches_postgres(stub: StubBroker) -> None:
    middleware = _middleware(stub)
    plain = dramatiq.actor(lambda: None, actor_name="plain", broker=stub)
    proxy = MessageProxy(plain.message())
    middleware.before_process_message(stub, proxy)  # the closed port would raise DatabaseUnavailable
    middleware.after_process_message(stub, proxy, exception=_Http(429, "5"))
    assert not proxy.failed


class _Http(Exception):
    def __init__(self, status: int, retry_after: str | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.status_code = status
        self.headers = {} if retry_after is None else {"Retry-After": retry_after}


def _wrapped(inner: BaseException) -> BaseException:
    try:
        raise inner
    except Exception as error:
        try:
            raise RuntimeError("the mail provider refused") from error
        except RuntimeError as outer:
            return outer


@pytest.mark.parametrize(
    ("error", "told"),
    [
        (_Http(429, "2"), (429, 2000)),
        (_Http(429), (429, None)),  # too fast, but not for how long: the limit's pause_ms
        (_Http(503, "1.5"), (503, 1500)),
        (_Http(503), None),  # a 503 that does not say when is an outage, not a limit
        (_Http(500, "3"), None),
        (_wrapped(_Http(429, "4")), (429, 4000)),
        (ValueError("429"), None),
    ],
)
def test_a_429_or_a_503_with_retry_after_is_what_pauses_a_key(error: BaseException, told: Any) -> None:
    assert _provider_pause(error) == told
