"""``settings.DRAMATIQ_RELIABLE``: read once, checked whole, and the broker built from it on first use."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import dramatiq
from django.conf import settings as django_settings
from django.utils.module_loading import import_string
from dramatiq.broker import Broker
from dramatiq.middleware import Middleware

from .. import _sql
from ..errors import ConfigurationError

__all__ = ["ReliableSettings", "get_broker", "on_reset", "reliable_settings", "reset"]

_KEYS = (
    "BROKER",
    "RABBITMQ_URL",
    "DATABASE_ALIAS",
    "SCHEMA",
    "MIDDLEWARE",
    "IDEMPOTENCY",
    "RETRIES",
    "BROKER_OPTIONS",
    "RELAY_OPTIONS",
    "TASKS_MODULE",
    "WEB_ACCESS",
    "WEB_OPTIONS",
)
_EXAMPLE = "e.g. DRAMATIQ_RELIABLE = {'BROKER': 'postgres'} or {'BROKER': 'outbox', 'RABBITMQ_URL': 'amqp://localhost'}"


@dataclasses.dataclass(frozen=True)
class ReliableSettings:
    """The checked ``DRAMATIQ_RELIABLE`` setting (see docs/django.md for each key)."""

    broker: str
    rabbitmq_url: str | None
    alias: str
    schema: str
    middleware: tuple[Any, ...]
    idempotency: bool
    retries: Any
    broker_options: Mapping[str, Any]
    relay_options: Mapping[str, Any]
    tasks_module: str
    web_access: Callable[[Any], str] | None
    web_options: Mapping[str, Any]


def _fail(key: str, value: object, fix: str) -> ConfigurationError:
    return ConfigurationError(f"DRAMATIQ_RELIABLE[{key!r}] is {value!r}; {fix}")


def _mapping(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise _fail(key, value, "give a dict of keyword arguments, e.g. {'pool_max_size': 20}")
    return dict(value)


def _text(raw: Mapping[str, Any], key: str, default: str, fix: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, value, fix)
    return value


def reliable_settings() -> ReliableSettings:
    """``settings.DRAMATIQ_RELIABLE``, checked; a ``ConfigurationError`` names the key and the fix."""
    raw = getattr(django_settings, "DRAMATIQ_RELIABLE", None)
    if not isinstance(raw, Mapping):
        raise ConfigurationError(
            f"settings.DRAMATIQ_RELIABLE is {raw!r}; the dramatiq_reliable.django app needs a dict, {_EXAMPLE}"
        )
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ConfigurationError(f"DRAMATIQ_RELIABLE has unknown keys {unknown!r}; the keys are {list(_KEYS)!r}")
    broker = raw.get("BROKER")
    if broker not in ("outbox", "postgres"):
        raise _fail("BROKER", broker, f"use 'outbox' (RabbitMQ, with a relay) or 'postgres' (no RabbitMQ); {_EXAMPLE}")
    rabbitmq_url = raw.get("RABBITMQ_URL")
    if broker == "outbox" and (not isinstance(rabbitmq_url, str) or not rabbitmq_url.strip()):
        raise _fail("RABBITMQ_URL", rabbitmq_url, "the 'outbox' broker needs a RabbitMQ URL, e.g. 'amqp://localhost'")
    if broker == "postgres" and rabbitmq_url is not None:
        raise _fail("RABBITMQ_URL", "***", "the 'postgres' broker uses no RabbitMQ; remove the key or use 'outbox'")
    middleware = raw.get("MIDDLEWARE", ())
    if isinstance(middleware, str) or not isinstance(middleware, (list, tuple)):
        raise _fail("MIDDLEWARE", middleware, "give a list of middleware instances or dotted paths to classes")
    idempotency = raw.get("IDEMPOTENCY", True)
    if not isinstance(idempotency, bool):
        raise _fail("IDEMPOTENCY", idempotency, "use True (add Idempotency on Django's connection) or False")
    access = raw.get("WEB_ACCESS")
    if isinstance(access, str):
        access = import_string(access)
    if access is not None and not callable(access):
        raise _fail("WEB_ACCESS", access, "give a function of the user returning 'full', 'read' or 'forbidden'")
    schema = raw.get("SCHEMA", _sql.DEFAULT_SCHEMA)
    _sql.validate_schema(schema)
    return ReliableSettings(
        broker=broker,
        rabbitmq_url=rabbitmq_url,
        alias=_text(raw, "DATABASE_ALIAS", "default", "name a key of DATABASES, e.g. 'default'"),
        schema=schema,
        middleware=tuple(middleware),
        idempotency=idempotency,
        retries=raw.get("RETRIES"),
        broker_options=_mapping(raw, "BROKER_OPTIONS"),
        relay_options=_mapping(raw, "RELAY_OPTIONS"),
        tasks_module=_text(raw, "TASKS_MODULE", "tasks", "name the module of each app that holds actors, e.g. 'tasks'"),
        web_access=access,
        web_options=_mapping(raw, "WEB_OPTIONS"),
    )


def _middleware(config: ReliableSettings) -> list[Middleware]:
    """``MIDDLEWARE`` as instances, Idempotency on Django's connection, connection hygiene first."""
    from ..idempotency import Idempotency, PooledJobConnections
    from ._jobs import CloseOldConnections, DjangoJobConnections

    items: list[Middleware] = [CloseOldConnections()]
    for entry in config.middleware:
        item = import_string(entry) if isinstance(entry, str) else entry
        if isinstance(item, type):
            item = item()
        if not isinstance(item, Middleware):
            raise _fail("MIDDLEWARE", entry, "list dramatiq Middleware instances or dotted paths to their classes")
        items.append(item)
    idempotency = [item for item in items if isinstance(item, Idempotency)]
    for item in idempotency:
        # Only the default is replaced: a JobConnections the user chose stays.
        if isinstance(item.job_connections, PooledJobConnections):
            item.job_connections = DjangoJobConnections(config.alias)
    if config.idempotency and not idempotency:
        items.append(Idempotency(job_connections=DjangoJobConnections(config.alias)))
    return items


