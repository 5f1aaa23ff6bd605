"""Mount the web page: ``path("jobs/", include("dramatiq_reliable.django.urls"))``.

Staff users get the full page; other signed-in users are refused unless
``DRAMATIQ_RELIABLE["WEB_ACCESS"]`` says otherwise; anonymous visitors go to ``LOGIN_URL``.
"""

from __future__ import annotations

from django.urls import re_path

from ._web import page

__all__: list[str] = []

app_name = "dramatiq_reliable"
urlpatterns = [re_path(r"^(?P<path>.*)$", page, name="page")]
