"""Auto-binding: ``send()`` joins the open transaction of a SQLAlchemy session with no ``bind()``.

``bind_sessions(Session)`` (or a ``sessionmaker``, a ``scoped_session``, one session) listens to
the session's transaction events and registers an ambient source
(:func:`~dramatiq_reliable.binding.register_ambient`): a ``send()`` with nothing bound then
joins the transaction of the session the same code opened, so forgetting ``bind()`` can no
longer commit a message for an order that rolls back.

How a session is found, and why it is safe:

* When a session's root transaction is created (its autobegin or ``session.begin()``), a weak
  reference to the session and that transaction is added to a context variable: the sessions
  opened by the current thread or asyncio task.  Another thread's session (a
  ``scoped_session`` per thread) is never seen; a session closed or garbage-collected is
  dropped, and the list is pruned as it is read.
* At send time the newest such session whose *same* root transaction is still its current one
  is joined.  Whether the end event ran or not (a session dropped without ``close()``, a
  transaction ended in another thread), a transaction that ended is never joined, because the
  session's current transaction is checked, not remembered.
* A session whose transaction failed (a flush raised) is refused with ``NotBound``: it would
  otherwise be skipped and the message committed on its own.
* In a worker thread, only a transaction the running delivery opened is joined, and none once
  its actor raised: the retry Dramatiq sends from an after-hook must not join a transaction
  the failed actor left open (its traceback keeps it alive until it is rolled back).
* A session bound to several engines (``binds=``) joins on the engine whose URL names the
  broker's database (name and port); if none or several do, the send is refused with the fix.

An explicit binding (``bind()``, ``broker.transaction()``, a job's connection) always wins over
an ambient session.  Async sessions are not auto-bound: use ``async with bind(session):``.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from dramatiq.broker import MessageProxy
from sqlalchemy import event
from sqlalchemy.orm import Session, scoped_session, sessionmaker
from sqlalchemy.orm.session import SessionTransaction

from ..binding import register_ambient
from ..errors import ConfigurationError, NotBound
from ..sending import processing_message
from .connections import check_driver, driver_connection, session_binds

if TYPE_CHECKING:
    from ..database import Database

__all__ = ["bind_sessions"]


class _Opened(NamedTuple):
    session: weakref.ref[Session]
    transaction: weakref.ref[SessionTransaction]
    #: The delivery a worker thread was processing when the transaction began (None elsewhere).
    delivery: weakref.ref[MessageProxy] | None


#: The session transactions the current thread or task opened, oldest first (an immutable tuple,
#: so a copied context never shares a list it could change under another task).
_opened: contextvars.ContextVar[tuple[_Opened, ...]] = contextvars.ContextVar(
    "dramatiq_reliable_sqlalchemy_sessions", default=()
)

_lock = threading.Lock()
_listening = 0  #: how many bind_sessions() targets are live; the ambient source is registered while > 0
_unregister: Callable[[], None] | None = None


def _live(entry: _Opened) -> tuple[Session, SessionTransaction] | None:
    """The session and its transaction, if that transaction is still the session's current one."""
    session, transaction = entry.session(), entry.transaction()
    if session is None or transaction is None or session.get_transaction() is not transaction:
        return None
    return session, transaction


