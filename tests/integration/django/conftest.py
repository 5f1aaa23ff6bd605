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
from urllib.parse import unquote, urlsplit

import psycopg
import pytest
from psycopg import sql

SHOP = Path(__file__).resolve().parents[3] / "examples" / "django_shop"


def _django_databases(database_url: str, name: str) -> dict[str, Any]:
    url = urlsplit(database_url)
    common = {
        "ENGINE": "django.db.backends.postgresql",
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
    }
    # "other" is the server's own database: an atomic() there is on another database than the broker's.
    return {
        "default": {**common, "NAME": name},
        "other": {**common, "NAME": url.path.lstrip("/") or "postgres"},
    }


@pytest.fixture(scope="session")
def django_project(database_url: str) -> Iterator[str]:
    """Django configured on a new database (the shop's tables migrated); its URL."""
    import django
    from django.conf import settings

    name = f"dr_django_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        if str(SHOP) not in sys.path:
            sys.path.insert(0, str(SHOP))
        settings.configure(
            SECRET_KEY="tests",
            ALLOWED_HOSTS=["testserver"],
            ROOT_URLCONF="shopsite.urls",
            USE_TZ=True,
            LOGIN_URL="/admin/login/",
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
            INSTALLED_APPS=[
                "django.contrib.admin",
                "django.contrib.auth",
                "django.contrib.contenttypes",
                "django.contrib.sessions",
                "django.contrib.messages",
                "dramatiq_reliable.django",
                "shop",
            ],
            MIDDLEWARE=[
                "django.contrib.sessions.middleware.SessionMiddleware",
                "django.middleware.csrf.CsrfViewMiddleware",
                "django.contrib.auth.middleware.AuthenticationMiddleware",
                "django.contrib.messages.middleware.MessageMiddleware",
            ],
            TEMPLATES=[
                {
                    "BACKEND": "django.template.backends.django.DjangoTemplates",
                    "APP_DIRS": True,
                    "OPTIONS": {
                        "context_processors": [
                            "django.template.context_processors.request",
                            "django.contrib.auth.context_processors.auth",
                            "django.contrib.messages.context_processors.messages",
                        ]
                    },
                }
            ],
            DATABASES=_django_databases(database_url, name),
            DRAMATIQ_RELIABLE={"BROKER": "postgres", "SCHEMA": f"t_{uuid.uuid4().hex[:12]}"},
        )
        django.setup()
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
    from dramatiq_reliable import schema

    name = f"t_{uuid.uuid4().hex[:12]}"
    schema.migrate(django_project, schema=name)
    yield name
    with psycopg.connect(django_project, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


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
