"""Job keys: the argument hash, external keys, and what Postgres can store."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from ..errors import ConfigurationError, IdempotencyKeyError

__all__ = ["payload_hash"]

#: Keys past this many UTF-8 bytes are refused: they must fit a btree index entry with room to spare.
MAX_KEY_BYTES = 1000


def derive_external_key(actor_name: str, key: str, step: str) -> str:
    """The external key of ``step`` in the job ``(actor_name, key)``: a hash, never random."""
    if not isinstance(step, str) or not step:
        raise ConfigurationError(f"step must be a non-empty string, got {step!r}; name the call, e.g. 'charge'")
    digest = hashlib.sha256("\x00".join((actor_name, key, step)).encode()).hexdigest()
    # 64 hex chars: far under every provider's limit (Stripe: 255) and free of separators.
    return f"dr-{digest}"


# What json.dumps(..., sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=False)
# builds on every call, built once: the same bytes, so hashes stored by earlier versions still match.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=False)


def payload_hash(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> bytes:
    """sha256 of the canonical JSON of the arguments (keyword order does not matter).

    An argument may hold a lone surrogate (JSON carries ``"\\ud800"`` escaped, so a message can):
    ``surrogatepass`` hashes it instead of raising, and leaves the bytes of every other string,
    and so every hash stored by earlier versions, unchanged.
    """
    return hashlib.sha256(_CANONICAL.encode([list(args), kwargs]).encode("utf-8", "surrogatepass")).digest()


def check_storable(message: Message[Any] | MessageProxy, what: str, value: str, fix: str) -> None:
    """Refuse text Postgres cannot store (a NUL, a lone surrogate) before any statement is sent.

    Sent anyway, it would fail the claim with an error that looks like an outage, and the
    message would be retried until its budget ran out.
    """
    problem = None
    if "\x00" in value:
        problem = "contains a NUL character"
    else:
        try:
            value.encode()
        except UnicodeEncodeError:
            problem = "contains a lone surrogate"
    if problem is not None:
        raise IdempotencyKeyError(
            f"{describe_message(message)}: {what} {value!r} {problem}, which Postgres text cannot store; {fix} "
            "(the actor did not run)"
        )


def describe_message(message: Message[Any] | MessageProxy) -> str:
    """The message an error is about; built only once there is an error."""
    return f"message {message.message_id!r} for actor {message.actor_name!r}"
