"""The broker's Postgres, read from a Django database alias each time a connection is opened.

Django's test runner renames the alias's database (``test_<name>``) after the apps are ready,
which is after the broker was built.  :class:`DjangoDatabase` therefore resolves the
connection string when the pool opens a connection, not when it is constructed, so workers,
relays and sends under ``manage.py test`` all reach the test database.
"""

from __future__ import annotations

import functools
from typing import Any

import psycopg
from django.db import connections

from ..database import Database, connection_kwargs
from ..errors import ConfigurationError

__all__ = ["DjangoDatabase", "alias_identity", "check_psycopg3", "libpq_params", "same_database"]


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


def libpq_params(alias: str) -> dict[str, Any]:
    """The libpq parameters of ``DATABASES[alias]`` as Django would connect (the test name included)."""
    if alias not in connections:
        raise ConfigurationError(
            f"DRAMATIQ_RELIABLE['DATABASE_ALIAS'] is {alias!r}, which is not in DATABASES "
            f"({sorted(connections.settings)!r}); name one of them"
        )
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        raise ConfigurationError(
            f"database alias {alias!r} uses the {wrapper.vendor!r} backend; dramatiq-reliable needs Postgres "
            "(ENGINE 'django.db.backends.postgresql')"
        )
    settings = wrapper.settings_dict
    params: dict[str, Any] = {
        key: value for key, value in (settings.get("OPTIONS") or {}).items() if key in _libpq_keywords()
    }
    for setting, keyword in (("NAME", "dbname"), ("USER", "user"), ("PASSWORD", "password"), ("HOST", "host")):
        if settings.get(setting):
            params[keyword] = settings[setting]
    if settings.get("PORT"):
        params["port"] = str(settings["PORT"])
    return params


def alias_identity(alias: str) -> tuple[str | None, int | None]:
    """The database name and port of ``DATABASES[alias]``, as :meth:`Database.identity` gives them."""
    params = libpq_params(alias)
    port = str(params.get("port") or "").split(",")[0]
    return (str(params["dbname"]) if params.get("dbname") else None, int(port) if port.isdigit() else None)


def same_database(alias: str, database: Database) -> bool:
    """Whether ``database`` is the one ``DATABASES[alias]`` names (name and port; unknown parts match)."""
    if isinstance(database, DjangoDatabase) and database.alias == alias:
        return True
    ours, theirs = alias_identity(alias), database.identity()
    return all(a is None or b is None or a == b for a, b in zip(ours, theirs, strict=True))


def check_psycopg3(raw: object, alias: str) -> psycopg.Connection[Any]:
    """``raw`` (Django's driver connection) if it is psycopg 3's, else a ``ConfigurationError`` naming the fix."""
    if isinstance(raw, psycopg.Connection):
        return raw
    raise ConfigurationError(
        f"database alias {alias!r} runs on {type(raw).__module__}.{type(raw).__name__}, not psycopg 3; "
        "dramatiq-reliable joins only psycopg 3 connections: run 'pip install \"psycopg[binary]\"' "
        "(Django >= 4.2 then uses it instead of psycopg2)"
    )


class DjangoDatabase(Database):
    """A :class:`~dramatiq_reliable.Database` whose connections go where ``DATABASES[alias]`` says.

    The pool is opened lazily (no I/O at startup) and each new connection reads the alias's
    settings again, so it follows the test runner's switch to the test database.  The
    connection defaults of :data:`~dramatiq_reliable.database.CONNECTION_DEFAULTS` apply unless
    the alias's ``OPTIONS`` set them.
    """

    def __init__(self, alias: str = "default", *, max_size: int = 10, timeout_ms: int = 10_000) -> None:
        if not isinstance(alias, str) or not alias:
            raise ConfigurationError(f"alias must be a database alias such as 'default', got {alias!r}")
        super().__init__(url="postgresql://", max_size=max_size, timeout_ms=timeout_ms)
        self.alias = alias
        # psycopg_pool >= 3.3 calls a callable conninfo for every connection it opens.
        self.pool.conninfo = self._resolve
        self.pool.kwargs = {}

    def _resolve(self) -> str:
        url = psycopg.conninfo.make_conninfo("", **libpq_params(self.alias))
        return psycopg.conninfo.make_conninfo(url, **connection_kwargs(url))

    def identity(self) -> tuple[str | None, int | None]:
        """Read from the alias each time (not cached): the test runner renames its database."""
        return alias_identity(self.alias)

    @property
    def conninfo(self) -> str:
        """The alias's connection string now (contains credentials: never log it)."""
        return self._resolve()
