"""The shop's URLs, the admin (for signing in) and the dramatiq-reliable page under /jobs/."""

from django.contrib import admin
from django.urls import include, path
from shop import views

urlpatterns = [
    path("orders/", views.place_order, name="place_order"),
    path("orders/plain/", views.place_order_plain, name="place_order_plain"),
    path("admin/", admin.site.urls),
    path("jobs/", include("dramatiq_reliable.django.urls")),
]
