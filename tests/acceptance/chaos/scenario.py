"""One chaos run: produce orders, break things on a seeded schedule, drain, and tally the ledger.

Sizes come from the environment so a soak is the same test with other numbers:

=======================  ===========================================================  =========
variable                 meaning                                                      default
=======================  ===========================================================  =========
``CHAOS_SEED``           seed of the orders' fates and of the chaos schedule           random
``CHAOS_COUNT``          orders sent (10% rolled back on purpose, 5% poison)          600
``CHAOS_SECONDS``        how long orders are sent and things are broken               ``max(20, count / 40)``
``CHAOS_KILLS``          SIGKILLs of workers, and as many of relays                    ``max(3, seconds / 10)``
``CHAOS_CUTS``           cuts of Postgres, and as many of RabbitMQ                     ``max(2, seconds / 15)``
``CHAOS_CUT_MS``         how long a cut lasts (each one 60-120% of this)               4000
``CHAOS_DRAIN_SECONDS``  how long the fleet may take to finish once the chaos ends     60
``CHAOS_WORK_MS``        the actor's work between its write and its COMMIT            150
=======================  ===========================================================  =========

On a 3-node cluster (``Settings.from_env(cluster=True)``, ``test_chaos_on_a_cluster_loses_nothing``) the
RabbitMQ outages are the nodes' own (``chaos/nodes.py``): the node holding the queue is stopped and
started, later the node holding it then is SIGKILLed and started, and every process takes every
node's URL.  Other defaults there, and knobs of their own:

=======================  ===========================================================  =========
variable                 meaning                                                      cluster
=======================  ===========================================================  =========
``CHAOS_COUNT``          as above                                                      300
``CHAOS_SECONDS``        as above                                                      ``max(30, count / 10)``
``CHAOS_KILLS``          as above                                                      ``max(1, seconds / 40)``
``CHAOS_CUTS``           cuts of Postgres only (RabbitMQ's outages are the nodes')     0
``CHAOS_QUEUE_TYPE``     ``quorum`` or ``classic`` (today's default, to compare)       quorum
``CHAOS_SPREAD``         ``1``: process i's URLs start at node i; ``0``: at node 1   1
``CHAOS_NODE_DOWN_MS``   how long each node stays down                                5000
``CHAOS_NODE_CYCLES``    how many times the home node is stopped, then SIGKILLed      ``max(1, seconds / 60)``
=======================  ===========================================================  =========

The work time is long on purpose: a Postgres cut then finds several jobs between their write
and their COMMIT, the window where a commit's outcome becomes unknown.  Every kill, cut and
restore is written with its time to ``timeline.log`` in the run's log directory.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import dramatiq
import pika
import psycopg
from dramatiq.common import dq_name, xq_name
from psycopg import sql
from rabbitmq_nodes import RabbitCluster
from support import Rabbit

from dramatiq_reliable import Database, OutboxBroker

from . import ACTOR_NAME
from .fleet import Fleet
from .ledger import DeadLetterRow, Ledger, Order, tally
from .nodes import DEFAULT_DOWN_MS, NodeChaos, stalls
from .proxies import Proxies

logger = logging.getLogger("chaos")

ROLLBACK_RATE = 0.10
POISON_RATE = 0.05
FAIL_RATE = 0.05
#: An exit on its own is restarted after this long, as a process manager would.
RESTART_AFTER_S = 0.5
#: A Postgres cut waits (this long at most) for this many jobs to be between write and COMMIT.
ARM_S = 6.0
COMMITTING_JOBS = 2


@dataclasses.dataclass(frozen=True)
class Settings:
    seed: int
    count: int
    seconds: float
    kills: int
    cuts: int
    cut_ms: int
    drain_seconds: float
    work_ms: int
    workers: int = 2
    relays: int = 2
    threads: int = 4
    #: On a cluster: the nodes' own outages instead of a RabbitMQ proxy (see the module docstring).
    cluster: bool = False
    queue_type: str = "classic"
    spread: bool = True
    node_down_ms: int = 5000
    node_cycles: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, cluster: bool = False) -> Settings:
        env = os.environ if environ is None else environ
        seed = int(env["CHAOS_SEED"]) if env.get("CHAOS_SEED") else secrets.randbelow(2**31)
        count = int(env.get("CHAOS_COUNT") or (300 if cluster else 600))
        seconds = float(env.get("CHAOS_SECONDS") or (max(30.0, count / 10) if cluster else max(20.0, count / 40)))
        kills = env.get("CHAOS_KILLS") or (max(1, int(seconds / 40)) if cluster else max(3, int(seconds / 10)))
        cuts = env.get("CHAOS_CUTS") or (0 if cluster else max(2, int(seconds / 15)))
        queue_type = env.get("CHAOS_QUEUE_TYPE") or ("quorum" if cluster else "classic")
        if queue_type not in ("classic", "quorum"):
            raise ValueError(f"CHAOS_QUEUE_TYPE is {queue_type!r}; set it to 'quorum' or 'classic'")
        return cls(
            seed=seed,
            count=count,
            seconds=seconds,
            kills=int(kills),
            cuts=int(cuts),
            cut_ms=int(env.get("CHAOS_CUT_MS") or 4000),
            drain_seconds=float(env.get("CHAOS_DRAIN_SECONDS") or 60),
            work_ms=int(env.get("CHAOS_WORK_MS") or 150),
            cluster=cluster,
            queue_type=queue_type,
            spread=(env.get("CHAOS_SPREAD") or "1") != "0",
            node_down_ms=int(env.get("CHAOS_NODE_DOWN_MS") or DEFAULT_DOWN_MS),
            node_cycles=int(env.get("CHAOS_NODE_CYCLES") or max(1, int(seconds / 60))),
        )

    def node_plan(self) -> list[tuple[float, str]]:
        """When the queue's home node is stopped and, later, SIGKILLed (seconds into the window).

        Each cycle has its slot of the window: a stop at 10% of it, a kill at 50% (or once the
        stopped node is back, whichever is later).
        """
        if not self.cluster:
            return []
        slot = self.seconds / self.node_cycles
        return [
            (i * slot + share * slot, action)
            for i in range(self.node_cycles)
            for share, action in ((0.1, "stop"), (0.5, "kill"))
        ]


# -- the schedule ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Event:
    at_s: float
    seq: int
    action: str  # "kill" / "start" (a member), "cut" / "restore" (a proxy)
    target: str
    length_s: float = 0.0  # a cut's length: its restore is scheduled when the cut happens
    due_s: float = 0.0  # when a postponed cut was first due


def schedule(settings: Settings, members: list[str]) -> list[Event]:
    """The run's kills and cuts, fixed by the seed.

    Kills land anywhere in the window; a killed member comes back 0.2-1.5 s later.  The cuts of
    one server each get their own slot of the window, with room for a postponed Postgres cut,
    so they never overlap each other (a Postgres cut may overlap a RabbitMQ cut, and kills
    land during cuts).
    """
    rng = random.Random(f"{settings.seed}-schedule")
    seq = itertools.count()
    window = settings.seconds
    events: list[Event] = []
    workers = [name for name in members if name.startswith("worker")]
    relays = [name for name in members if name.startswith("relay")]
    for pool in (workers, relays):
        for _ in range(settings.kills if pool else 0):
            at = rng.uniform(0.05 * window, 0.95 * window)
            target = rng.choice(pool)
            events.append(Event(at, next(seq), "kill", target))
            events.append(Event(at + rng.uniform(0.2, 1.5), next(seq), "start", target))
    slot = 0.9 * window / max(settings.cuts, 1)
    # On a cluster RabbitMQ's outages are the nodes' own (chaos/nodes.py), not a proxy's.
    for server in ("postgres",) if settings.cluster else ("postgres", "rabbitmq"):
        for i in range(settings.cuts):
            length = settings.cut_ms / 1000 * rng.uniform(0.6, 1.2)
            start = 0.05 * window + i * slot + rng.uniform(0, max(slot - length - ARM_S, 0.1))
            events.append(Event(start, next(seq), "cut", server, length_s=length, due_s=start))
    return sorted(events)


class Conductor(threading.Thread):
    """Runs the schedule against the fleet and the proxies, and restarts members that exit on their own.

    The only thread that touches the fleet while the run lasts.  ``finish()`` restores both
    proxies and starts every member that is down, then keeps supervising until ``stop()``.
    """

    def __init__(
        self,
        fleet: Fleet,
        proxies: Proxies,
        events: list[Event],
        started: float,
        *,
        watch: psycopg.Connection[Any],
        application_name: str,
    ) -> None:
        super().__init__(name="chaos-conductor", daemon=True)
        self.watch = watch
        self.application_name = application_name
        self.fleet = fleet
        self.proxies = proxies
        self.started = started
        self.queue = list(events)
        heapq.heapify(self.queue)
        self.done: dict[str, int] = {"kill_worker": 0, "kill_relay": 0, "cut_postgres": 0, "cut_rabbitmq": 0}
        self.exits: list[tuple[str, int]] = []
        self.timeline: list[str] = []
        self.error: BaseException | None = None
        self._seq = itertools.count(10**9)
        self._halt = threading.Event()
        self._finish = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                now = time.monotonic() - self.started
                if self._finish.is_set() and not self._finished.is_set():
                    self._wrap_up(now)
                while self.queue and self.queue[0].at_s <= now:
                    self._do(heapq.heappop(self.queue), now)
                for member in self.fleet.members:
                    code = member.exited_on_its_own()
                    if code is not None:
                        self.exits.append((member.name, code))
                        self._note(now, f"{member.name} exited on its own with {code}; restarting")
                        heapq.heappush(self.queue, Event(now + RESTART_AFTER_S, next(self._seq), "start", member.name))
                self._halt.wait(0.05)
        except BaseException as error:  # reported by the test; never a silent half-run
            self.error = error
            logger.exception("chaos conductor failed")

    def _do(self, event: Event, now: float) -> None:
        if event.action == "kill":
            member = self.fleet.member(event.target)
            if member.running:
                member.kill()
                self.done[f"kill_{event.target.split('-')[0]}"] += 1
                self._note(now, f"SIGKILL {event.target}")
        elif event.action == "start":
            member = self.fleet.member(event.target)
            if member.process is None:
                member.start()
                self._note(now, f"started {event.target}")
        elif event.action == "cut":
            committing = self._committing() if event.target == "postgres" else None
            if committing is not None and committing < COMMITTING_JOBS and now - event.due_s < ARM_S:
                # Put off until jobs are committing, by ARM_S at most.
                heapq.heappush(self.queue, dataclasses.replace(event, at_s=now + 0.05, seq=next(self._seq)))
                return
            self.proxies.cut(event.target)
            self.done[f"cut_{event.target}"] += 1
            detail = "" if committing is None else f", {now - event.due_s:.1f}s late, {committing} jobs committing"
            self._note(now, f"cut {event.target} for {event.length_s:.1f}s{detail}")
            heapq.heappush(self.queue, Event(now + event.length_s, next(self._seq), "restore", event.target))
        elif event.action == "restore":
            self.proxies.restore(event.target)
            self._note(now, f"restored {event.target}")

    def _committing(self) -> int:
        """How many job transactions are open now (between their key and their COMMIT).

        A Postgres cut is meant to land there, where a commit's outcome becomes unknown; one that
        lands while nothing flows (just after a RabbitMQ cut, say) tests only reconnection.  The
        workers' sessions carry the run's own ``application_name``, so this counts only them.
        """
        row = self.watch.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'idle in transaction'",
            (self.application_name,),
        ).fetchone()
        return int(row[0]) if row is not None else 0

    def _wrap_up(self, now: float) -> None:
        # The chaos is over: what is still scheduled is dropped, everything comes back.
        self.queue = []
        self.proxies.restore("postgres")
        self.proxies.restore("rabbitmq")
        for member in self.fleet.members:
            if member.process is None:
                member.start()
        self._finished.set()
        self._note(now, "chaos over: every server and process back")

    def note(self, what: str) -> None:
        """A line in the timeline from another thread (the node chaos)."""
        self._note(time.monotonic() - self.started, what)

    def _note(self, now: float, what: str) -> None:
        self.timeline.append(f"{now:7.2f}s {what}")
        logger.info("%.2fs: %s", now, what)

    def finish(self, timeout_s: float = 10.0) -> None:
        self._finish.set()
        if not self._finished.wait(timeout_s):
            raise AssertionError("the chaos conductor did not wrap up; see the log")

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


# -- the producer ----------------------------------------------------------------------------


@dataclasses.dataclass
class Produced:
    attempted: int = 0
    rolled_back: int = 0
    failed: int = 0


def produce(settings: Settings, broker: OutboxBroker, queue: str, schema: str, started: float) -> Produced:
    """Send ``settings.count`` orders, paced over the window, each in its own transaction.

    An order's business row and its outbox row commit together; about 10% of the transactions
    are rolled back on purpose after the send, about 5% of the orders are poison.  A transaction
    that fails (Postgres cut) is not retried: whether it committed is read from Postgres later.
    """
    rng = random.Random(f"{settings.seed}-orders")
    actor: dramatiq.Actor[[int, bool], None] = dramatiq.actor(
        _never_runs, actor_name=ACTOR_NAME, queue_name=queue, broker=broker
    )
    insert = sql.SQL("INSERT INTO {}.chaos_orders (order_id, message_id, poison) VALUES (%s, %s, %s)").format(
        sql.Identifier(schema)
    )
    produced = Produced()
    pace = 0.95 * settings.seconds / max(settings.count, 1)
    for order_id in range(settings.count):
        rollback = rng.random() < ROLLBACK_RATE
        poison = rng.random() < POISON_RATE
        due = started + order_id * pace
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        produced.attempted += 1
        message = actor.message(order_id, poison)
        try:
            with broker.transaction() as conn:
                conn.execute(insert, (order_id, message.message_id, poison))
                broker.enqueue(message)
                if rollback:
                    raise _RolledBack
        except _RolledBack:
            produced.rolled_back += 1
        except Exception as error:  # a cut: the order may or may not have committed
            produced.failed += 1
            logger.debug("order %d: %s: %s", order_id, type(error).__name__, error)
    return produced


class _RolledBack(Exception):
    """Raised inside an order's transaction to roll it back on purpose."""


