"""The web page in Django's URLconf: staff act, other users are refused, anonymous visitors sign in first."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def _user(name: str, *, staff: bool) -> Any:
    from django.contrib.auth.models import User

    return User.objects.create_user(name, password="x", is_staff=staff)


def _access(html: str) -> str:
    found = re.search(r'data-testid="access-mode"[^>]*>([^<]*)<', html)
    assert found, "the page has no access badge"
    return found[1].strip()


def test_staff_get_the_full_page_under_the_mount(django_broker):
    from django.test import Client

    client = Client()
    client.force_login(_user("ann", staff=True))
    response = client.get("/jobs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert _access(html) == "full · ann"
    assert 'href="/jobs/dead-letters"' in html  # links follow the mount point
    assert client.get("/jobs/static/web.css").status_code == 200


def test_signed_in_users_who_are_not_staff_are_refused_even_with_a_forged_header(django_broker):
    from django.test import Client

    client = Client()
    client.force_login(_user("bob", staff=False))
    assert client.get("/jobs/").status_code == 403
    assert client.get("/jobs/", HTTP_X_DRAMATIQ_RELIABLE_ACCESS="full").status_code == 403


def test_anonymous_visitors_are_sent_to_the_login_page_and_their_posts_refused(django_broker):
    from django.test import Client

    client = Client()
    response = client.get("/jobs/dead-letters")
    assert response.status_code == 302
    assert response["Location"] == "/admin/login/?next=/jobs/dead-letters"
    assert client.post("/jobs/dead-letters/replay", {"ids": "1"}).status_code == 403


def test_web_access_can_give_other_users_read_only_and_a_forged_header_changes_nothing(django_broker, django_schema):
    from conftest import configure
    from django.test import Client

    configure(BROKER="postgres", SCHEMA=django_schema, WEB_ACCESS=lambda user: "read")
    client = Client()
    client.force_login(_user("cy", staff=False))
    response = client.get("/jobs/", HTTP_X_DRAMATIQ_RELIABLE_ACCESS="full", HTTP_X_DRAMATIQ_RELIABLE_USER="admin")
    assert response.status_code == 200
    assert _access(response.content.decode()) == "read-only · cy"


def test_a_cross_site_post_from_staff_is_refused_by_the_page(django_broker):
    from django.test import Client

    client = Client()
    client.force_login(_user("dee", staff=True))
    response = client.post("/jobs/outbox/retry", HTTP_SEC_FETCH_SITE="cross-site")
    assert response.status_code == 403
    assert b"cross-site request refused" in response.content


def test_the_page_answers_under_django_asgi_too(django_broker):
    import asyncio

    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    staff = _user("eve", staff=True)

    async def fetch() -> Any:
        client = AsyncClient()
        await sync_to_async(client.force_login)(staff)
        return await client.get("/jobs/dead-letters")

    response = asyncio.run(fetch())
    assert response.status_code == 200
    assert _access(response.content.decode()) == "full · eve"
