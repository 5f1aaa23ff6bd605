"""What ``dramatiq`` imports in each worker process started by ``manage.py rundramatiq_reliable``.

``django.setup()`` runs the app's ``ready()``, which makes the settings' broker Dramatiq's
global one; ``dramatiq`` then finds it as this module's ``broker``.
"""

from __future__ import annotations

import django

django.setup()

from ._settings import get_broker  # noqa: E402  (after django.setup(): it reads the settings)

broker = get_broker()