def _build(config: ReliableSettings) -> Broker:
    from ..outbox import OutboxBroker
    from ..postgres import PostgresBroker
    from ..retries import ClassifiedRetries, build_middleware
    from ._database import DjangoDatabase

    options = dict(config.broker_options)
    for taken in ("database", "schema", "middleware", "url"):
        if taken in options:
            raise _fail("BROKER_OPTIONS", sorted(options), f"{taken!r} comes from the other keys; remove it")
    retries = config.retries
    if isinstance(retries, str):
        retries = import_string(retries)
    if isinstance(retries, type):
        retries = retries()
    if retries is not None and not isinstance(retries, ClassifiedRetries):
        raise _fail("RETRIES", config.retries, "give a ClassifiedRetries instance (or its dotted path), or omit it")
    database = DjangoDatabase(
        config.alias, max_size=int(options.pop("pool_max_size", 16 if config.broker == "postgres" else 10))
    )
    middleware = build_middleware(retries=retries, middleware=_middleware(config))
    if config.broker == "outbox":
        return OutboxBroker(
            url=config.rabbitmq_url,
            database=database,
            schema=config.schema,
            middleware=middleware,
            pool_max_size=database.pool.max_size,
            **options,
        )
    return PostgresBroker(
        database=database, schema=config.schema, middleware=middleware, pool_max_size=database.pool.max_size, **options
    )


_lock = threading.Lock()
_broker: Broker | None = None
#: What else holds connections of the broker's pool and must close with it (the page registers).
_closers: list[Callable[[], None]] = []


def on_reset(close: Callable[[], None]) -> None:
    """Call ``close`` whenever :func:`reset` closes the broker (once per function)."""
    if close not in _closers:
        _closers.append(close)


def get_broker() -> Broker:
    """The app's broker, built from ``DRAMATIQ_RELIABLE`` on the first call (no I/O) and shared after.

    ``dramatiq_reliable.django``'s ``AppConfig.ready()`` calls it and makes it Dramatiq's global
    broker, so ``@dramatiq.actor`` in your apps' modules uses it.
    """
    global _broker
    with _lock:
        if _broker is None:
            _broker = _build(reliable_settings())
        return _broker


def reset() -> None:
    """Close and forget the built broker and the page's pools (tests that change ``DRAMATIQ_RELIABLE``
    call it; so does :class:`~dramatiq_reliable.django.runner.DiscoverRunner` before the test database goes)."""
    global _broker
    for close in tuple(_closers):
        close()
    with _lock:
        if _broker is not None:
            _broker.close()
            if dramatiq.broker.global_broker is _broker:
                dramatiq.broker.global_broker = None
        _broker = None
