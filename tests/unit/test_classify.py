"""classify(): real exceptions from real clients, each mapped to the right decision.

The HTTP errors come from a server this module starts on 127.0.0.1 (ephemeral port); connection
errors from a port nobody listens on; timeouts from a socket that accepts nothing.  Nothing
leaves the machine and no service is needed: errors from real SQL are classified in
tests/integration/test_classify_postgres.py.
"""

from __future__ import annotations

import asyncio
import builtins
import email.utils
import errno
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import aiohttp
import dramatiq
import httpx
import pika
import pika.exceptions
import psycopg
import pytest
import requests
import urllib3
from hypothesis import given
from hypothesis import strategies as st

from dramatiq_reliable.classify import (
    DEFAULT_MAX_RETRY_AFTER_MS,
    Decision,
    classify,
    exception_chain,
    http_status_of,
    parse_retry_after,
    rules_from,
)
from dramatiq_reliable.errors import ConfigurationError, Unrecoverable

# --------------------------------------------------------------------------------------------
# Local servers
# --------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """GET /status/<code>?retry_after=<value> answers with that status and header."""

    def do_GET(self) -> None:
        parsed = urlparse(self.path)
        code = int(parsed.path.rsplit("/", 1)[-1])
        query = parse_qs(parsed.query)
        self.send_response(code)
        for value in query.get("retry_after", []):
            self.send_header("Retry-After", value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class Endpoints:
    http: str
    closed_port: int
    silent_port: int

    def status(self, code: int, retry_after: str | None = None) -> str:
        url = f"{self.http}/status/{code}"
        if retry_after is not None:
            url += "?" + urlencode({"retry_after": retry_after})
        return url

    @property
    def closed(self) -> str:
        return f"http://127.0.0.1:{self.closed_port}/"

    @property
    def silent(self) -> str:
        return f"http://127.0.0.1:{self.silent_port}/"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def endpoints() -> Iterator[Endpoints]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # A listener that never accepts: connections complete in the backlog, reads time out.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        yield Endpoints(
            http=f"http://127.0.0.1:{server.server_address[1]}",
            closed_port=_free_port(),
            silent_port=silent.getsockname()[1],
        )
    finally:
        server.shutdown()
        server.server_close()
        silent.close()


def caught(action: Callable[[], object]) -> BaseException:
    try:
        action()
    except BaseException as error:
        return error
    raise AssertionError(f"{action!r} did not raise")


# --------------------------------------------------------------------------------------------
# Producers of real exceptions
# --------------------------------------------------------------------------------------------


def requests_status(code: int) -> Callable[[Endpoints], BaseException]:
    return lambda ep: caught(lambda: requests.get(ep.status(code), timeout=5).raise_for_status())


def httpx_status(code: int) -> Callable[[Endpoints], BaseException]:
    return lambda ep: caught(lambda: httpx.get(ep.status(code), timeout=5).raise_for_status())


def aiohttp_call(url: str, **timeout: float) -> BaseException:
    async def run() -> None:
        client_timeout = aiohttp.ClientTimeout(**timeout) if timeout else aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=client_timeout) as session, session.get(url) as response:
            response.raise_for_status()

    return caught(lambda: asyncio.run(run()))


def urllib3_call(url: str, **kwargs: Any) -> BaseException:
    pool = urllib3.PoolManager()
    try:
        return caught(lambda: pool.request("GET", url, **kwargs))
    finally:
        pool.clear()


def pika_connect(ep: Endpoints) -> BaseException:
    params = pika.ConnectionParameters(host="127.0.0.1", port=ep.closed_port, connection_attempts=1, socket_timeout=2)
    return caught(lambda: pika.BlockingConnection(params))


def wrapped_by(outer: Callable[[], BaseException], inner: Callable[[Endpoints], BaseException]) -> Any:
    def make(ep: Endpoints) -> BaseException:
        cause = inner(ep)
        try:
            raise outer() from cause
        except BaseException as error:
            return error

    return make


