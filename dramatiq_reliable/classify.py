"""Failure classification: one pure function decides whether an exception is worth a retry, and how soon.

:func:`classify` looks at a raised exception (and the errors it wraps) and returns a frozen
:class:`Decision`: retry or fail, a short low-cardinality ``reason`` such as ``"http_503"`` or
``"deadlock"``, a ``category`` and, where the error says so, how long to wait.  It does no I/O,
imports no HTTP client or database driver (it recognises their errors by duck typing and by
the defining package's name), and never raises on odd input, so it is safe to call from a
worker's error path and easy to test with real exception objects.

:func:`backoff_ms` turns an attempt number into a jittered, capped exponential delay, and
:func:`parse_retry_after` reads a ``Retry-After`` header.  The
:class:`~dramatiq_reliable.retries.ClassifiedRetries` middleware puts the three together.

>>> decision = classify(TimeoutError("read timed out"))
>>> decision.retry, decision.category, decision.reason
(True, 'transient', 'timeout')
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import math
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from dramatiq.errors import RateLimitExceeded, Retry

from ._checks import check_ms, is_int
from ._util import type_name as _type_name
from .errors import ConfigurationError, Unrecoverable

__all__ = [
    "DB_CONFLICT_BACKOFF_MS",
    "DEFAULT_MAX_RETRY_AFTER_MS",
    "Category",
    "Decision",
    "Jitter",
    "Rule",
    "Rules",
    "backoff_ceiling_ms",
    "backoff_ms",
    "classify",
    "exception_chain",
    "http_status_of",
    "is_connection_failure",
    "parse_retry_after",
    "retry_after_ms_of",
    "rules_from",
    "sqlstate_of",
]

Category = Literal["transient", "permanent", "unknown"]
Jitter = Literal["full", "proportional", "none"]

#: Starting backoff for deadlocks, serialization failures and lock timeouts: the competing
#: transaction is usually gone within milliseconds, so waiting the actor's ``min_backoff``
#: (15 s by default) would only add latency.
DB_CONFLICT_BACKOFF_MS = 250

#: The longest ``Retry-After`` honoured by default (15 minutes).  Longer waits fail the job with
#: reason ``"retry_after_too_long"``: a delayed message sits unacked in worker memory, and
#: RabbitMQ's default ``consumer_timeout`` (30 minutes) closes the channel under longer ones.
DEFAULT_MAX_RETRY_AFTER_MS = 15 * 60 * 1000

# How far classify() follows wrapped errors; real chains are a handful of links long.
_MAX_CHAIN_LINKS = 32
_CATEGORIES = frozenset({"transient", "permanent", "unknown"})
_REASON_RE = re.compile(r"^[a-z0-9_.:-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one failure.

    ``delay_ms``, ``retry_after_ms`` and ``min_backoff_ms`` are three different requests, so
    that each source of timing keeps its meaning:

    * ``delay_ms``: wait exactly this long, in place of the backoff (``dramatiq.Retry(delay=...)``,
      or a rule of yours).  In the decision the middleware stores on the message it is the delay
      actually used.
    * ``retry_after_ms``: the server's ``Retry-After``; a floor under the computed backoff.
    * ``min_backoff_ms``: start the exponential backoff from this instead of the actor's
      ``min_backoff`` (deadlocks and serialization failures use a few hundred ms).

    ``error_type`` is the raised exception's type and ``matched_type`` the type of the error in
    its chain whose evidence decided (they differ when, say, a SQLAlchemy error wraps a psycopg
    deadlock).  :func:`classify` fills both; rules can leave them out.

    Build decisions in rules with :meth:`transient` and :meth:`permanent`.
    """

    retry: bool
    category: Category
    reason: str
    delay_ms: int | None = None
    retry_after_ms: int | None = None
    min_backoff_ms: int | None = None
    http_status: int | None = None
    error_type: str | None = None
    matched_type: str | None = None

    def __post_init__(self) -> None:
        if self.category not in _CATEGORIES:
            raise ConfigurationError(
                f"decision category {self.category!r} is not one of {sorted(_CATEGORIES)!r}; "
                "use Decision.transient() or Decision.permanent()"
            )
        if not isinstance(self.reason, str) or not _REASON_RE.match(self.reason):
            raise ConfigurationError(
                f"decision reason {self.reason!r} must be a short lowercase label such as 'http_503'; "
                "keep it low-cardinality (no ids or messages) so metrics can group by it"
            )
        for name in ("delay_ms", "retry_after_ms", "min_backoff_ms"):
            value = getattr(self, name)
            check_ms(f"decision {name}", value, allow_none=True)

    @classmethod
    def transient(
        cls,
        reason: str,
        *,
        delay_ms: int | None = None,
        retry_after_ms: int | None = None,
        min_backoff_ms: int | None = None,
        http_status: int | None = None,
    ) -> Decision:
        """A failure that another attempt can fix: retried while the retry budget lasts."""
        return cls(
            retry=True,
            category="transient",
            reason=reason,
            delay_ms=delay_ms,
            retry_after_ms=retry_after_ms,
            min_backoff_ms=min_backoff_ms,
            http_status=http_status,
        )

    @classmethod
    def permanent(cls, reason: str, *, http_status: int | None = None) -> Decision:
        """A failure that repeats however often the job runs: failed at once, dead-lettered."""
        return cls(retry=False, category="permanent", reason=reason, http_status=http_status)


