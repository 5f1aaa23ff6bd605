"""send() inside Django's atomic() joins it with no bind(); a rollback takes the message with it."""

from __future__ import annotations

from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_reliable import NotBound

pytestmark = pytest.mark.integration


def _rows(url: str, schema_name: str) -> int:
    """Queue rows visible to another session: only what committed."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema_name, "queue"))).fetchone()
        return int(row[0]) if row else 0


def _actor(broker: Any) -> Any:
    return dramatiq.actor(lambda: None, broker=broker, actor_name="tick", queue_name="tick")


def test_a_send_inside_atomic_commits_with_the_block_and_not_before(django_project, django_broker, django_schema):
    from django.db import transaction

    tick = _actor(django_broker)
    with transaction.atomic():
        tick.send()
        assert _rows(django_project, django_schema) == 0  # in the open transaction, invisible outside
    assert _rows(django_project, django_schema) == 1


def test_a_rolled_back_atomic_block_leaves_no_message(django_project, django_broker, django_schema):
    from django.db import transaction
    from shop.models import Order

    tick = _actor(django_broker)
    with pytest.raises(RuntimeError, match="declined"), transaction.atomic():
        Order.objects.create(item="lamp")
        tick.send()
        raise RuntimeError("declined")
    assert Order.objects.count() == 0
    assert _rows(django_project, django_schema) == 0


def test_a_rolled_back_savepoint_removes_only_its_own_message(django_project, django_broker, django_schema):
    from django.db import transaction

    tick = _actor(django_broker)
    with transaction.atomic():
        tick.send()
        with pytest.raises(RuntimeError), transaction.atomic():
            tick.send()
            raise RuntimeError("inner block fails")
        tick.send()
    assert _rows(django_project, django_schema) == 2


def test_set_rollback_on_the_atomic_block_drops_the_message(django_project, django_broker, django_schema):
    from django.db import transaction

    tick = _actor(django_broker)
    with transaction.atomic():
        tick.send()
        transaction.set_rollback(True)
    assert _rows(django_project, django_schema) == 0


def test_outside_atomic_a_send_commits_on_its_own_as_documented(django_project, django_broker, django_schema):
    tick = _actor(django_broker)
    tick.send()
    assert _rows(django_project, django_schema) == 1


def test_outside_atomic_on_unbound_error_refuses_the_send(django_project, django_schema):
    from conftest import configure
    from django.db import transaction

    broker = configure(BROKER="postgres", SCHEMA=django_schema, BROKER_OPTIONS={"on_unbound": "error"})
    tick = _actor(broker)
    with pytest.raises(NotBound, match="outside a transaction"):
        tick.send()
    with transaction.atomic():
        tick.send()  # joined: not refused
    assert _rows(django_project, django_schema) == 1


def test_atomic_on_another_database_refuses_the_send_and_writes_nothing(django_project, django_broker, django_schema):
    from django.db import transaction

    tick = _actor(django_broker)
    with transaction.atomic(using="other"), pytest.raises(NotBound, match="alias 'other'.*not the broker's database"):
        tick.send()
    assert _rows(django_project, django_schema) == 0


def test_an_explicit_bind_still_wins_over_atomic(django_project, django_broker, django_schema):
    from django.db import transaction

    from dramatiq_reliable import bind

    tick = _actor(django_broker)
    with psycopg.connect(django_project) as own:
        with transaction.atomic():
            with bind(own):
                tick.send()
            transaction.set_rollback(True)  # the Django block rolls back; the bound connection is separate
        own.commit()
    assert _rows(django_project, django_schema) == 1


def test_the_view_sends_inside_its_atomic_block(django_project, django_broker, django_schema):
    from django.test import Client

    client = Client()
    assert client.post("/orders/", {"item": "lamp", "card": "declined"}).status_code == 402
    assert _rows(django_project, django_schema) == 0
    assert client.post("/orders/", {"item": "lamp"}).status_code == 201
    assert _rows(django_project, django_schema) == 1
