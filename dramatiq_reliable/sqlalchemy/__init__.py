"""SQLAlchemy sessions as the transaction ``send()`` joins: ``bind(session)``, or every session by event.

``bind(session)`` / ``async with bind(async_session)`` bind one session's transaction
(:mod:`dramatiq_reliable.sqlalchemy.connections`); :func:`bind_sessions` makes every session
of a ``sessionmaker`` join by itself (:mod:`dramatiq_reliable.sqlalchemy.sessions`).  Needs the
``sqlalchemy`` extra and the psycopg 3 driver (``postgresql+psycopg://``).
"""

from .sessions import bind_sessions

__all__ = ["bind_sessions"]