def _never_runs(order_id: int, poison: bool) -> None:  # pragma: no cover - the workers run the real one
    raise AssertionError("the producer's copy of the actor never runs")


# -- the run ---------------------------------------------------------------------------------


SETUP_SQL = """
CREATE TABLE {schema}.chaos_orders (
    order_id int PRIMARY KEY,
    message_id text NOT NULL,
    poison boolean NOT NULL
);
CREATE TABLE {schema}.chaos_effects (
    id bigserial PRIMARY KEY,
    order_id int NOT NULL,
    message_id text,
    pid int,
    -- the job's write, not its transaction's start: stalls are measured between these
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX ON {schema}.chaos_effects (order_id);
"""


def create_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL(SETUP_SQL).format(schema=sql.Identifier(schema)))


@dataclasses.dataclass
class Run:
    settings: Settings
    database_url: str
    rabbitmq_url: str
    schema: str
    queue: str
    log_dir: Path
    say: Callable[[str], None] = print
    #: The 3-node cluster the run's processes use instead of ``rabbitmq_url`` (``Settings.cluster``).
    cluster: RabbitCluster | None = None

    @property
    def rabbitmq_urls(self) -> list[str]:
        return self.cluster.urls if self.cluster is not None else [self.rabbitmq_url]


def _resolved(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int, int]:
    """(committed orders, orders done or dead, unpublished outbox rows), read directly."""
    query = sql.SQL(
        """
        SELECT (SELECT count(*) FROM {s}.chaos_orders),
               (SELECT count(*) FROM {s}.chaos_orders o
                 WHERE (o.poison AND EXISTS (SELECT 1 FROM {s}.dead_letters d WHERE d.message_id = o.message_id))
                    OR (NOT o.poison AND EXISTS (SELECT 1 FROM {s}.chaos_effects e WHERE e.order_id = o.order_id))),
               (SELECT count(*) FROM {s}.outbox WHERE published_at IS NULL)
        """
    ).format(s=sql.Identifier(schema))
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def _effect_times(conn: psycopg.Connection[Any], schema: str) -> list[float]:
    query = sql.SQL("SELECT extract(epoch FROM created_at)::float8 FROM {}.chaos_effects").format(
        sql.Identifier(schema)
    )
    return [float(row[0]) for row in conn.execute(query)]


