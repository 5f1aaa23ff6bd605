"""Assertions on what an actor's code sent through an :class:`~dramatiq_reliable.testing.InMemoryBroker`.

They read the broker's delivered sends (:attr:`InMemoryBroker.sent`: transactions committed,
drained or not) after delivering the held sends whose transaction committed.  Called with
arguments, a send matches when its positional and keyword arguments are equal; called with none,
every send of the actor matches.  A failure lists what was sent, so the test's output says what
happened instead.

>>> assert_enqueued(send_receipt, 42)           # doctest: +SKIP
>>> assert_not_enqueued(send_receipt)           # doctest: +SKIP
AssertionError: expected no send of send_receipt; sent: send_receipt(42)
"""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.message import Message

from .._checks import check_int
from ..errors import ConfigurationError
from .broker import InMemoryBroker, describe

__all__ = ["assert_enqueued", "assert_enqueued_count", "assert_not_enqueued", "enqueued"]


def enqueued(actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> list[Message[Any]]:
    """The sends of ``actor`` (with these arguments, if any are given) its broker delivered, in order."""
    broker = _broker_of(actor)
    broker.settle()
    return [message for message in list(broker.sent) if _matches(message, actor, args, kwargs)]


def assert_enqueued(actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> list[Message[Any]]:
    """Fail unless ``actor`` was sent (with these arguments, if given) at least once; the matching sends."""
    found = enqueued(actor, *args, **kwargs)
    if not found:
        raise AssertionError(f"expected a send of {_wanted(actor, args, kwargs)}; {_sent(actor)}")
    return found


def assert_not_enqueued(actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> None:
    """Fail if ``actor`` was sent (with these arguments, if given)."""
    found = enqueued(actor, *args, **kwargs)
    if found:
        raise AssertionError(f"expected no send of {_wanted(actor, args, kwargs)}; {_sent(actor)}")


def assert_enqueued_count(count: int, actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> list[Message[Any]]:
    """Fail unless ``actor`` was sent (with these arguments, if given) exactly ``count`` times; the sends.

    ``count`` comes first so that no keyword argument of the actor's can clash with it.
    """
    check_int("count", count, minimum=0, fix="e.g. assert_enqueued_count(2, send_receipt, 42)")
    found = enqueued(actor, *args, **kwargs)
    if len(found) != count:
        raise AssertionError(
            f"expected {count} send{'s' if count != 1 else ''} of {_wanted(actor, args, kwargs)}, got "
            f"{len(found)}; {_sent(actor)}"
        )
    return found


def _broker_of(actor: object) -> InMemoryBroker:
    if not isinstance(actor, dramatiq.Actor):
        raise ConfigurationError(
            f"expected an actor, got {actor!r}; pass the function decorated with @dramatiq.actor (send_receipt, "
            "not send_receipt.fn or its name)"
        )
    broker = actor.broker
    if not isinstance(broker, InMemoryBroker):
        raise ConfigurationError(
            f"actor {actor.actor_name!r} is declared on a {type(broker).__name__}, not an InMemoryBroker; declare "
            "it after dramatiq.set_broker(InMemoryBroker()) (the reliable_broker fixture does that), or pass "
            "broker= to @dramatiq.actor"
        )
    return broker


def _matches(
    message: Message[Any], actor: dramatiq.Actor[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    if message.actor_name != actor.actor_name:
        return False
    if not args and not kwargs:
        return True
    # Compared as they travel: JSON turns tuples into lists, so (1, 2) matches [1, 2].
    return _travelled(message.args, message.kwargs) == _travelled(args, kwargs)


def _travelled(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    decoded = Message.decode(
        Message(queue_name="", actor_name="", args=tuple(args), kwargs=dict(kwargs), options={}).encode()
    )
    return list(decoded.args), dict(decoded.kwargs)


def _wanted(actor: dramatiq.Actor[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if not args and not kwargs:
        return actor.actor_name
    return describe(Message(queue_name="", actor_name=actor.actor_name, args=args, kwargs=kwargs, options={}))


def _sent(actor: dramatiq.Actor[Any, Any]) -> str:
    broker = _broker_of(actor)
    sent = [describe(message) for message in list(broker.sent)]
    held = [describe(message) for message in broker.held]
    text = f"sent: {', '.join(sent)}" if sent else "nothing was sent"
    if held:
        text += f"; held until their transaction commits: {', '.join(held)}"
    return text
