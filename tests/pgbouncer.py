"""A real PgBouncer in transaction mode in front of the test database, on a free loopback port.

Debian's ``pgbouncer`` package (``.ci/run`` installs it; without it the tests that need it are
skipped, or fail with ``CI=true``).  PgBouncer refuses to run as root, so
a root test run starts it as ``nobody`` with its files in a world-readable temporary folder;
``auth_type = trust`` with the test URL's user and password in the user list lets clients in as
that user and logs PgBouncer in to Postgres with the same credentials.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import IO
from urllib.parse import unquote, urlsplit

import psycopg
import pytest
from support import closed_port, proxied, server_address

__all__ = ["pgbouncer"]


def _binary() -> str:
    found = shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(path)), None
    )
    if found is None:
        # As the browser tests treat Chromium: skipped on a laptop, a failure in CI.
        reason = "pgbouncer is not installed; run 'apt-get install -y pgbouncer' (.ci/run does)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _quoted(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


@contextlib.contextmanager
def pgbouncer(
    database_url: str,
    *,
    pool_mode: str = "transaction",
    pool_size: int = 4,
    ports: range | None = None,
    max_client_conn: int = 50,
) -> Iterator[str]:
    """Run PgBouncer in ``pool_mode`` before ``database_url``'s server; yield the URL through it.

    On the first free port of ``ports`` (any free loopback port when None).  Stopped (and its
    folder removed) after, even when the test fails.
    """
    host, port = server_address(database_url)
    parts = urlsplit(database_url)
    user = unquote(parts.username or "postgres")
    password = unquote(parts.password or "")
    listen = closed_port() if ports is None else _free_port(ports)
    folder = tempfile.mkdtemp(prefix="pgbouncer-")
    os.chmod(folder, 0o755)
    config = os.path.join(folder, "pgbouncer.ini")
    users = os.path.join(folder, "userlist.txt")
    with open(users, "w", encoding="utf-8") as file:
        file.write(f"{_quoted(user)} {_quoted(password)}\n")
    with open(config, "w", encoding="utf-8") as file:
        file.write(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {users}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = {max_client_conn}\n"
            # psycopg and libpq send these; PgBouncer refuses unknown startup parameters otherwise.
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
    for path in (users, config):
        os.chmod(path, 0o644)
    command = [_binary(), config]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "nobody"]
    # Its log goes to a file this process opened (PgBouncer, as nobody, could not open one here):
    # a pipe nobody reads would fill and stall it.
    log = open(os.path.join(folder, "log"), "w+b")  # noqa: SIM115 - closed in the finally below
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    url = proxied(database_url, listen, connect_timeout="3")
    try:
        _wait_ready(process, url, listen, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _free_port(ports: range) -> int:
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(
        f"no free loopback port for pgbouncer in {ports.start}-{ports.stop - 1}; "
        "stop the pgbouncer a killed test run left there (ps -C pgbouncer)"
    )


def _wait_ready(process: subprocess.Popen[bytes], url: str, port: int, log: IO[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(
                f"pgbouncer exited with {process.returncode}: {log.read()[-2000:].decode(errors='replace')}"
            )
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SELECT 1")
            return
        time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not accept connections on port {port} within 15 s")
