"""Django migrations that run dramatiq-reliable's own on the alias of ``DRAMATIQ_RELIABLE``."""

__all__: list[str] = []