def drain(run: Run, conn: psycopg.Connection[Any], *, stall_s: float = 20.0) -> float:
    """Wait until every committed order is done or dead and the outbox is empty; the seconds it took.

    Gives up at the drain deadline, or once nothing progressed for ``stall_s`` with the outbox
    empty (work that is nowhere will not come back; waiting longer only slows a failing run).
    """
    started = time.monotonic()
    deadline = started + run.settings.drain_seconds
    last_progress, last_resolved = started, -1
    settled = 0
    while time.monotonic() < deadline:
        committed, resolved, pending = _resolved(conn, run.schema)
        now = time.monotonic()
        if resolved != last_resolved:
            last_progress, last_resolved = now, resolved
        if resolved == committed and pending == 0:
            settled += 1
            if settled >= 3:  # a second more: late duplicates would show up as doubles
                break
        else:
            settled = 0
            if pending == 0 and now - last_progress > stall_s:
                break
        time.sleep(0.5)
    return time.monotonic() - started


def collect(run: Run, conn: psycopg.Connection[Any], rabbit: Rabbit, run_info: dict[str, Any]) -> Ledger:
    """Read everything the ledger needs, once the fleet stopped."""
    s = sql.Identifier(run.schema)
    orders = [
        Order(int(order_id), str(message_id), bool(poison))
        for order_id, message_id, poison in conn.execute(
            sql.SQL("SELECT order_id, message_id, poison FROM {}.chaos_orders").format(s)
        )
    ]
    effects = {
        int(order_id): int(count)
        for order_id, count in conn.execute(
            sql.SQL("SELECT order_id, count(*) FROM {}.chaos_effects GROUP BY order_id").format(s)
        )
    }
    dead_letters = [
        DeadLetterRow(str(message_id), str(reason), int(attempts), error_type)
        for message_id, reason, attempts, error_type in conn.execute(
            sql.SQL("SELECT message_id, reason, attempts, error_type FROM {}.dead_letters").format(s)
        )
    ]
    pending = {
        str(message_id)
        for (message_id,) in conn.execute(
            sql.SQL("SELECT message_id FROM {}.outbox WHERE published_at IS NULL").format(s)
        )
    }
    queued = {body["message_id"] for name in (run.queue, dq_name(run.queue)) for body in rabbit.take_all(name)}
    xq = {body["message_id"] for body in rabbit.take_all(xq_name(run.queue))}
    return tally(
        orders=orders,
        effects=effects,
        dead_letters=dead_letters,
        outbox_pending=pending,
        queued=queued,
        xq=xq,
        run=run_info,
    )


