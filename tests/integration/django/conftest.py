"""A Django project on the real Postgres for the tests here: examples/django_shop's app, a test database.

Django is configured once per session (``settings.configure``) on a database of the session's own,
created here and dropped at the end (``WITH (FORCE)``: worker threads may still hold
connections).  Each test gets a freshly migrated dramatiq-reliable schema and a broker built by
the app from ``DRAMATIQ_RELIABLE`` (``django_broker``).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

SHOP = Path(__file__).resolve().parents[3] / "examples" / "django_shop"


@pytest.fixture(scope="session")
def django_project(database_url: str) -> Iterator[str]:
    """Django configured on a new database (the shop's tables migrated); its URL."""

    name = f"dr_django_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        if str(SHOP) not in sys.path:
            sys.path.insert(0, str(SHOP))
        from shopsite.database import from_url
        from shopsite.standalone import configure as configure_django

        # "other" is the server's own database: an atomic() there is on another database than the broker's.
        configure_django(
            databases={"default": from_url(database_url, NAME=name), "other": from_url(database_url)},
            reliable={"BROKER": "postgres", "SCHEMA": f"t_{uuid.uuid4().hex[:12]}"},
        )
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        url = urlsplit(database_url)
        yield url._replace(path=f"/{name}").geturl()
    finally:
        from django.db import connections

        from dramatiq_reliable.django._settings import reset

        reset()
        connections.close_all()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def django_schema(django_project: str) -> Iterator[str]:
    """A migrated dramatiq-reliable schema of the test's own in the Django database; dropped afterwards."""
    from django.db import connections

    from dramatiq_reliable import schema

    name = f"t_{uuid.uuid4().hex[:12]}"
    schema.migrate(django_project, schema=name)
    yield name
    with connections["default"].cursor() as cursor:
        cursor.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)).as_string())


def configure(**reliable: Any) -> Any:
    """Rebuild the app's broker from ``DRAMATIQ_RELIABLE`` = ``reliable``; the broker."""
    import dramatiq
    from django.conf import settings

    from dramatiq_reliable.django import get_broker
    from dramatiq_reliable.django._settings import reset

    reset()
    settings.DRAMATIQ_RELIABLE = reliable
    broker = get_broker()
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def django_broker(django_schema: str) -> Iterator[Any]:
    """The app's PostgresBroker on the test's schema, with the shop's actor declared on it; the shop's tables emptied after."""
    from django.conf import settings
    from django.db import connections

    from dramatiq_reliable.django._settings import reset

    previous = settings.DRAMATIQ_RELIABLE
    broker = configure(BROKER="postgres", SCHEMA=django_schema)
    from shop.tasks import send_receipt

    send_receipt.broker = broker
    broker.declare_actor(send_receipt)
    yield broker
    reset()
    settings.DRAMATIQ_RELIABLE = previous
    with connections["default"].cursor() as cursor:
        cursor.execute("TRUNCATE shop_order, auth_user CASCADE")
    connections.close_all()