def during_handling_of(inner: Callable[[Endpoints], BaseException], *, suppress: bool = False) -> Any:
    def make(ep: Endpoints) -> BaseException:
        try:
            try:
                raise inner(ep)
            except BaseException:
                if suppress:
                    raise RuntimeError("cleanup failed") from None
                raise RuntimeError("cleanup failed")  # noqa: B904 - implicit chaining is the point
        except RuntimeError as error:
            return error

    return make


class DoesNotExist(Exception):
    """Named like Django's Model.DoesNotExist; classify matches the name, not the class."""


class NoResultFound(Exception):
    """Named like SQLAlchemy's."""


class DBAPIError(Exception):
    """Shaped like sqlalchemy.exc.DBAPIError: the driver error kept as ``.orig``."""

    def __init__(self, orig: BaseException) -> None:
        super().__init__(str(orig))
        self.orig = orig


class OperationalError(DBAPIError):
    """A wrapper named like SQLAlchemy's, which is not proof of an unreachable database."""


class IntegrityError(Exception):
    """Like sqlite3.IntegrityError: a DB-API name and no SQLSTATE."""


def pg_unreachable(ep: Endpoints) -> BaseException:
    return caught(lambda: psycopg.connect(f"postgresql://postgres@127.0.0.1:{ep.closed_port}/x", connect_timeout=2))


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Endpoints], BaseException] | None = None
    retry: bool = True
    category: str = "transient"
    reason: str = ""
    http_status: int | None = None
    matched_type: str | None = None


def http_case(client: str, code: int, make: Callable[[int], Callable[[Endpoints], BaseException]]) -> Case:
    transient = code in (408, 429, 500, 502, 503, 504)
    return Case(
        f"{client}_{code}",
        make(code),
        retry=transient,
        category="transient" if transient else "permanent",
        reason=f"http_{code}",
        http_status=code,
    )


