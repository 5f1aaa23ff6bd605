"""What the partition scripts share: their configuration (arguments) and their JSON lines."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, stamped with the machine's monotonic clock."""
    with _lock:
        print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


def config() -> dict[str, str]:
    """``key=value`` arguments of the script (URLs as the namespace reaches them, schema, queue)."""
    return dict(arg.split("=", 1) for arg in sys.argv[1:])
