"""A relay inside the namespace, reporting every publish call: how long it took and how it ended."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from common import config, emit

from dramatiq_reliable import Relay

settings = config()
relay = Relay(
    rabbitmq_url=settings["rabbitmq_url"],
    database=settings["database_url"],
    schema=settings["schema"],
    confirm_timeout_ms=int(settings.get("confirm_timeout_ms", "30000")),
    backoff_max_ms=1000,
    poll_interval_ms=200,
)
publish = relay.publisher.publish


def reported(publications: Any) -> Any:
    started = time.monotonic()
    try:
        outcome = publish(publications)
    except Exception as error:
        emit("unavailable", count=len(publications), elapsed=time.monotonic() - started, error=str(error))
        raise
    emit(
        "published",
        count=len(publications),
        confirmed=len(outcome.confirmed),
        failed=len(outcome.failed),
        elapsed=time.monotonic() - started,
    )
    return outcome


relay.publisher.publish = reported  # type: ignore[method-assign]


def stop_on_eof() -> None:
    sys.stdin.read()
    relay.stop()


threading.Thread(target=stop_on_eof, daemon=True).start()
emit("ready")
relay.run()
emit("stopped")
