"""Jobs on Django's connection: the Idempotency transaction the ORM writes in, and connection hygiene."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from django.db import Error as DjangoError
from django.db import close_old_connections, connections, transaction
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import Middleware

from ..database import Database
from ..errors import ConfigurationError
from ._database import check_psycopg3, same_database

__all__ = ["CloseOldConnections", "DjangoJobConnections"]


class DjangoJobConnections:
    """Idempotency's job transaction on Django's own connection of the worker thread.

    ``acquire`` enters ``transaction.atomic(using=alias)`` and hands the middleware the driver
    connection under it; the middleware claims the key, runs the actor and commits or rolls
    back; ``release`` then leaves the atomic block.  So ``Order.objects.create()`` inside an actor
    commits with the job's key or not at all, ORM ``atomic()`` blocks inside the actor are
    savepoints of the job's transaction, and ``transaction.on_commit`` callbacks run only after
    the job committed (and are dropped when it rolled back).

    >>> Idempotency(job_connections=DjangoJobConnections("default"))  # doctest: +SKIP
    """

    def __init__(self, alias: str = "default") -> None:
        if not isinstance(alias, str) or not alias:
            raise ConfigurationError(f"alias must be a database alias such as 'default', got {alias!r}")
        self.alias = alias
        self._local = threading.local()
        self._checked: set[int] = set()

    def acquire(self, database: Database, timeout_s: float) -> psycopg.Connection[Any]:
        if id(database) not in self._checked:
            if not same_database(self.alias, database):
                raise ConfigurationError(
                    f"Idempotency keeps its keys in another database than DATABASES[{self.alias!r}]; the job's ORM "
                    "writes could not commit with them: give the broker and Idempotency the alias's database"
                )
            self._checked.add(id(database))
        wrapper = connections[self.alias]
        if wrapper.in_atomic_block:
            raise ConfigurationError(
                f"Django's connection {self.alias!r} of this worker thread is already inside atomic(); a job "
                "must start its own transaction: do not leave an atomic block open between jobs"
            )
        atomic = transaction.atomic(using=self.alias)
        try:
            atomic.__enter__()
            wrapper.ensure_connection()
        except DjangoError as error:
            # The middleware retries and fails closed on the driver's errors, not Django's wrappers.
            if isinstance(error.__cause__, psycopg.Error):
                raise error.__cause__ from None
            raise
        try:
            raw = check_psycopg3(wrapper.connection, self.alias)
        except BaseException:
            atomic.__exit__(None, None, None)
            raise
        self._local.atomic = atomic
        return raw

    def release(self, conn: psycopg.Connection[Any], *, database: Database, committed: bool) -> None:
        atomic = getattr(self._local, "atomic", None)
        self._local.atomic = None
        wrapper = connections[self.alias]
        if atomic is None:
            return
        try:
            if not committed:
                # Leaving atomic() then rolls back (a no-op on the driver, already rolled back)
                # and drops the on_commit callbacks the actor registered.
                transaction.set_rollback(True, using=self.alias)
            atomic.__exit__(None, None, None)
        finally:
            if conn.closed or conn.broken:
                wrapper.close()  # the next job connects again instead of failing on a dead socket


class CloseOldConnections(Middleware):
    """Close Django connections past ``CONN_MAX_AGE`` or broken, around each job, as a request does.

    A worker thread is long-lived: without this its connection would outlive a database restart
    or ``CONN_MAX_AGE``.  It comes first in the app's middleware, so its after-hook runs last,
    once ``Idempotency`` gave the connection back.
    """

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        close_old_connections()

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        close_old_connections()

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        close_old_connections()

    def before_worker_thread_shutdown(self, broker: Broker, thread: Any) -> None:
        connections.close_all()
