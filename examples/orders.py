"""The seed's order scenario: save an order and enqueue its receipt in one transaction.

Run with ``make demo``.  With ``DATABASE_URL`` and ``RABBITMQ_URL`` set it uses those servers
and an ``OutboxBroker`` with the in-process relay; with ``RABBITMQ_URL`` unset the queues live
in Postgres (``PostgresBroker``), and with ``DATABASE_URL`` unset an embedded Postgres is started
(the ``embedded`` extra), so a fresh machine needs nothing else.  The code that places orders is
the same on both brokers.  It migrates a demo schema, places three orders (one of which rolls
back), runs a worker, and shows that exactly the committed orders got a receipt.
"""

from __future__ import annotations

import os
import threading
import time

import dramatiq
import psycopg

from dramatiq_reliable import OutboxBroker, PostgresBroker, WorkerRelay, migrate
from dramatiq_reliable.embedded import EmbeddedPostgres

SCHEMA = "dramatiq_reliable_demo"
embedded = None
DATABASE_URL = os.environ.get("DATABASE_URL")
if not DATABASE_URL:
    embedded = EmbeddedPostgres()
    DATABASE_URL = embedded.start()
    print(f"DATABASE_URL is not set: using an embedded Postgres at {DATABASE_URL}")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL")

migrate(DATABASE_URL, schema=SCHEMA)
broker: OutboxBroker | PostgresBroker
if RABBITMQ_URL:
    broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=SCHEMA)
    broker.add_middleware(WorkerRelay(poll_interval_ms=200))
else:
    # The one line that changes when the queues move to RabbitMQ.
    broker = PostgresBroker(database=DATABASE_URL, schema=SCHEMA)
    print("RABBITMQ_URL is not set: the queues live in Postgres (PostgresBroker)")
dramatiq.set_broker(broker)

receipts: list[int] = []
done = threading.Event()


@dramatiq.actor(queue_name="demo_orders")
def send_receipt(order_id: int) -> None:
    """Payloads carry IDs: the actor loads the order it needs."""
    receipts.append(order_id)
    print(f"  worker: receipt sent for order {order_id}")
    if len(receipts) == 2:
        done.set()


def place_order(order_id: int, *, fail: bool = False) -> None:
    with broker.transaction() as conn:
        conn.execute("INSERT INTO demo_orders (id) VALUES (%s)", (order_id,))
        send_receipt.send(order_id)
        if fail:
            raise RuntimeError(f"order {order_id} failed validation after send()")


def main() -> None:
    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS demo_orders")
        conn.execute("CREATE TABLE demo_orders (id int PRIMARY KEY)")
    broker.flush_all()
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        print("placing orders 1 and 2 (commit) and 3 (rolls back)")
        place_order(1)
        place_order(2)
        try:
            place_order(3, fail=True)
        except RuntimeError as error:
            print(f"  app: {error}: the order and its message rolled back together")
        if not done.wait(30):
            raise SystemExit("demo failed: receipts did not arrive within 30s")
        time.sleep(0.5)  # a demo pause, so a stray receipt for order 3 would show up
        print(f"receipts sent for orders {sorted(receipts)}; order 3 has none, as it was never committed")
        assert sorted(receipts) == [1, 2]
    finally:
        worker.stop()
        broker.close()
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