#: A rule sees one exception of the chain at a time and returns a decision, or ``None`` to pass.
Rule = Callable[[BaseException], Decision | None]
#: Rules as users give them: callables in order, or a mapping from exception type to decision
#: (the most specific type in the exception's MRO wins).  The mapping's key type is ``Any``
#: because ``Mapping`` is invariant in its keys: ``{MyError: ...}`` is a
#: ``dict[type[MyError], Decision]``, which a ``Mapping[type[BaseException], ...]`` would refuse.
#: :func:`rules_from` checks the keys at run time.
Rules = Sequence[Rule] | Mapping[Any, Decision]


def rules_from(rules: Rules | None) -> tuple[Rule, ...]:
    """Normalise ``rules`` (a sequence of callables or a type-to-decision mapping) to callables.

    Raises :class:`~dramatiq_reliable.errors.ConfigurationError` on anything else, so that a
    typo in a middleware argument fails at construction rather than on the first failure.
    """
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        table: dict[type[BaseException], Decision] = {}
        for key, decision in rules.items():
            if not (isinstance(key, type) and issubclass(key, BaseException)):
                raise ConfigurationError(
                    f"retry rule key {key!r} is not an exception class; map exception types to Decision"
                )
            if not isinstance(decision, Decision):
                raise ConfigurationError(
                    f"retry rule for {key.__name__} maps to {decision!r}; "
                    "use Decision.transient(...) or Decision.permanent(...)"
                )
            table[key] = decision
        return (_mapping_rule(table),)
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ConfigurationError(
            f"retry rules {rules!r} must be a list of callables or a dict of exception type to Decision"
        )
    for item in rules:
        if not callable(item):
            raise ConfigurationError(
                f"retry rule {item!r} is not callable; a rule is a function exception -> Decision | None"
            )
    return tuple(rules)


def _mapping_rule(table: Mapping[type[BaseException], Decision]) -> Rule:
    def rule(exception: BaseException) -> Decision | None:
        for cls in type(exception).__mro__:
            decision = table.get(cls)
            if decision is not None:
                return decision
        return None

    return rule


# --------------------------------------------------------------------------------------------
# Duck-typed evidence: nothing here imports an HTTP client or a database driver.
# --------------------------------------------------------------------------------------------


