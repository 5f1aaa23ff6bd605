"""An order, and how many receipts its job sent (exactly one, whatever the retries)."""

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    receipts_sent = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}: {self.item}"
