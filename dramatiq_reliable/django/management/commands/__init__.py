"""Management commands of the dramatiq-reliable Django app."""

__all__: list[str] = []
