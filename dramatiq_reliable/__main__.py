"""``python -m dramatiq_reliable``: the ``dramatiq-reliable`` command."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
