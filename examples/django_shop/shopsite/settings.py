"""Settings of the django_shop example: Postgres from DATABASE_URL, the broker from SHOP_BROKER.

Only the example reads the environment; the library never does.
"""

from __future__ import annotations

import os

from shopsite.database import from_url

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "django-shop-example-not-secret")
DEBUG = os.environ.get("SHOP_DEBUG", "") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
ROOT_URLCONF = "shopsite.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "/admin/login/"
# Closes the broker's pool before the test database is dropped.
TEST_RUNNER = "dramatiq_reliable.django.runner.DiscoverRunner"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "dramatiq_reliable.django",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
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
]

DATABASES = {
    "default": from_url(
        os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop"),
        # The test run's database; several runs on one server name their own.
        TEST={"NAME": os.environ.get("SHOP_TEST_DATABASE") or None},
    )
}

DRAMATIQ_RELIABLE = {
    "BROKER": os.environ.get("SHOP_BROKER", "postgres"),
    "SCHEMA": os.environ.get("SHOP_SCHEMA", "dramatiq_reliable"),
}
if DRAMATIQ_RELIABLE["BROKER"] == "outbox":
    DRAMATIQ_RELIABLE["RABBITMQ_URL"] = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
