"""``python examples/fastapi_app``: the app on uvicorn, on DATABASE_URL (and RABBITMQ_URL if set).

Run a worker for its actor in another shell with the same variables:
``dramatiq examples.fastapi_app.worker`` is left out on purpose: any Dramatiq worker importing
``build()``'s broker works; tests/integration/test_fastapi_example.py runs one in process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import build

shop = build(os.environ["DATABASE_URL"], rabbitmq_url=os.environ.get("RABBITMQ_URL"))
uvicorn.run(shop.app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
