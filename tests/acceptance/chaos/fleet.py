"""The worker and relay processes of a chaos run: start, SIGKILL, restart, stop.

Each member runs in its own session (process group), so a SIGKILL reaches the ``dramatiq``
CLI's parent and its forked worker at once, as ``kill -9`` of a container would, and nothing
outlives the test: ``Fleet.stop`` terminates every group it started, by its id.  A member that
exits on its own (a worker that started during a RabbitMQ cut exits 3) is restarted, as a
process manager would; those exits are counted, not hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

CHAOS_DIR = Path(__file__).resolve().parent
#: The module the workers run; importable once CHAOS_DIR's parent is on the path (``--path``).
APP_MODULE = f"{CHAOS_DIR.name}.app"


@dataclasses.dataclass
class Member:
    """One process the fleet owns; ``log`` collects its stdout and stderr across restarts."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    exits: list[int] = dataclasses.field(default_factory=list)
    _log: IO[bytes] | None = None

    def start(self) -> None:
        if self._log is None:
            self._log = self.log_path.open("ab")
        self._log.write(f"--- start {self.starts + 1} of {self.name} at {time.time():.3f}\n".encode())
        self._log.flush()
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exited_on_its_own(self) -> int | None:
        """The exit code if the process ended without the fleet ending it (then forgotten)."""
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        self.exits.append(code)
        self.process = None
        return code

    def kill(self, *, chaos: bool = True) -> None:
        """SIGKILL the whole process group, now (``chaos``: count it as one of the run's kills)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        self.kills += chaos

    def stop(self, timeout_s: float) -> None:
        """SIGTERM the group, and SIGKILL it if it is still there after ``timeout_s``."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        # The CLI's forked worker may outlive its parent by a moment: the group goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class Fleet:
    """Workers (``dramatiq chaos.app``) and relays (``python -m dramatiq_reliable relay``)."""

    def __init__(
        self,
        *,
        database_url: str,
        rabbitmq_urls: list[str],
        schema: str,
        queue: str,
        seed: int,
        workers: int,
        relays: int,
        threads: int,
        fail_rate: float,
        work_ms: int,
        log_dir: Path,
        spread: bool = True,
        queue_type: str = "classic",
    ) -> None:
        # The workers' sessions are told apart from everybody else's by this name.
        self.application_name = f"chaos-worker-{queue}"
        separator = "&" if "?" in database_url else "?"
        env = {
            **os.environ,
            "CHAOS_DATABASE_URL": f"{database_url}{separator}application_name={self.application_name}",
            "CHAOS_QUEUE_TYPE": queue_type,
            "CHAOS_SCHEMA": schema,
            "CHAOS_QUEUE": queue,
            "CHAOS_SEED": str(seed),
            "CHAOS_FAIL_RATE": str(fail_rate),
            "CHAOS_WORK_MS": str(work_ms),
            "CHAOS_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
        worker = [
            sys.executable,
            "-m",
            "dramatiq",
            APP_MODULE,
            "--path",
            str(CHAOS_DIR.parent),
            "--processes",
            "1",
            "--threads",
            str(threads),
            "--worker-shutdown-timeout",
            "5000",
        ]
        relay = [
            sys.executable,
            "-m",
            "dramatiq_reliable",
            "relay",
            "--schema",
            schema,
            "--database-url",
            database_url,
            "--batch-size",
            "100",
            "--poll-interval",
            "500ms",
            "--progress-interval",
            "0",
            *(["--queue-type", queue_type] if queue_type != "classic" else []),
        ]

        # Every member takes every node's URL; with ``spread`` member i starts at node i (mod the
        # nodes), so the workers and relays are spread over the cluster, not all on its first node.
        def urls(index: int) -> str:
            start = index % len(rabbitmq_urls) if spread else 0
            return ";".join(rabbitmq_urls[start:] + rabbitmq_urls[:start])

        self.workers = [
            Member(f"worker-{i}", worker, {**env, "CHAOS_RABBITMQ_URL": urls(i)}, log_dir / f"worker-{i}.log")
            for i in range(workers)
        ]
        self.relays = [
            Member(
                f"relay-{i}",
                [*relay, "--rabbitmq-url", urls(workers + i)],
                env,
                log_dir / f"relay-{i}.log",
            )
            for i in range(relays)
        ]

    @property
    def members(self) -> list[Member]:
        return [*self.workers, *self.relays]

    def member(self, name: str) -> Member:
        return next(member for member in self.members if member.name == name)

    def start(self) -> None:
        for member in self.members:
            member.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        for member in self.members:
            if member.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(member.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for member in self.members:
            member.stop(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        for member in self.members:
            member.kill(chaos=False)
            member.close()

    def logs(self, tail_lines: int = 40) -> str:
        """The last lines of every member's log, for a failure report."""
        chunks = []
        for member in self.members:
            with contextlib.suppress(OSError):
                lines = member.log_path.read_text(errors="replace").splitlines()
                chunks.append(f"== {member.name} ==\n" + "\n".join(lines[-tail_lines:]))
        return "\n".join(chunks)
