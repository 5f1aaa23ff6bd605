"""Serve the shop with a worker: ``python examples/sqlalchemy_flask`` (DATABASE_URL, schema ``shop``).

curl -X POST localhost:5000/orders -H 'content-type: application/json' -d '{"item": "mug", "quantity": 2}'
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import dramatiq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy_flask.app import create_shop


def main() -> None:
    shop = create_shop(
        os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"), stock={"mug": 10}
    )
    worker = dramatiq.Worker(shop.broker, worker_threads=2)
    worker.start()
    try:
        shop.app.run(port=int(os.environ.get("PORT", "5000")))
    finally:
        worker.stop()
        shop.close()


if __name__ == "__main__":
    main()
