"""``send()`` from inside the namespace: one unbound send per line ``send N`` read on stdin.

Prints ``ready`` once the pool holds a live connection, then ``sent`` or ``failed`` (with the
error and the seconds the call took) for each send.
"""

from __future__ import annotations

import sys
import time

import dramatiq
from common import config, emit

from dramatiq_reliable import OutboxBroker

settings = config()
broker = OutboxBroker(url=settings["rabbitmq_url"], database=settings["database_url"], schema=settings["schema"])
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=settings["queue"], actor_name="partition_send")
def job(n: int) -> None:
    """Never run here: the test counts the outbox rows."""


job.send(0)
emit("ready")
for line in sys.stdin:
    n = int(line.split()[1])
    started = time.monotonic()
    try:
        job.send(n)
    except Exception as error:
        emit("failed", n=n, elapsed=time.monotonic() - started, error=f"{type(error).__name__}: {error}")
    else:
        emit("sent", n=n, elapsed=time.monotonic() - started)
broker.close()
