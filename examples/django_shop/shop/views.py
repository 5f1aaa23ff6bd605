"""Placing an order: the order row and its receipt message in one ``transaction.atomic()``."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .models import Order
from .tasks import send_receipt


class CardDeclined(Exception):
    """The payment failed after the order was written: the whole transaction rolls back."""


@csrf_exempt  # an API endpoint of the example; a real one authenticates
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    """Create the order and send its receipt; a declined card rolls both back (no message)."""
    try:
        with transaction.atomic():
            order = Order.objects.create(item=request.POST.get("item", "book"))
            send_receipt.send(order.pk)  # joins the atomic block: no bind(), no on_commit
            if request.POST.get("card") == "declined":
                raise CardDeclined(order.pk)
    except CardDeclined:
        return JsonResponse({"error": "card declined"}, status=402)
    return JsonResponse({"order": order.pk}, status=201)


@csrf_exempt
@require_POST
def place_order_plain(request: HttpRequest) -> JsonResponse:
    """The same view writing only its row (the benchmark's baseline)."""
    with transaction.atomic():
        order = Order.objects.create(item=request.POST.get("item", "book"))
    return JsonResponse({"order": order.pk}, status=201)
