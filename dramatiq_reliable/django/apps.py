"""The Django app: checks ``DRAMATIQ_RELIABLE``, sets the broker and lets ``send()`` join ``atomic()``."""

from __future__ import annotations

import dramatiq
from django.apps import AppConfig

__all__ = ["DramatiqReliableConfig"]


class DramatiqReliableConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Builds the broker when Django is ready, before any app's actors module is imported.

    Building does no I/O (the pool opens on first use), so ``manage.py`` commands that never
    send stay free of Postgres and RabbitMQ.
    """

    name = "dramatiq_reliable.django"
    label = "dramatiq_reliable"
    verbose_name = "dramatiq-reliable"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from ..binding import register_ambient
        from ._ambient import django_transaction
        from ._settings import get_broker

        dramatiq.set_broker(get_broker())
        register_ambient(django_transaction)  # once: registering the same source again is a no-op
