"""The cluster part of a chaos run: find the node that holds the queue, stop it, SIGKILL it, and measure stalls.

On a 3-node cluster (``tests/rabbitmq_nodes.py``) the run takes the queue's home away twice: first
the node holding the queue (a quorum queue's leader, a classic queue's only copy) is stopped
gracefully, as a rolling restart would, and started again; later the node holding it *then* (a
quorum queue has elected a new leader by now) is SIGKILLed, a crash with no goodbye to clients or
peers, and started again.  The disruptions run in a thread of their own, since a node takes
seconds to stop and start and the conductor must keep restarting workers meanwhile.

A *stall* is the longest time in which no job completed (no effect row was written) that touches
a disruption's window; the same measure before the first disruption is the run's baseline.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rabbitmq_nodes import RabbitCluster

#: How long a node stays down before it is started again (each disruption).
DEFAULT_DOWN_MS = 5000
#: After a node is back, this long passes before the next disruption: the queue's members catch up.
SETTLE_S = 3.0


@dataclasses.dataclass
class Disruption:
    """One node taken down: ``action`` is ``"stop"`` or ``"kill"``; times are wall-clock seconds."""

    action: str
    node: str
    queue_type: str
    down_at: float
    back_at: float | None = None


def queue_home(cluster: RabbitCluster, queue: str) -> tuple[str, str]:
    """(the node holding ``queue``, its type): a quorum queue's leader, a classic queue's node.

    Asked of any running node; ``list_queues`` prints a quorum queue's ``leader`` and every
    queue's ``pid`` (``<node@host.N.N.N>``), whose node is a classic queue's only home.
    """
    problems = []
    for node in cluster.running_nodes():
        try:
            out = node.ctl("list_queues", "name", "type", "leader", "pid", "--no-table-headers", timeout_s=30)
        except (RuntimeError, OSError) as error:
            problems.append(str(error))
            continue
        for line in out.splitlines():
            fields = line.split("\t")
            if len(fields) >= 4 and fields[0] == queue:
                queue_type, leader, pid = fields[1], fields[2].strip(), fields[3].strip()
                if queue_type == "quorum" and leader:
                    return leader, queue_type
                return pid.strip("<>").rsplit(".", 3)[0], queue_type
    raise LookupError(f"no running node knows queue {queue!r}: {problems}")


class NodeChaos(threading.Thread):
    """Stops the queue's home node at ``stop_at_s``, later SIGKILLs its home at ``kill_at_s``.

    Each node stays down ``down_s`` and is then started again (waiting until it is back in the
    cluster).  The kill waits for the stopped node to be back plus ``SETTLE_S``: losing a second
    node of three while the first is still down would take the queue's majority, a different
    test.  ``note`` writes to the run's timeline.
    """

    def __init__(
        self,
        cluster: RabbitCluster,
        queue: str,
        *,
        started: float,
        plan: Sequence[tuple[float, str]],
        down_s: float,
        note: Callable[[str], None],
    ) -> None:
        super().__init__(name="chaos-nodes", daemon=True)
        self.cluster = cluster
        self.queue = queue
        self.started = started
        self.plan = list(plan)
        self.down_s = down_s
        self.note = note
        self.disruptions: list[Disruption] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            ready_at = self.started
            for at_s, action in self.plan:
                if self._halt.wait(max(0.0, max(self.started + at_s, ready_at) - time.monotonic())):
                    return
                name, queue_type = queue_home(self.cluster, self.queue)
                node = self.cluster.node_named(name)
                disruption = Disruption(action, name, queue_type, down_at=time.time())
                if action == "stop":
                    self.note(f"stopping {name}, home of the {queue_type} queue")
                    node.stop()
                    self.note(f"stopped {name}")
                else:
                    node.kill()
                    self.note(f"SIGKILL {name}, home of the {queue_type} queue")
                self.disruptions.append(disruption)
                if self._halt.wait(self.down_s):
                    return
                node.start()
                node.ctl("await_startup", timeout_s=90)
                disruption.back_at = time.time()
                self.note(f"started {name} again")
                ready_at = time.monotonic() + SETTLE_S
        except BaseException as error:  # reported by the run; never a silent half-run
            self.error = error

    def stop(self, timeout_s: float = 120.0) -> None:
        """Wait for the plan to finish (a node may be starting); ``halt`` first to cut it short."""
        self.join(timeout=timeout_s)

    def halt(self) -> None:
        self._halt.set()


def stalls(effect_times: Sequence[float], disruptions: Sequence[Disruption], end: float) -> dict[str, Any]:
    """The longest time without a completed job, before the first disruption and around each one.

    ``baseline`` (before the first) is one number; each kind of disruption, e.g.
    ``kill_quorum_home``, gets a list, one figure per disruption in order.

    ``effect_times`` are the wall-clock times of the effect rows; a disruption's window runs from
    the moment its node went down to the next disruption (or ``end``).  The gap that spans the
    moment the node went down counts for it (and not for the one before); the quiet after the last effect does not (the
    orders ran out, nothing was held up).
    """
    times = sorted(effect_times)
    bounds = [d.down_at for d in disruptions] + [end]
    result: dict[str, Any] = {}
    if times and disruptions:
        before = [t for t in times if t < bounds[0]]
        gaps = [b - a for a, b in itertools.pairwise(before)]
        result["baseline"] = round(max(gaps, default=0.0), 2)
    for index, disruption in enumerate(disruptions):
        start, stop = bounds[index], bounds[index + 1]
        longest = 0.0
        previous = max((t for t in times if t <= start), default=start)
        for t in times:
            if t <= start:
                continue
            if t > stop:
                break  # this gap spans the next disruption's moment: it counts for that one
            longest = max(longest, t - previous)
            previous = t
        result.setdefault(f"{disruption.action}_{disruption.queue_type}_home", []).append(round(longest, 2))
    return result