def _wait_for_consumers(rabbit: Rabbit, queue: str, workers: int, timeout_s: float = 60.0) -> None:
    """Start the clock once every worker consumes: a cut before that would test nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            consumers = int(rabbit.channel.queue_declare(queue=queue, passive=True).method.consumer_count)
        except pika.exceptions.ChannelClosedByBroker:  # not declared by a worker yet
            rabbit.channel = rabbit.connection.channel()
            consumers = 0
        if consumers >= workers:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"only {consumers} of {workers} workers consume {queue!r} after {timeout_s:g}s")
        time.sleep(0.2)


def execute(run: Run, conn: psycopg.Connection[Any], rabbit: Rabbit) -> tuple[Ledger, Fleet]:
    """The whole run; the fleet is returned for its logs and is stopped and closed already."""
    settings = run.settings
    run.say(
        f"CHAOS_SEED={settings.seed} CHAOS_COUNT={settings.count} CHAOS_SECONDS={settings.seconds:g} "
        f"CHAOS_KILLS={settings.kills} CHAOS_CUTS={settings.cuts} CHAOS_CUT_MS={settings.cut_ms}"
    )
    create_tables(conn, run.schema)
    proxies = Proxies.start(run.database_url, ";".join(run.rabbitmq_urls), rabbitmq=run.cluster is None)
    urls = proxies.rabbitmq_url.split(";")
    fleet = Fleet(
        database_url=proxies.database_url,
        rabbitmq_urls=urls,
        schema=run.schema,
        queue=run.queue,
        seed=settings.seed,
        workers=settings.workers,
        relays=settings.relays,
        threads=settings.threads,
        fail_rate=FAIL_RATE,
        work_ms=settings.work_ms,
        log_dir=run.log_dir,
        spread=settings.spread,
        queue_type=settings.queue_type,
    )
    producer = OutboxBroker(
        url=urls,
        database=Database(url=proxies.database_url, max_size=2, timeout_ms=2000),
        schema=run.schema,
        **({"queue_type": settings.queue_type} if settings.queue_type != "classic" else {}),
    )
    conductor: Conductor | None = None
    nodes: NodeChaos | None = None
    # The conductor's own connection, straight to Postgres (never cut).
    watch = psycopg.connect(run.database_url, autocommit=True)
    began = time.monotonic()
    try:
        fleet.start()
        _wait_for_consumers(rabbit, run.queue, settings.workers)
        started = time.monotonic()
        wall_started = time.time()
        conductor = Conductor(
            fleet,
            proxies,
            schedule(settings, [m.name for m in fleet.members]),
            started,
            watch=watch,
            application_name=fleet.application_name,
        )
        conductor.start()
        if run.cluster is not None:
            nodes = NodeChaos(
                run.cluster,
                run.queue,
                started=started,
                plan=settings.node_plan(),
                down_s=settings.node_down_ms / 1000,
                note=conductor.note,
            )
            nodes.start()
        produced = produce(settings, producer, run.queue, run.schema, started)
        if (rest := started + settings.seconds - time.monotonic()) > 0:
            time.sleep(rest)
        if nodes is not None:
            nodes.stop()  # every node is back before the drain is timed
            if nodes.error is not None:
                raise AssertionError(f"the node chaos failed: {nodes.error!r}") from nodes.error
        conductor.finish()
        drained_s = drain(run, conn)
        ended = time.time()
        conductor.stop()
        (run.log_dir / "timeline.log").write_text("\n".join(conductor.timeline) + "\n")
        fleet.stop()
        info = {
            "seed": settings.seed,
            "count": settings.count,
            "rolled_back": produced.rolled_back,
            "producer_failures": produced.failed,
            "kills": {"worker": conductor.done["kill_worker"], "relay": conductor.done["kill_relay"]},
            "cuts": {"postgres": conductor.done["cut_postgres"], "rabbitmq": conductor.done["cut_rabbitmq"]},
            "cut_ms": settings.cut_ms,
            "exits_on_their_own": len(conductor.exits),
            "drain_s": round(drained_s, 1),
            "duration_s": round(time.monotonic() - began, 1),
        }
        if nodes is not None:
            effect_times = _effect_times(conn, run.schema)
            # Kept beside the timeline, so a stall can be looked at again after the run.
            (run.log_dir / "effect_times.txt").write_text(
                "\n".join(f"{t - wall_started:.3f}" for t in sorted(effect_times)) + "\n"
            )
            info["cluster"] = {
                "queue_type": settings.queue_type,
                "spread": settings.spread,
                "nodes": [
                    f"{d.action} {d.node} at {d.down_at - wall_started:.1f}s, back at "
                    + (f"{d.back_at - wall_started:.1f}s" if d.back_at is not None else "never")
                    for d in nodes.disruptions
                ],
                "node_down_s": settings.node_down_ms / 1000,
                # The longest time without a completed job, before the first disruption and around each.
                "stall_s": stalls(effect_times, nodes.disruptions, ended),
            }
        if conductor.error is not None:
            raise AssertionError(f"the chaos conductor failed: {conductor.error!r}") from conductor.error
        # The caller's connection sat idle through the run, past RabbitMQ's heartbeat: renew it.
        rabbit.close()
        rabbit.connection = pika.BlockingConnection(
            [pika.URLParameters(url) for url in run.rabbitmq_urls] if run.cluster else pika.URLParameters(rabbit.url)
        )
        rabbit.channel = rabbit.connection.channel()
        ledger = collect(run, conn, rabbit, info)
    finally:
        # Each step on its own: a failure in one must never leave processes behind.
        if nodes is not None:
            nodes.halt()
            nodes.stop(timeout_s=60)
        for step in (conductor.stop if conductor else None, fleet.close, proxies.close, producer.close, watch.close):
            if step is not None:
                try:
                    step()
                except Exception:
                    logger.exception("chaos cleanup step %r failed", step)
    return ledger, fleet