CASES = [
    *(
        http_case("requests", code, requests_status)
        for code in (400, 401, 403, 404, 405, 408, 409, 410, 422, 429, 500, 501, 502, 503, 504)
    ),
    *(http_case("httpx", code, httpx_status) for code in (404, 409, 429, 503)),
    Case("requests_refused", lambda ep: caught(lambda: requests.get(ep.closed, timeout=5)), reason="connection"),
    Case(
        "requests_read_timeout",
        lambda ep: caught(lambda: requests.get(ep.silent, timeout=0.05)),
        reason="timeout",
    ),
    Case("httpx_refused", lambda ep: caught(lambda: httpx.get(ep.closed, timeout=5)), reason="connection"),
    Case("httpx_read_timeout", lambda ep: caught(lambda: httpx.get(ep.silent, timeout=0.05)), reason="timeout"),
    Case("urllib3_refused", lambda ep: urllib3_call(ep.closed, retries=False), reason="connection"),
    Case("urllib3_max_retries", lambda ep: urllib3_call(ep.closed, retries=0), reason="connection"),
    Case(
        "urllib3_read_timeout",
        lambda ep: urllib3_call(ep.silent, retries=False, timeout=0.05),
        reason="timeout",
    ),
    Case("aiohttp_503", lambda ep: aiohttp_call(ep.status(503)), reason="http_503", http_status=503),
    Case(
        "aiohttp_404",
        lambda ep: aiohttp_call(ep.status(404)),
        retry=False,
        category="permanent",
        reason="http_404",
        http_status=404,
    ),
    Case("aiohttp_refused", lambda ep: aiohttp_call(ep.closed), reason="connection"),
    Case("aiohttp_read_timeout", lambda ep: aiohttp_call(ep.silent, sock_read=0.05), reason="timeout"),
    Case(
        "urllib_503",
        lambda ep: caught(lambda: urllib.request.urlopen(ep.status(503), timeout=5)),
        reason="http_503",
        http_status=503,
    ),
    Case(
        "urllib_410",
        lambda ep: caught(lambda: urllib.request.urlopen(ep.status(410), timeout=5)),
        retry=False,
        category="permanent",
        reason="http_410",
        http_status=410,
    ),
    Case(
        "urllib_refused_via_reason",
        lambda ep: caught(lambda: urllib.request.urlopen(ep.closed, timeout=5)),
        reason="connection",
        matched_type="ConnectionRefusedError",
    ),
    Case("pika_refused", pika_connect, reason="connection"),
    Case("pika_stream_lost", lambda ep: pika.exceptions.StreamLostError("lost"), reason="connection"),
    Case(
        "pika_connection_forced",
        lambda ep: pika.exceptions.ConnectionClosedByBroker(320, "CONNECTION_FORCED"),
        reason="connection",
    ),
    Case("builtin_timeout", lambda ep: TimeoutError("slow"), reason="timeout"),
    Case("builtin_refused", lambda ep: ConnectionRefusedError(errno.ECONNREFUSED, "refused"), reason="connection"),
    Case("socket_gaierror", lambda ep: socket.gaierror(socket.EAI_NONAME, "no such host"), reason="connection"),
    Case("oserror_reset_errno", lambda ep: OSError(errno.ECONNRESET, "reset"), reason="connection"),
    Case("oserror_etimedout", lambda ep: OSError(errno.ETIMEDOUT, "timed out"), reason="timeout"),
    Case("unrecoverable", lambda ep: Unrecoverable("user 7 does not exist"), False, "permanent", "unrecoverable"),
    Case("dramatiq_retry", lambda ep: dramatiq.Retry("later"), reason="retry_requested"),
    Case("dramatiq_rate_limit", lambda ep: dramatiq.RateLimitExceeded("busy"), reason="rate_limited"),  # type: ignore[no-untyped-call]
    Case("does_not_exist", lambda ep: DoesNotExist("Order matching query"), False, "permanent", "not_found"),
    Case("no_result_found", lambda ep: NoResultFound("no row"), False, "permanent", "not_found"),
    Case("key_error_is_unknown", lambda ep: KeyError("user_id"), True, "unknown", "unknown"),
    Case("lookup_error_is_unknown", lambda ep: LookupError("x"), True, "unknown", "unknown"),
    Case("value_error_is_unknown", lambda ep: ValueError("bad"), True, "unknown", "unknown"),
    Case(
        "cause_404_under_runtime_error",
        wrapped_by(lambda: RuntimeError("fetch failed"), requests_status(404)),
        retry=False,
        category="permanent",
        reason="http_404",
        http_status=404,
        matched_type="requests.exceptions.HTTPError",
    ),
    Case(
        "context_timeout_under_runtime_error",
        during_handling_of(lambda ep: TimeoutError("slow")),
        reason="timeout",
        matched_type="TimeoutError",
    ),
    Case(
        "suppressed_context_is_not_followed",
        during_handling_of(requests_status(404), suppress=True),
        category="unknown",
        reason="unknown",
    ),
    Case(
        "unrecoverable_wrapping_a_connection_error",
        wrapped_by(lambda: Unrecoverable("gave up"), lambda ep: ConnectionResetError("reset")),
        retry=False,
        category="permanent",
        reason="unrecoverable",
    ),
    Case(
        "dbapi_name_without_sqlstate", lambda ep: IntegrityError("UNIQUE failed"), False, "permanent", "integrity_error"
    ),
    # Postgres errors from real SQL are in tests/integration/test_classify_postgres.py.
    Case("pg_unreachable", pg_unreachable, reason="database_unavailable"),
    Case(
        "sqlalchemy_style_wrapper_of_unreachable",
        lambda ep: OperationalError(pg_unreachable(ep)),
        reason="database_unavailable",
    ),
]


