"""Our tables, through ``manage.py migrate`` (and so ``manage.py test``'s test database).

Non-atomic: :func:`dramatiq_reliable.migrate` runs its own transaction under its advisory lock,
on the schema editor's connection, and only for the alias the broker uses.  A release whose
schema changes adds a migration like this one (``migrate`` applies what is missing).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

__all__: list[str] = []


def _migrate(apps: Any, schema_editor: Any) -> None:
    from ... import schema
    from .._database import check_psycopg3
    from .._settings import reliable_settings

    config = reliable_settings()
    connection = schema_editor.connection
    if connection.alias != config.alias:
        return
    connection.ensure_connection()
    schema.migrate(check_psycopg3(connection.connection, connection.alias), schema=config.schema)


class Migration(migrations.Migration):  # type: ignore[misc]  # Django ships no type hints
    atomic = False
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(_migrate, migrations.RunPython.noop, elidable=False)]
