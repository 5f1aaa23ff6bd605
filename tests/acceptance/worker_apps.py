"""Worker apps the acceptance tests run as subprocesses: settings in the environment, stopped by closing stdin.

Each app (``*_worker_app.py``) runs a Dramatiq worker until its stdin closes, so a test stops it
gracefully with :func:`stop_app` and kills it for real with ``process.kill()`` (SIGKILL).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import dramatiq

from dramatiq_reliable import (
    ClassifiedRetries,
    DeadLetters,
    Idempotency,
    OutboxBroker,
    PostgresBroker,
    WorkerRelay,
    build_middleware,
)


def start_app(app: Path, *, wait_started: bool = False, **settings: str) -> subprocess.Popen[str]:
    """Start ``app`` with ``settings`` added to this process's environment.

    ``wait_started``: return once its worker has started (it prints ``started``), so a test
    that needs every worker consuming before it sends does not depend on how fast each boots.
    """
    process = subprocess.Popen(
        [sys.executable, str(app)],
        env={**os.environ, **settings},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE if wait_started else subprocess.DEVNULL,
        text=True,
    )
    if wait_started:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], _START_TIMEOUT_S)
        line = process.stdout.readline() if ready else ""
        if line.strip() != "started":
            kill_app(process)
            raise AssertionError(f"{app.name} did not start within {_START_TIMEOUT_S} s (printed {line!r})")
    return process


_START_TIMEOUT_S = 60


def stop_app(process: subprocess.Popen[str]) -> None:
    """Close the app's stdin (its signal to stop) and wait; kill it if it is still there after 30 s."""
    if process.poll() is None and process.stdin is not None:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    _close_pipes(process)


def kill_app(process: subprocess.Popen[str]) -> None:
    """SIGKILL the app (a worker lost mid-job: no shutdown hook runs) and reap it; safe if it is gone."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)
    _close_pipes(process)


def _close_pipes(process: subprocess.Popen[str]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


def chaos_broker(marking: Any, *, lease_ms: int) -> Any:
    """The broker of a chaos worker app, from its environment (``BROKER``, ``DATABASE_URL``,
    ``SCHEMA``, ``THREADS``, ``RABBITMQ_URL``): Idempotency, DeadLetters and ``marking`` (Batches or
    Workflows, last: its after-hook runs first, inside the job's transaction) with many short
    retries, since a Postgres cut must cost a delay, never a dead job; set as Dramatiq's broker."""
    threads = int(os.environ.get("THREADS", "4"))
    middleware = build_middleware(
        middleware=[Idempotency(), DeadLetters(), marking],
        retries=ClassifiedRetries(max_retries=100, min_backoff=50, max_backoff=500),
    )
    database, schema = os.environ["DATABASE_URL"], os.environ["SCHEMA"]
    broker: Any
    if os.environ["BROKER"] == "postgres":
        broker = PostgresBroker(
            database=database, schema=schema, lease_ms=lease_ms, pool_max_size=threads + 4, middleware=middleware
        )
    else:
        broker = OutboxBroker(
            url=os.environ["RABBITMQ_URL"],
            database=database,
            schema=schema,
            pool_max_size=threads + 4,
            middleware=middleware,
        )
        broker.add_middleware(WorkerRelay(poll_interval_ms=100))
    dramatiq.set_broker(broker)
    return broker


def run_until_stdin_closes(broker: Any, *, threads: int = 2, prefetch: int | None = None) -> None:
    """The apps' main: a Dramatiq worker on ``broker`` until the test closes stdin (or kills us)."""
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    if prefetch is not None:
        worker.queue_prefetch = prefetch
    worker.start()
    print("started", flush=True)
    try:
        sys.stdin.read()
    finally:
        worker.stop()
        broker.close()


class Workers:
    """The processes of one worker app (chaos tests), each restartable, their stderr in one log per worker."""

    def __init__(self, app: Path, env: dict[str, str], log_dir: Path, count: int = 2) -> None:
        self.app = app
        self.env = env
        self.logs = [log_dir / f"worker-{i}.log" for i in range(count)]
        self.processes: list[subprocess.Popen[str] | None] = [None] * count
        self.restarts = 0

    def start(self, i: int) -> None:
        with self.logs[i].open("a") as log:
            self.processes[i] = subprocess.Popen(
                [sys.executable, str(self.app)],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )

    def kill(self, i: int) -> None:
        process = self.processes[i]
        if process is not None:
            kill_app(process)
        self.start(i)

    def keep_up(self) -> None:
        """Restart a worker that exited on its own (counted, not hidden)."""
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() is not None:
                self.restarts += 1
                if process.stdin is not None:
                    process.stdin.close()
                self.start(i)

    def stop(self) -> None:
        """Stop every worker gracefully, all at once (each finishes what it holds), and wait for each."""
        for process in self.processes:
            if process is not None and process.poll() is None and process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            if process is not None:
                stop_app(process)

    def close(self) -> None:
        for process in self.processes:
            if process is not None:
                kill_app(process)

    def tails(self, lines: int = 30) -> str:
        return "\n".join(
            f"== {log.name} ==\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in self.logs
            if log.exists()
        )