@pytest.fixture(scope="module")
def produce(endpoints: Endpoints) -> Callable[[Case], BaseException]:
    def make(case: Case) -> BaseException:
        assert case.make is not None
        return case.make(endpoints)

    return make


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_real_exceptions_are_classified_by_the_table(case: Case, produce: Callable[[Case], BaseException]) -> None:
    """Each real exception gets the documented retry flag, category, reason and HTTP status."""
    exception = produce(case)
    decision = classify(exception)
    assert (decision.retry, decision.category, decision.reason) == (case.retry, case.category, case.reason), (
        f"{type(exception)!r}: {exception!r}"
    )
    if case.http_status is not None:
        assert decision.http_status == case.http_status
    if case.matched_type is not None:
        assert decision.matched_type == case.matched_type
    assert decision.error_type is not None
    assert decision.error_type.endswith(type(exception).__qualname__)


# --------------------------------------------------------------------------------------------
# Retry-After
# --------------------------------------------------------------------------------------------


def test_retry_after_seconds_on_429_is_a_floor_in_ms(endpoints: Endpoints) -> None:
    """A 429 with 'Retry-After: 2' asks for at least 2000 ms."""
    error = caught(lambda: requests.get(endpoints.status(429, "2"), timeout=5).raise_for_status())
    decision = classify(error)
    assert (decision.retry, decision.reason, decision.retry_after_ms) == (True, "http_429", 2000)


def test_retry_after_http_date_on_503_counts_from_now(endpoints: Endpoints) -> None:
    """An HTTP-date Retry-After becomes the time left until that date."""
    now = time.time()
    date = email.utils.formatdate(now + 90, usegmt=True)
    error = caught(lambda: httpx.get(endpoints.status(503, date), timeout=5).raise_for_status())
    decision = classify(error, now=now)
    assert decision.retry_after_ms is not None
    assert 89_000 <= decision.retry_after_ms <= 90_000


def test_retry_after_on_aiohttp_errors_is_read_from_the_exception_headers(endpoints: Endpoints) -> None:
    """aiohttp keeps headers on the exception itself; those count too."""
    decision = classify(aiohttp_call(endpoints.status(429, "3")))
    assert (decision.reason, decision.retry_after_ms) == ("http_429", 3000)


def test_retry_after_beyond_the_cap_fails_with_retry_after_too_long(endpoints: Endpoints) -> None:
    """A server asking for two hours fails the job instead of holding it past consumer_timeout."""
    error = caught(lambda: requests.get(endpoints.status(429, "7200"), timeout=5).raise_for_status())
    decision = classify(error)
    assert (decision.retry, decision.reason, decision.http_status) == (False, "retry_after_too_long", 429)
    assert decision.retry_after_ms == 7_200_000 > DEFAULT_MAX_RETRY_AFTER_MS
    assert classify(error, max_retry_after_ms=None).retry is True


def test_garbage_retry_after_is_ignored_not_raised(endpoints: Endpoints) -> None:
    """An unparsable Retry-After leaves a retryable status retryable, with no floor."""
    error = caught(lambda: requests.get(endpoints.status(503, "soon-ish"), timeout=5).raise_for_status())
    decision = classify(error)
    assert (decision.retry, decision.reason, decision.retry_after_ms) == (True, "http_503", None)


def test_retry_after_on_a_permanent_status_does_not_make_it_retryable(endpoints: Endpoints) -> None:
    """A 404 stays permanent whatever headers it carries."""
    error = caught(lambda: requests.get(endpoints.status(404, "1"), timeout=5).raise_for_status())
    assert classify(error).retry is False


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", 120_000),
        (" 5 ", 5_000),
        ("0", 0),
        ("1.5", 1_500),
        (b"3", 3_000),
        (7, 7_000),
        ("-1", None),
        ("", None),
        ("abc", None),
        ("1e3", None),
        ("9" * 80, None),
        (None, None),
        (3.5, None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 10_000),
        ("Wed, 21 Oct 2015 07:28:00", 10_000),
        ("Wed, 21 Oct 2015 07:27:00 GMT", 0),
        ("Wed, 99 Foo 2015 07:28:00 GMT", None),
    ],
)
def test_parse_retry_after(value: object, expected: int | None) -> None:
    """Delta-seconds and HTTP-dates parse to ms; a zone-less date is GMT; past dates are 0; garbage is None."""
    now = email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:27:50 GMT").timestamp()
    assert parse_retry_after(value, now=now) == expected


