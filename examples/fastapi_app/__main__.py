"""``python examples/fastapi_app``: the app on uvicorn, on ``DATABASE_URL`` (and ``RABBITMQ_URL`` if set).

The worker for ``confirm_order`` is any Dramatiq worker on ``build()``'s broker, built with the
same URLs (tests/integration/test_fastapi_example.py runs one in process).
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
