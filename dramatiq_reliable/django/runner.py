"""``TEST_RUNNER = "dramatiq_reliable.django.runner.DiscoverRunner"``: Django's runner, our pool closed first.

The broker's pool holds connections to the test database; Postgres refuses to drop a database
with sessions open ("is being accessed by other users"), so the test database would outlive the
run.  This runner closes the broker (and so its pool) before Django drops the test databases.
"""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner as _DjangoRunner

from ._settings import reset

__all__ = ["DiscoverRunner"]


class DiscoverRunner(_DjangoRunner):  # type: ignore[misc]  # Django ships no type hints
    """Django's ``DiscoverRunner`` that closes dramatiq-reliable's pool before the test databases go."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        reset()
        super().teardown_databases(old_config, **kwargs)