@given(st.one_of(st.text(max_size=80), st.binary(max_size=80), st.integers(), st.none(), st.floats()))
def test_parse_retry_after_never_raises(value: object) -> None:
    """Whatever a server sends, parsing yields None or a non-negative number of ms."""
    result = parse_retry_after(value, now=1_700_000_000.0)
    assert result is None or (isinstance(result, int) and result >= 0)


# --------------------------------------------------------------------------------------------
# Duck typing and robustness
# --------------------------------------------------------------------------------------------


class _Response:
    def __init__(self, status_code: object) -> None:
        self.status_code = status_code
        self.headers: dict[str, str] = {}


class StatusError(Exception):
    def __init__(self, **attributes: object) -> None:
        super().__init__("status error")
        for name, value in attributes.items():
            setattr(self, name, value)


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ({"response": _Response(503)}, 503),
        ({"status": 429}, 429),
        ({"status_code": 404}, 404),
        ({"http_status": 402}, 402),
        ({"code": 410}, 410),
        ({"response": {"ResponseMetadata": {"HTTPStatusCode": 404}}}, 404),
        ({"code": True}, None),
        ({"code": 7}, None),
        ({"code": 600}, None),
        ({"code": "404"}, None),
        ({"response": None, "status": 502}, 502),
    ],
)
def test_http_status_is_found_by_duck_typing(attributes: dict[str, object], expected: int | None) -> None:
    """Only an int from 100 to 599 in a known place counts as an HTTP status."""
    assert http_status_of(StatusError(**attributes)) == expected


class Hostile(Exception):
    """Every property raises, as some third-party errors do for unset fields."""

    @property
    def response(self) -> object:
        raise RuntimeError("no response")

    @property
    def status(self) -> object:
        raise RuntimeError("no status")

    @property
    def sqlstate(self) -> object:
        raise RuntimeError("no sqlstate")

    @property
    def orig(self) -> object:
        raise RuntimeError("no orig")


def test_properties_that_raise_do_not_break_classification() -> None:
    """A hostile exception is classified as unknown rather than crashing the worker's error path."""
    decision = classify(Hostile())
    assert (decision.retry, decision.reason) == (True, "unknown")


def test_cyclic_chains_terminate() -> None:
    """An exception whose cause loops back to itself is walked once per link."""
    first, second = ValueError("a"), ValueError("b")
    first.__cause__, second.__cause__ = second, first
    assert len(list(exception_chain(first))) == 2
    assert classify(first).reason == "unknown"


def test_very_long_chains_are_cut() -> None:
    """A chain of thousands of links is walked only so far, and deep evidence is then ignored."""
    error: BaseException = TimeoutError("deep")
    for index in range(5000):
        wrapper = ValueError(index)
        wrapper.__cause__ = error
        error = wrapper
    assert len(list(exception_chain(error))) == 32
    assert classify(error).reason == "unknown"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11+")
def test_exception_group_members_are_examined() -> None:
    """A task group's ExceptionGroup is classified by its members."""
    exception_group = getattr(builtins, "ExceptionGroup")  # noqa: B009 - absent on 3.10, which mypy targets
    group = exception_group("tasks failed", [ValueError("x"), TimeoutError("slow")])
    assert classify(group).reason == "timeout"


@given(
    st.dictionaries(
        st.sampled_from(["status", "status_code", "code", "sqlstate", "pgcode", "http_status", "orig", "reason"]),
        st.one_of(
            st.integers(),
            st.text(max_size=8),
            st.none(),
            st.booleans(),
            st.builds(TimeoutError),
            st.builds(ValueError),
        ),
    )
)
def test_classify_never_raises_on_odd_attributes(attributes: dict[str, object]) -> None:
    """Whatever attributes an exception carries, classify returns a valid decision."""
    decision = classify(StatusError(**attributes))
    assert isinstance(decision, Decision)
    assert decision.retry in (True, False)
    assert decision.category in ("transient", "permanent", "unknown")


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