def _attr(obj: object, name: str) -> Any:
    """getattr that never raises: properties on third-party errors may (httpx's ``.request``)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _http_status(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return value
    return None


def http_status_of(exception: BaseException) -> int | None:
    """The HTTP status an exception carries, found by duck typing, or ``None``.

    Looks at ``exception.response.status_code`` (requests, httpx), ``.response.status``,
    a botocore-style ``response["ResponseMetadata"]["HTTPStatusCode"]``, then the exception's own
    ``status_code``, ``status`` (aiohttp), ``http_status`` and ``code`` (urllib).  Only ints in
    100..599 count.  Only this exception is examined, not its chain.
    """
    response = _attr(exception, "response")
    if response is not None:
        if isinstance(response, Mapping):
            metadata = response.get("ResponseMetadata")
            if isinstance(metadata, Mapping):
                status = _http_status(metadata.get("HTTPStatusCode"))
                if status is not None:
                    return status
        else:
            for name in ("status_code", "status"):
                status = _http_status(_attr(response, name))
                if status is not None:
                    return status
    for name in ("status_code", "status", "http_status", "code"):
        status = _http_status(_attr(exception, name))
        if status is not None:
            return status
    return None


def sqlstate_of(exception: BaseException) -> str | None:
    """The five-character SQLSTATE of a database error (psycopg 3, asyncpg: ``sqlstate``;
    psycopg2: ``pgcode``), or ``None``.  Only this exception is examined, not its chain."""
    for name in ("sqlstate", "pgcode"):
        value = _attr(exception, name)
        if isinstance(value, str) and len(value) == 5 and value.isalnum():
            return value.upper()
    return None


def is_connection_failure(exception: BaseException) -> bool:
    """Whether a database error says the connection failed rather than the statement.

    True for a driver ``OperationalError`` with no SQLSTATE (the server never answered: refused,
    reset, closed) or with one of class ``08`` (connection exception) or ``57P`` (the server is
    shutting down or restarting).  A statement that fails this way may or may not have taken
    effect on the server: a ``COMMIT`` so failed has an unknown outcome, a statement that opened
    a transaction can be retried on a fresh connection.  Only this exception is examined.
    """
    keys = _mro_keys(exception)
    if ("psycopg", "OperationalError") not in keys and ("psycopg2", "OperationalError") not in keys:
        return False
    state = sqlstate_of(exception)
    return state is None or state.startswith(("08", "57P"))


def _header(headers: Any, name: str) -> Any:
    if headers is None:
        return None
    try:
        value = headers.get(name)
        if value is None and isinstance(headers, Mapping):
            value = headers.get(name.lower())
        return value
    except Exception:
        return None


def _retry_after_header(exception: BaseException) -> Any:
    response = _attr(exception, "response")
    if isinstance(response, Mapping):
        metadata = response.get("ResponseMetadata")
        if isinstance(metadata, Mapping):
            value = _header(metadata.get("HTTPHeaders"), "Retry-After")
            if value is not None:
                return value
    elif response is not None:
        value = _header(_attr(response, "headers"), "Retry-After")
        if value is not None:
            return value
    return _header(_attr(exception, "headers"), "Retry-After")


_DELTA_SECONDS_RE = re.compile(r"^\d{1,12}(\.\d{1,6})?$")


def parse_retry_after(value: object, *, now: float | None = None) -> int | None:
    """A ``Retry-After`` header value as milliseconds from ``now``, or ``None`` if unusable.

    Accepts delta-seconds (``"120"``, and fractional ``"1.5"`` which some servers send) and an
    HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``; a date in the past gives 0).  Bytes are
    decoded as Latin-1.  Garbage, negative numbers and absurd lengths give ``None``; this
    function never raises, because a bad header must not turn a retry into a crash.
    ``now`` is a UNIX timestamp in seconds (default: the current time).
    """
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, int) and not isinstance(value, bool):
        return value * 1000 if value >= 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text or len(text) > 64:
        return None
    if _DELTA_SECONDS_RE.match(text):
        return math.ceil(float(text) * 1000)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:  # Python 3.10 returns None for some garbage instead of raising.
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are always GMT; a missing zone means GMT, not local time.
        when = when.replace(tzinfo=datetime.timezone.utc)
    try:
        seconds = when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0, math.ceil((seconds - current) * 1000))


def retry_after_ms_of(exception: BaseException, *, now: float | None = None) -> int | None:
    """The ``Retry-After`` an HTTP error carries, in milliseconds, or ``None``.

    Reads ``exception.response.headers`` (requests, httpx), a botocore-style response dict,
    or ``exception.headers`` (aiohttp, urllib), case-insensitively where the container allows.
    """
    return parse_retry_after(_retry_after_header(exception), now=now)


# --------------------------------------------------------------------------------------------
# The chain
# --------------------------------------------------------------------------------------------

# Attributes under which libraries keep the error they wrap, besides __cause__/__context__:
# SQLAlchemy's DBAPIError.orig, urllib3's MaxRetryError.reason and urllib's URLError.reason,
# aiohttp's ClientOSError.os_error.
_WRAPPED_ATTRIBUTES = ("orig", "reason", "os_error")


def exception_chain(exception: BaseException) -> Iterator[BaseException]:
    """Yield ``exception`` and the errors it wraps, outermost first, each once.

    Follows ``__cause__``, ``__context__`` (unless suppressed with ``raise ... from None``),
    wrapped driver errors (``.orig``, ``.reason``, ``.os_error``) and the members of an
    ``ExceptionGroup``.  A set of seen ids guards against cycles and the walk stops after
    32 links, so a pathological chain cannot stall a worker.
    """
    seen: set[int] = set()
    queue: list[BaseException] = [exception]
    while queue and len(seen) < _MAX_CHAIN_LINKS:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            queue.append(current.__cause__)
        elif current.__context__ is not None and not current.__suppress_context__:
            queue.append(current.__context__)
        for name in _WRAPPED_ATTRIBUTES:
            wrapped = _attr(current, name)
            if isinstance(wrapped, BaseException):
                queue.append(wrapped)
        members = _attr(current, "exceptions")
        if isinstance(members, (tuple, list)):
            queue.extend(member for member in members if isinstance(member, BaseException))


def _mro_keys(exception: BaseException) -> set[tuple[str, str]]:
    """(top-level package, class name) for each class in the exception's MRO.

    Matching on the package and name rather than importing the class keeps HTTP clients and
    drivers out of this module and survives their internal module moves (httpx's
    ``httpx._exceptions``, aiohttp's ``aiohttp.client_exceptions``).
    """
    keys = set()
    for cls in type(exception).__mro__:
        keys.add((cls.__module__.split(".", 1)[0], cls.__name__))
    return keys


def _names(exception: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exception).__mro__}


# --------------------------------------------------------------------------------------------
# Built-in tables
# --------------------------------------------------------------------------------------------

#: HTTP statuses that another attempt can fix.  Every other 4xx fails fast; 5xx statuses not
#: listed in _PERMANENT_5XX are treated as transient (gateways invent new ones: 520-527, 598).
_TRANSIENT_4XX = frozenset({408, 425, 429})
#: 501 Not Implemented, 505 HTTP Version Not Supported, 506 Variant Also Negotiates,
#: 508 Loop Detected, 510 Not Extended, 511 Network Authentication Required: a retry repeats them.
_PERMANENT_5XX = frozenset({501, 505, 506, 508, 510, 511})

# Checked before timeouts: urllib3 2.x makes NewConnectionError a subclass of ConnectTimeoutError.
_CONNECTION_BEFORE_TIMEOUT = frozenset({("urllib3", "NewConnectionError")})
_TIMEOUTS = frozenset(
    {
        ("builtins", "TimeoutError"),  # also socket.timeout, and asyncio.TimeoutError on 3.11+
        ("asyncio", "TimeoutError"),  # Python 3.10
        ("concurrent", "TimeoutError"),  # Python 3.10
        ("requests", "Timeout"),
        ("httpx", "TimeoutException"),
        ("httpcore", "TimeoutException"),
        ("urllib3", "TimeoutError"),
        ("aiohttp", "ServerTimeoutError"),
        ("sqlalchemy", "TimeoutError"),
        ("psycopg_pool", "PoolTimeout"),
    }
)
_CONNECTIONS = frozenset(
    {
        ("builtins", "ConnectionError"),
        ("socket", "gaierror"),
        ("socket", "herror"),
        ("requests", "ConnectionError"),
        ("requests", "ChunkedEncodingError"),
        ("httpx", "NetworkError"),
        ("httpx", "RemoteProtocolError"),
        ("httpx", "ProxyError"),
        ("httpcore", "NetworkError"),
        ("httpcore", "RemoteProtocolError"),
        ("urllib3", "ProtocolError"),
        ("urllib3", "MaxRetryError"),
        ("urllib3", "ProxyError"),
        ("aiohttp", "ClientConnectionError"),
        ("aiohttp", "ClientPayloadError"),
        ("pika", "AMQPConnectionError"),
        ("pika", "AMQPChannelError"),
        ("dramatiq", "BrokerConnectionError"),
        ("sqlalchemy", "DisconnectionError"),
    }
)
_CONNECTION_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNREFUSED",
        "ECONNRESET",
        "ECONNABORTED",
        "EPIPE",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
    )
    if hasattr(errno, name)
)
#: Exception class names that mean "the record is not there", whatever the ORM: Django's
#: ObjectDoesNotExist and Model.DoesNotExist, SQLAlchemy's NoResultFound, Pony's ObjectNotFound.
_MISSING_RECORD_NAMES = frozenset(
    {"DoesNotExist", "ObjectDoesNotExist", "NoResultFound", "ObjectNotFound", "RecordNotFound"}
)


def _from_sqlstate(state: str) -> Decision | None:
    if state in ("40P01", "40001", "55P03"):
        reason = {"40P01": "deadlock", "40001": "serialization_failure", "55P03": "lock_not_available"}[state]
        return Decision.transient(reason, min_backoff_ms=DB_CONFLICT_BACKOFF_MS)
    if state == "57014":  # query_canceled, i.e. statement_timeout
        return Decision.transient("timeout")
    if state == "25006":  # read_only_sql_transaction: writing to a replica mid-failover
        return Decision.transient("read_only_transaction")
    if state in ("57P01", "57P02", "57P03", "53300") or state.startswith("08"):
        return Decision.transient("database_unavailable")
    if state.startswith("53"):
        return Decision.transient("insufficient_resources")
    if state.startswith("40"):
        return Decision.transient("transaction_rollback")
    if state.startswith("22"):
        return Decision.permanent("data_error")
    if state.startswith("23"):
        return Decision.permanent("integrity_error")
    if state.startswith("42"):
        return Decision.permanent("programming_error")
    return None


def _from_http_status(
    status: int, exception: BaseException, max_retry_after_ms: int | None, now: float | None
) -> Decision | None:
    if status < 400:
        return None
    reason = f"http_{status}"
    if status in _TRANSIENT_4XX or (status >= 500 and status not in _PERMANENT_5XX):
        retry_after = retry_after_ms_of(exception, now=now)
        if retry_after is not None and max_retry_after_ms is not None and retry_after > max_retry_after_ms:
            return Decision(
                retry=False,
                category="transient",
                reason="retry_after_too_long",
                retry_after_ms=retry_after,
                http_status=status,
            )
        return Decision.transient(reason, retry_after_ms=retry_after or None, http_status=status)
    return Decision.permanent(reason, http_status=status)


def _strong(
    link: BaseException, rules: Sequence[Rule], max_retry_after_ms: int | None, now: float | None
) -> Decision | None:
    """Evidence that decides on its own, in order of precedence for one link of the chain."""
    # Explicit intent from the job's author beats every rule.
    if isinstance(link, Unrecoverable):
        return Decision.permanent("unrecoverable")
    if isinstance(link, Retry):
        delay = link.delay
        if not is_int(delay) or delay < 0:
            delay = None
        return Decision.transient("retry_requested", delay_ms=delay)
    for rule in rules:
        decision = rule(link)
        if decision is not None:
            if not isinstance(decision, Decision):
                raise ConfigurationError(
                    f"retry rule {rule!r} returned {decision!r}; a rule must return a Decision or None"
                )
            return decision
    state = sqlstate_of(link)
    if state is not None:
        decision = _from_sqlstate(state)
        if decision is not None:
            return decision
    status = http_status_of(link)
    if status is not None:
        decision = _from_http_status(status, link, max_retry_after_ms, now)
        if decision is not None:
            return decision
    return _from_type(link)


def _from_type(link: BaseException) -> Decision | None:
    keys = _mro_keys(link)
    names = {name for _, name in keys}
    if isinstance(link, RateLimitExceeded):
        return Decision.transient("rate_limited")
    if ("dramatiq", "TimeLimitExceeded") in keys:
        return Decision.transient("time_limit")
    if ("dramatiq", "Shutdown") in keys:
        return Decision.transient("shutdown")
    if keys & _CONNECTION_BEFORE_TIMEOUT:
        return Decision.transient("connection")
    if keys & _TIMEOUTS:
        return Decision.transient("timeout")
    if keys & _CONNECTIONS:
        return Decision.transient("connection")
    if isinstance(link, OSError) and link.errno is not None:
        if link.errno == errno.ETIMEDOUT:
            return Decision.transient("timeout")
        if link.errno in _CONNECTION_ERRNOS:
            return Decision.transient("connection")
    # psycopg and psycopg2 attach a SQLSTATE to every server error; an OperationalError without
    # one never reached a server: refused, reset, DNS, bad auth handshake.
    if ("psycopg", "OperationalError") in keys or ("psycopg2", "OperationalError") in keys:
        return Decision.transient("database_unavailable")
    if names & _MISSING_RECORD_NAMES:
        return Decision.permanent("not_found")
    return None


def _weak(link: BaseException) -> Decision | None:
    """DB-API class names with no SQLSTATE (SQLite, client-side psycopg errors, wrappers).

    Weak because a wrapper such as ``sqlalchemy.exc.OperationalError`` names a family, not a
    cause: the wrapped driver error, examined in the strong pass, is more precise.
    """
    names = _names(link)
    if "IntegrityError" in names:
        return Decision.permanent("integrity_error")
    if "DataError" in names:
        return Decision.permanent("data_error")
    if "ProgrammingError" in names:
        return Decision.permanent("programming_error")
    return None


_UNKNOWN = Decision(retry=True, category="unknown", reason="unknown")


def classify(
    exception: BaseException,
    *,
    rules: Rules | None = None,
    max_retry_after_ms: int | None = DEFAULT_MAX_RETRY_AFTER_MS,
    now: float | None = None,
) -> Decision:
    """Decide whether ``exception`` is worth a retry.

    The chain (see :func:`exception_chain`) is walked outermost first, and the first link with
    strong evidence decides; for each link, in order:

    1. :class:`~dramatiq_reliable.errors.Unrecoverable` fails, ``dramatiq.Retry`` retries;
    2. ``rules``, in order (so yours override everything built in, except step 1);
    3. a SQLSTATE (deadlock, serialization failure, data and constraint errors, ...);
    4. an HTTP status (and, on retryable ones, ``Retry-After``, capped at ``max_retry_after_ms``:
       a longer wait fails with reason ``"retry_after_too_long"``; ``None`` means no cap);
    5. the type: timeouts, connection errors, an unreachable database, a missing record.

    If no link has strong evidence, a second pass looks for DB-API class names
    (``IntegrityError``, ``DataError``, ``ProgrammingError``).  Anything else is
    ``unknown`` and retried, as Dramatiq retries every exception: a bug fix followed by a retry
    recovers the work, and the retry budget still ends it.

    ``now`` (UNIX seconds) only matters for HTTP-date ``Retry-After`` values.  Apart from
    reading the clock for those, the function is pure.  A rule that raises propagates; one that
    returns something other than a ``Decision`` raises
    :class:`~dramatiq_reliable.errors.ConfigurationError`.
    """
    normalised = rules_from(rules)
    error_type = _type_name(type(exception))
    chain = list(exception_chain(exception))
    for passes in (
        lambda link: _strong(link, normalised, max_retry_after_ms, now),
        _weak,
    ):
        for link in chain:
            decision = passes(link)
            if decision is not None:
                http_status = decision.http_status
                if http_status is None:
                    http_status = http_status_of(link)
                return dataclasses.replace(
                    decision,
                    http_status=http_status,
                    error_type=decision.error_type or error_type,
                    matched_type=decision.matched_type or _type_name(type(link)),
                )
    return dataclasses.replace(
        _UNKNOWN, http_status=http_status_of(exception), error_type=error_type, matched_type=error_type
    )


# --------------------------------------------------------------------------------------------
# Backoff
# --------------------------------------------------------------------------------------------

# 2**62 ms is far beyond any cap; bounding the exponent keeps the arithmetic cheap.
_MAX_EXPONENT = 62


def backoff_ceiling_ms(attempt: int, *, min_backoff: int, max_backoff: int) -> int:
    """The un-jittered delay after failed attempt number ``attempt`` (1-based):
    ``min(max_backoff, min_backoff * 2 ** (attempt - 1))``."""
    exponent = min(max(attempt - 1, 0), _MAX_EXPONENT)
    return int(min(max_backoff, min_backoff * (2**exponent)))


def backoff_ms(
    attempt: int,
    *,
    min_backoff: int,
    max_backoff: int,
    jitter: Jitter = "full",
    jitter_ratio: float = 0.25,
    rand: Callable[[], float] = random.random,
) -> int:
    """The delay in milliseconds before retrying after failed attempt number ``attempt`` (1-based).

    With ``ceiling = min(max_backoff, min_backoff * 2 ** (attempt - 1))`` and
    ``floor = max(1, min(min_backoff // 2, ceiling))``, and ``u = rand()`` in [0, 1):

    * ``"full"`` (default): ``floor + u * (ceiling - floor)``.  Full jitter spreads a burst of
      failures over the whole window (the least total load on a recovering service), while the
      floor keeps any retry from being instant.
    * ``"proportional"`` (BullMQ style): ``ceiling * (1 - jitter_ratio * u)``, i.e. within
      ``jitter_ratio`` below the ceiling; delays then grow steadily, attempt after attempt.
    * ``"none"``: ``ceiling``.

    The result is always in ``[floor, ceiling]``, so at least 1 ms and never above ``max_backoff``.
    """
    ceiling = backoff_ceiling_ms(attempt, min_backoff=min_backoff, max_backoff=max_backoff)
    floor = max(1, min(min_backoff // 2, ceiling))
    if jitter == "none":
        delay = float(ceiling)
    elif jitter == "proportional":
        delay = ceiling * (1.0 - jitter_ratio * rand())
    else:
        delay = floor + rand() * (ceiling - floor)
    return int(min(max(delay, floor), max(ceiling, floor)))
