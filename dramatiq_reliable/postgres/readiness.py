"""Whether a worker's queue table is there: one clear error while it is not, and consumers that wait for it.

A worker started before ``dramatiq-reliable migrate`` (a newcomer's first run, or a deploy
whose migration step runs after the workers start) would otherwise fail every claim with
``relation "<schema>.queue" does not exist``, which Dramatiq logs as a ``CRITICAL`` connection
error and retries every three seconds, per queue, for ever.  Instead the broker's consumers ask
one :class:`SchemaGate`: it checks the schema once, and while the table is missing it logs one
error naming the command that fixes it, checks again at a growing interval, and opens by itself
once the schema is migrated, so the worker starts consuming without a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .._util import first_line
from ..errors import SchemaNotReady
from ..schema import migrate_command

# Internal: the names below are used by other parts of the package, not by applications.
__all__: list[str] = []

logger = logging.getLogger("dramatiq_reliable.postgres")

#: The first check after the table was found missing comes this soon, in case the migration
#: runs right after the worker starts; each later one waits twice as long as the one before ...
FIRST_RECHECK_MS = 1_000
#: ... up to this, so a migration is noticed within half a minute at worst.  (Migration 18 sends
#: one notification as it commits, which calls :meth:`SchemaGate.nudge`: a worker waiting for a
#: fresh install's migration notices it at once.)
MAX_RECHECK_MS = 30_000
#: While the table stays missing, the error is logged again this often: it stays on the last
#: page of a worker's log without flooding it.
REMINDER_MS = 600_000


class SchemaGate:
    """Open once the queue table is ready; shared by every consumer of one broker.

    ``check`` raises :class:`~dramatiq_reliable.SchemaNotReady` (with the fix in its message)
    while the schema is not migrated; any other error it raises (Postgres unreachable) goes to
    the caller, since that is not a schema problem.  Once open, :meth:`is_open` costs nothing.
    """

    def __init__(self, check: Callable[[], None], *, schema: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self.schema = schema
        self._clock = clock
        self._lock = threading.Lock()
        #: True once the table was found ready (and until a claim finds it gone).
        self.ready = False
        #: How many times the schema was checked: a number for tests and for people reading a debugger.
        self.checks = 0
        self._next_check_at = 0.0
        self._recheck_ms = FIRST_RECHECK_MS
        self._logged_at: float | None = None
        self._missing = False

    def is_open(self) -> bool:
        """True when the table is ready; checks the schema when a check is due (one thread at a time)."""
        if self.ready:
            return True
        with self._lock:
            if self.ready:
                return True
            now = self._clock()
            if now < self._next_check_at:
                return False
            self.checks += 1
            try:
                self._check()
            except SchemaNotReady as error:
                self._close(str(error), now)
                return False
            if self._missing:
                logger.info("the queue table is ready now; this worker starts consuming")
            self.ready = True
            self._missing = False
            self._recheck_ms = FIRST_RECHECK_MS
            return True

    def nudge(self) -> None:
        """Check at the next :meth:`is_open` instead of waiting for the next due check.

        A notification arrived on the queue channel (the migration that dropped the queue
        trigger sends one as it commits, and :func:`~.consumer.wake_consumers` sends them), so
        the table is probably there now.
        """
        self._next_check_at = 0.0

    def lost(self, error: BaseException) -> None:
        """A claim found the table gone (dropped while the worker ran): close until it is back."""
        command = migrate_command(self.schema)
        with self._lock:
            self.ready = False
            self._close(f"the queue table is gone ({first_line(error)}); run {command!r}", self._clock())

    def _close(self, reason: str, now: float) -> None:
        self._missing = True
        self._next_check_at = now + self._recheck_ms / 1000
        waited_ms = self._recheck_ms
        self._recheck_ms = min(self._recheck_ms * 2, MAX_RECHECK_MS)
        if self._logged_at is not None and now - self._logged_at < REMINDER_MS / 1000:
            return
        self._logged_at = now
        logger.error(
            "%s; until then this worker consumes nothing: it checks again in %.0f s (then less often, at least "
            "every %.0f s) and starts consuming by itself",
            reason,
            waited_ms / 1000,
            MAX_RECHECK_MS / 1000,
        )
