"""A Django ``DATABASES`` entry from a Postgres URL (the settings, the tests and the benchmark use it)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit


def from_url(url: str, **extra: Any) -> dict[str, Any]:
    """``DATABASES["default"]`` for ``url`` on psycopg 3 (Django >= 4.2 picks it when installed)."""
    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/") or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        **extra,
    }
