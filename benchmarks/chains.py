"""Workflows benchmark: a chain of steps as a ``Workflow`` vs the same chain as Dramatiq's ``pipeline``.

    python benchmarks/chains.py [--steps 200] [--group 100] [--rounds 3]

On a ``PostgresBroker`` with ``Idempotency`` (transactional) and ``Workflows``, each case in a fresh
schema, the cases interleaved over ``--rounds`` (workflow, pipeline, workflow, pipeline ...):
  1. chain: ``--steps`` no-op steps, each handing its result to the next, from ``run()`` until the
     last step ran.  The baseline is ``dramatiq.pipeline`` of the same messages on the same broker
     (its ``Pipelines`` middleware sends the next message inside the job's transaction too, so the
     difference is the workflow's bookkeeping: a step row marked, a stage counter, a stage read).
     ``chain_ratio`` is (pipeline time) / (workflow time): 1.0 means the bookkeeping costs nothing.
  2. fan-in: one step, a ``Group`` of ``--group`` children, one join step; ``fan_in_s`` is its time
     (no Dramatiq baseline: a group's completion callback needs a result backend).
The last line printed is one JSON object (medians, with min and max of the ratio).  Schemas are dropped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.middleware import Callbacks
from psycopg import sql

from dramatiq_reliable import Group, Idempotency, PostgresBroker, Workflow, Workflows, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--group", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    return parser.parse_args(argv)


def case(kind: str, args: argparse.Namespace) -> float:
    """Run one case (``workflow``, ``pipeline`` or ``fan_in``) in a fresh schema; its seconds."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    migrate(DATABASE_URL, schema=schema)
    broker = PostgresBroker(database=DATABASE_URL, schema=schema, pool_max_size=args.threads + 4)
    broker.add_middleware(Idempotency(), before=Callbacks)
    broker.add_middleware(Workflows())
    done = threading.Event()

    @dramatiq.actor(queue_name="bench", broker=broker)
    def step(previous: Any = 0) -> int:
        return 1 + (previous if isinstance(previous, int) else 0)

    @dramatiq.actor(queue_name="bench", broker=broker)
    def last(previous: Any = None) -> None:
        done.set()

    if kind == "fan_in":
        steps: Any = [step.message(), Group([step.message() for _ in range(args.group)]), last.message()]
    else:
        steps = [step.message() for _ in range(args.steps - 1)] + [last.message()]
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=args.threads)
    worker.start()
    try:
        start = time.perf_counter()
        with broker.transaction():
            if kind == "pipeline":
                dramatiq.pipeline(steps, broker=broker).run()
            else:
                Workflow(steps, broker=broker).run()
        if not done.wait(timeout=600):
            raise RuntimeError(f"the {kind} case did not finish in 10 minutes")
        return time.perf_counter() - start
    finally:
        worker.stop()
        broker.close()
        with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    times: dict[str, list[float]] = {"workflow": [], "pipeline": [], "fan_in": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(case(kind, args))
            print(f"{kind}: {times[kind][-1]:.2f} s", flush=True)
    ratios = [p / w for p, w in zip(times["pipeline"], times["workflow"], strict=True)]
    print(
        json.dumps(
            {
                "steps": args.steps,
                "group": args.group,
                "rounds": args.rounds,
                "workflow_s": round(statistics.median(times["workflow"]), 3),
                "pipeline_s": round(statistics.median(times["pipeline"]), 3),
                "chain_ratio": round(statistics.median(ratios), 3),
                "chain_ratio_min": round(min(ratios), 3),
                "chain_ratio_max": round(max(ratios), 3),
                "fan_in_s": round(statistics.median(times["fan_in"]), 3),
                "load": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