class PaymentDeclined(Exception):
    pass


class CardExpired(PaymentDeclined):
    pass


def test_a_mapping_rule_overrides_the_default_for_its_type() -> None:
    """{ExceptionType: Decision} makes an unknown error permanent, most specific type first."""
    rules = {PaymentDeclined: Decision.permanent("declined"), CardExpired: Decision.permanent("card_expired")}
    assert classify(PaymentDeclined(), rules=rules).reason == "declined"
    assert classify(CardExpired(), rules=rules).reason == "card_expired"
    assert classify(ValueError(), rules=rules).reason == "unknown"


def test_a_callable_rule_can_override_a_built_in_status(endpoints: Endpoints) -> None:
    """A rule turning 409 into a transient error wins over the built-in 'fail fast on 409'."""
    error = caught(lambda: requests.get(endpoints.status(409), timeout=5).raise_for_status())

    def conflicts_retry(exception: BaseException) -> Decision | None:
        return Decision.transient("edit_conflict") if http_status_of(exception) == 409 else None

    assert classify(error).retry is False
    decision = classify(error, rules=[conflicts_retry])
    assert (decision.retry, decision.reason, decision.http_status) == (True, "edit_conflict", 409)


def test_rules_apply_to_wrapped_errors_too() -> None:
    """A rule for the cause decides when nothing recognises the wrapper."""
    try:
        raise RuntimeError("charge failed") from PaymentDeclined()
    except RuntimeError as error:
        decision = classify(error, rules={PaymentDeclined: Decision.permanent("declined")})
    assert (decision.reason, decision.error_type, decision.matched_type) == (
        "declined",
        "RuntimeError",
        f"{__name__}.PaymentDeclined",
    )


def test_unrecoverable_beats_every_rule() -> None:
    """A rule cannot make Unrecoverable retry: the job's author said never."""
    assert classify(Unrecoverable("no"), rules=[lambda e: Decision.transient("always")]).retry is False


def test_a_rule_returning_something_else_is_a_configuration_error() -> None:
    """A rule that returns True instead of a Decision is reported, not silently treated as a match."""
    with pytest.raises(ConfigurationError, match="must return a Decision or None"):
        classify(ValueError(), rules=[lambda e: True])  # type: ignore[list-item,return-value]


@pytest.mark.parametrize(
    "rules",
    [
        ["not callable"],
        {"ValueError": Decision.permanent("x")},
        {ValueError: "permanent"},
        "ValueError",
        42,
    ],
)
def test_malformed_rules_are_rejected(rules: Any) -> None:
    """Rules must be callables or a type-to-Decision mapping; anything else fails at once."""
    with pytest.raises(ConfigurationError):
        rules_from(rules)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retry": True, "category": "maybe", "reason": "x"}, "category 'maybe'"),
        ({"retry": True, "category": "transient", "reason": "User 42 not found"}, "low-cardinality"),
        ({"retry": True, "category": "transient", "reason": "x", "delay_ms": -5}, "-5"),
        ({"retry": True, "category": "transient", "reason": "x", "retry_after_ms": 1.5}, "1.5"),
    ],
)
def test_invalid_decisions_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    """A decision with an unknown category, a high-cardinality reason or a bad delay cannot be built."""
    with pytest.raises(ConfigurationError, match=message):
        Decision(**kwargs)


def test_dramatiq_retry_keeps_its_exact_delay() -> None:
    """dramatiq.Retry(delay=...) is honoured as Dramatiq honours it: exactly that delay."""
    decision = classify(dramatiq.Retry(delay=1234))
    assert (decision.retry, decision.reason, decision.delay_ms) == (True, "retry_requested", 1234)
    assert classify(dramatiq.Retry(delay=-1)).delay_ms is None
