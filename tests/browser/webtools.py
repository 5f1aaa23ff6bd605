"""Small helpers the browser tests share: servers in threads, numbers read off a page, table states,
the Content-Security-Policy violations a browser reports."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from psycopg import sql

from dramatiq_reliable.testing import wait_for


def number(locator: Any) -> int:
    """The first whole number in ``locator``'s text (``"4 dead letters"`` -> 4)."""
    text = locator.inner_text()
    found = re.search(r"\d+", text.replace(",", ""))
    assert found, f"no number in {text!r}"
    return int(found.group())


def row_ids(page: Any) -> list[int]:
    """The ids of the dead-letter rows the list shows, top to bottom."""
    return [int(value) for value in page.get_by_test_id("dl-row").evaluate_all("rows => rows.map(r => r.dataset.id)")]


def states(db: psycopg.Connection[Any], schema: str) -> dict[int, str]:
    """Every dead letter's state, by id, read from the table."""
    query = sql.SQL("SELECT id, state FROM {}").format(sql.Identifier(schema, "dead_letters"))
    return {int(row[0]): str(row[1]) for row in db.execute(query).fetchall()}


def csp_violations(context: Any) -> list[str]:
    """The Content-Security-Policy violations the browser reports in ``context`` from now on
    (Chromium writes each one to the console: a blocked inline style, script, eval or frame)."""
    seen: list[str] = []

    def on_console(message: Any) -> None:
        if "Content Security Policy" in message.text:
            seen.append(message.text)

    context.on("console", on_console)
    return seen


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a thread on a free loopback port; yield its base URL.

    No lifespan: the app served is a :class:`~conftest.Switch`, and each test closes its apps."""
    import uvicorn

    sock = _free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", ws="none", http="h11", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout_ms=10_000, message="uvicorn did not start")
        if not server.started:
            raise RuntimeError(f"uvicorn did not start on port {port}; see the log above")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextlib.contextmanager
def serve_static(body: str) -> Iterator[int]:
    """A plain HTTP server answering every GET with the HTML ``body``: another origin (yields its port)."""
    payload = body.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