def _on_create(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:
        return  # a savepoint or subtransaction: the root's connection already carries it
    kept = tuple(entry for entry in _opened.get() if _live(entry) is not None)
    held = processing_message()
    delivery = weakref.ref(held) if held is not None else None
    _opened.set((*kept, _Opened(weakref.ref(session), weakref.ref(transaction), delivery)))


def _on_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:
        return
    current = _opened.get()
    kept = tuple(entry for entry in current if entry.transaction() not in (transaction, None))
    if len(kept) != len(current):
        _opened.set(kept)


def _matches(bind: Any, database: Database) -> bool:
    """Whether an engine's URL names the broker's database (a part either side leaves out matches)."""
    url = getattr(bind, "url", None) or getattr(getattr(bind, "engine", None), "url", None)
    if url is None:
        return False
    dbname, port = database.identity()
    if dbname is not None and url.database is not None and url.database != dbname:
        return False
    return port is None or (url.port or 5432) == port


def _pick_bind(session: Session, database: Database) -> Any:
    binds = session_binds(session)
    if len(binds) <= 1:
        return binds[0] if binds else None
    matching = [bind for bind in binds if _matches(bind, database)]
    if len(matching) == 1:
        return matching[0]
    dbname, port = database.identity()
    raise NotBound(
        f"send() inside a SQLAlchemy session bound to {len(binds)} engines, {len(matching)} of them on the "
        f"broker's database {dbname!r} (port {port}); bind the connection of the engine that holds it: "
        "'with bind(session.connection(bind_arguments={\"bind\": engine})):'"
    )


def _ambient(database: Database) -> psycopg.Connection[Any] | None:
    """The ambient source: the connection of the newest open session transaction of this context."""
    held = processing_message()
    # Dramatiq stores the actor's exception on the delivery before its after-hooks run: a send
    # then is a retry or a failure callback, and must not join a transaction the failed actor
    # left open (the traceback keeps it alive; it rolls back when collected, and the retry with it).
    if held is not None and getattr(held, "_exception", None) is not None:
        return None
    for entry in reversed(_opened.get()):
        if held is not None and (entry.delivery is None or entry.delivery() is not held):
            continue  # opened outside this delivery (an earlier message's leftover): not this job's
        live = _live(entry)
        if live is None:
            continue
        session, transaction = live
        if not transaction.is_active:
            raise NotBound(
                "send() inside a SQLAlchemy session whose transaction failed (a flush raised); "
                "call session.rollback() and retry the transaction"
            )
        bind = _pick_bind(session, database)
        if bind is None:
            continue
        conn = driver_connection(session.connection(bind_arguments={"bind": bind}))
        if isinstance(conn, psycopg.Connection):
            return conn
    return None


def _class_of(target: object) -> type[Session] | Session:
    """What the session events listen on, after refusing what they cannot serve."""
    name = type(target).__name__
    if name.startswith("Async") or name.startswith("async_"):
        raise ConfigurationError(
            f"bind_sessions() got a SQLAlchemy {name}; async sessions are not auto-bound (their events run "
            "outside the task's send): use 'async with bind(session):' around the sends"
        )
    if isinstance(target, scoped_session):
        target = target.session_factory
    if isinstance(target, sessionmaker):
        bind = target.kw.get("bind")
        binds = target.kw.get("binds") or {}
        for engine in [bind, *binds.values()]:
            if engine is not None:
                check_driver(engine, "session")
        return target.class_
    if isinstance(target, type) and issubclass(target, Session):
        return target
    if isinstance(target, Session):
        for engine in session_binds(target):
            check_driver(engine, "Session")
        return target
    raise ConfigurationError(
        f"bind_sessions() needs a SQLAlchemy Session class, sessionmaker, scoped_session or Session, got "
        f"{name!r}; pass the sessionmaker your app creates sessions with"
    )


def bind_sessions(target: object) -> Callable[[], None]:
    """Make ``send()`` join the open transaction of every session ``target`` makes, with no ``bind()``.

    ``target`` is a ``sessionmaker`` (its sessions only), a ``scoped_session``, a ``Session``
    subclass (``Session`` itself: every session of the process) or one ``Session``.  Returns a
    function that undoes it.  Inside a session transaction a send joins it: its row commits
    with ``session.commit()``, vanishes with a rollback or a ``close()`` without commit, and
    follows ``begin_nested()`` savepoints.  Outside one, the broker's ``on_unbound`` applies.

    >>> Session = sessionmaker(engine)        # doctest: +SKIP
    >>> undo = bind_sessions(Session)          # doctest: +SKIP
    >>> with Session.begin() as session:       # doctest: +SKIP
    ...     session.add(Order(id=42))
    ...     send_receipt.send(42)              # commits with the order, or not at all

    A ``Session`` bound to several engines joins on the one whose URL names the broker's
    database.  A session on psycopg2 (or any driver but psycopg 3) is refused here, and an
    ``AsyncSession`` too (use ``async with bind(session):``).
    """
    global _listening, _unregister
    listened = _class_of(target)

    # Functions of this call's own, so two calls on one target are undone one at a time.
    def on_create(session: Session, transaction: SessionTransaction) -> None:
        _on_create(session, transaction)

    def on_end(session: Session, transaction: SessionTransaction) -> None:
        _on_end(session, transaction)

    event.listen(listened, "after_transaction_create", on_create)
    event.listen(listened, "after_transaction_end", on_end)
    with _lock:
        _listening += 1
        if _unregister is None:
            _unregister = register_ambient(_ambient)
    undone = False

    def undo() -> None:
        global _listening, _unregister
        nonlocal undone
        with _lock:
            if undone:
                return
            undone = True
            event.remove(listened, "after_transaction_create", on_create)
            event.remove(listened, "after_transaction_end", on_end)
            _listening -= 1
            if _listening == 0 and _unregister is not None:
                _unregister()
                _unregister = None

    return undo
