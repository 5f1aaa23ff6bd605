"""Django integration: the broker from settings, ``send()`` joining ``atomic()``, ORM writes in the job.

Add the app and one setting::

    INSTALLED_APPS += ["dramatiq_reliable.django"]
    DRAMATIQ_RELIABLE = {"BROKER": "outbox", "RABBITMQ_URL": "amqp://localhost"}

Then ``manage.py migrate`` creates our tables on ``DATABASES["default"]``, ``actor.send()``
inside ``transaction.atomic()`` writes its message in that transaction (no ``bind()``),
actors' ORM writes commit with their idempotency key, ``manage.py rundramatiq_reliable``
starts workers (and the relay), and ``path("jobs/", include("dramatiq_reliable.django.urls"))``
serves the web page to staff.  Needs Django >= 4.2 on psycopg 3: ``pip install
'dramatiq-reliable[django]'``.  See docs/django.md.
"""

try:
    import django as _django  # noqa: F401
except ImportError as _error:  # pragma: no cover - Django is a dev dependency
    raise ImportError("dramatiq_reliable.django needs Django; run: pip install 'dramatiq-reliable[django]'") from _error

from ._database import DjangoDatabase
from ._jobs import CloseOldConnections, DjangoJobConnections
from ._settings import ReliableSettings, get_broker, reliable_settings

__all__ = [
    "CloseOldConnections",
    "DjangoDatabase",
    "DjangoJobConnections",
    "ReliableSettings",
    "get_broker",
    "reliable_settings",
]
