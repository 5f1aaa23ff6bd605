"""The shop's settings outside ``manage.py``: our tests and benchmark configure Django with them in-process."""

from __future__ import annotations

from typing import Any

import django
from django.conf import settings

import shopsite.settings as shop


def configure(*, databases: dict[str, Any], reliable: dict[str, Any]) -> None:
    """``settings.configure()`` with the shop's settings but ``DATABASES`` and ``DRAMATIQ_RELIABLE``; then set up."""
    given = {name: getattr(shop, name) for name in dir(shop) if name.isupper()}
    settings.configure(**{**given, "DATABASES": databases, "DRAMATIQ_RELIABLE": reliable})
    django.setup()
