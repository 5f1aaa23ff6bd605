"""The app's settings, migrations, database resolution and worker command, on a real Django project."""

from __future__ import annotations

import io
from typing import Any

import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import ConfigurationError, schema

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (None, r"settings.DRAMATIQ_RELIABLE is None; .* needs a dict"),
        ({"BROKER": "postgres", "QUEUES": 1}, r"unknown keys \['QUEUES'\]; the keys are"),
        ({}, r"DRAMATIQ_RELIABLE\['BROKER'\] is None; use 'outbox' .* or 'postgres'"),
        (
            {"BROKER": "outbox"},
            r"DRAMATIQ_RELIABLE\['RABBITMQ_URL'\] is None; the 'outbox' broker needs a RabbitMQ URL",
        ),
        (
            {"BROKER": "postgres", "RABBITMQ_URL": "amqp://u:secret@h"},
            r"is '\*\*\*'; the 'postgres' broker uses no RabbitMQ",
        ),
        ({"BROKER": "postgres", "MIDDLEWARE": "x.Y"}, r"MIDDLEWARE'\] is 'x.Y'; give a list"),
        ({"BROKER": "postgres", "IDEMPOTENCY": "yes"}, r"IDEMPOTENCY'\] is 'yes'; use True"),
        ({"BROKER": "postgres", "BROKER_OPTIONS": ["x"]}, r"BROKER_OPTIONS'\] is \['x'\]; give a dict"),
        ({"BROKER": "postgres", "DATABASE_ALIAS": ""}, r"DATABASE_ALIAS'\] is ''; name a key of DATABASES"),
        ({"BROKER": "postgres", "SCHEMA": ""}, r"schema must be a non-empty string"),
        ({"BROKER": "postgres", "WEB_ACCESS": 3}, r"WEB_ACCESS'\] is 3; give a function of the user"),
    ],
)
def test_a_bad_setting_is_refused_with_the_key_and_the_fix(django_project, setting, message):
    from django.test import override_settings

    from dramatiq_reliable.django import reliable_settings

    with override_settings(DRAMATIQ_RELIABLE=setting), pytest.raises(ConfigurationError, match=message) as error:
        reliable_settings()
    assert "secret" not in str(error.value)


def test_a_broker_option_taken_from_another_key_is_refused(django_project):
    from django.test import override_settings

    from dramatiq_reliable.django import get_broker
    from dramatiq_reliable.django._settings import reset

    reset()
    try:
        setting = {"BROKER": "postgres", "BROKER_OPTIONS": {"schema": "x"}}
        refused = pytest.raises(ConfigurationError, match=r"'schema' comes from the other keys; remove it")
        with override_settings(DRAMATIQ_RELIABLE=setting), refused:
            get_broker()
    finally:
        reset()


def test_an_alias_that_is_not_postgres_or_not_defined_is_refused(django_project):
    from dramatiq_reliable.django import DjangoDatabase

    with pytest.raises(ConfigurationError, match=r"'nope', which is not in DATABASES .*; name one of them"):
        DjangoDatabase("nope").conninfo  # noqa: B018
    with pytest.raises(ConfigurationError, match=r"alias must be a database alias"):
        DjangoDatabase("")


def test_a_psycopg2_connection_is_refused_naming_the_fix():
    from dramatiq_reliable.django._database import check_psycopg3

    class FakePsycopg2Connection:
        pass

    with pytest.raises(ConfigurationError, match=r"not psycopg 3; .*pip install \"psycopg\[binary\]\".*Django >= 4.2"):
        check_psycopg3(FakePsycopg2Connection(), "default")


def test_the_database_follows_the_alias_when_the_test_runner_renames_it(django_project):
    from django.db import connections

    from dramatiq_reliable.django import DjangoDatabase

    database = DjangoDatabase("default")
    settings = connections["default"].settings_dict
    original = settings["NAME"]
    assert database.identity()[0] == original
    try:
        settings["NAME"] = "test_" + original
        assert database.identity()[0] == "test_" + original
        assert psycopg.conninfo.conninfo_to_dict(database.conninfo)["dbname"] == "test_" + original
    finally:
        settings["NAME"] = original
    with database.connection() as conn:
        assert conn.info.dbname == original
    database.close()


def test_manage_py_migrate_creates_our_tables_on_the_alias_and_runs_again_harmlessly(django_project):
    from django.core.management import call_command
    from django.test import override_settings

    fresh = "t_migrate_" + psycopg.conninfo.conninfo_to_dict(django_project)["dbname"][-10:]
    try:
        with override_settings(DRAMATIQ_RELIABLE={"BROKER": "postgres", "SCHEMA": fresh}):
            call_command("migrate", "dramatiq_reliable", "zero", verbosity=0)  # unapplied, so it runs again
            call_command("migrate", "dramatiq_reliable", verbosity=0)
            with psycopg.connect(django_project) as conn:
                assert schema.current_version(conn, schema=fresh) == schema.LATEST_VERSION
            call_command("migrate", "dramatiq_reliable", "zero", verbosity=0)
            call_command("migrate", "dramatiq_reliable", verbosity=0)  # on a migrated schema: nothing to do
            with psycopg.connect(django_project) as conn:
                assert schema.current_version(conn, schema=fresh) == schema.LATEST_VERSION
    finally:
        with psycopg.connect(django_project, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(fresh)))


def test_the_migration_leaves_other_aliases_alone(django_project):
    """``migrate --database other`` records the migration there but creates none of our tables."""
    import importlib

    from django.db import connections
    from django.test import override_settings

    migration = importlib.import_module("dramatiq_reliable.django.migrations.0001_tables")

    class Editor:
        connection = connections["other"]

    connections["other"].close()
    with override_settings(DRAMATIQ_RELIABLE={"BROKER": "postgres", "SCHEMA": "t_never_created"}):
        migration._migrate(None, Editor())
    assert connections["other"].connection is None  # not even connected


def test_rundramatiq_reliable_finds_the_task_modules_and_runs_the_relay_only_with_the_outbox(django_project):
    from django.core.management import call_command
    from django.test import override_settings

    def dry_run(setting: dict[str, Any], *args: str) -> str:
        out = io.StringIO()
        with override_settings(DRAMATIQ_RELIABLE=setting):
            call_command("rundramatiq_reliable", "--dry-run", *args, stdout=out)
        return out.getvalue()

    postgres = dry_run({"BROKER": "postgres"}, "--threads", "2")
    assert "-m dramatiq dramatiq_reliable.django._worker shop.tasks --threads 2" in postgres
    assert "relay: no" in postgres
    assert "relay: yes" in dry_run({"BROKER": "outbox", "RABBITMQ_URL": "amqp://localhost"})
    assert "relay: no" in dry_run({"BROKER": "outbox", "RABBITMQ_URL": "amqp://localhost"}, "--no-relay")
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--relay-only needs DRAMATIQ_RELIABLE"):
        dry_run({"BROKER": "postgres"}, "--relay-only")
    with pytest.raises(CommandError, match="--threads must be 1 or more"):
        dry_run({"BROKER": "postgres"}, "--threads", "0")
