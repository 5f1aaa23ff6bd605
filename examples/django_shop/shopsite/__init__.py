"""The django_shop project (settings, URLs)."""
