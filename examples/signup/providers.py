"""The outside world of the demo: a mail provider and a payment API, as local HTTP servers.

Both run in this process on 127.0.0.1 (a free port each), so the demo needs no network and no
account anywhere.  They behave as real providers do on a bad day, on a schedule the demo sets:

* the mail provider answers the statuses queued with :meth:`FakeMailProvider.answer_next`
  (503, 429 with ``Retry-After``, ...), then 200; an address with no dot after the ``@`` gets a
  400, as a provider's validation would.  It honours an ``Idempotency-Key`` header: a repeat of
  a delivered key is answered 200 and not sent again.
* the payment API creates customers.  A repeat of an ``Idempotency-Key`` with the same data gets
  the first answer back (no second customer); the same key with other data is refused with 422.
  :meth:`FakePaymentApi.lose_next_answers` makes it create the customer and then answer 503, as
  a request whose response was lost on the way back looks to the client.

What they delivered is the demo's ground truth: the final ledger counts ``sent`` and
``customers`` here, not what the jobs believe they did.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server:
    """A threaded HTTP server on a free local port, answering POSTs with ``handle``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    body = None
                key = self.headers.get("Idempotency-Key")
                status, payload, headers = owner.handle(self.path, body, key)
                data = json.dumps(payload).encode()
                self.send_response(status)
                for header, value in headers.items():
                    self.send_header(header, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the demo tells the story itself."""

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"fake-{name}", daemon=True)

    def handle(self, path: str, body: Any, key: str | None) -> tuple[int, Any, dict[str, str]]:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeMailProvider(_Server):
    """``POST /send {"to": ..., "template": ...}``: answers on a schedule, then 200."""

    def __init__(self, *, retry_after_s: int = 2, on_answer: Callable[[str, int], None] | None = None) -> None:
        super().__init__("mail")
        self.retry_after_s = retry_after_s
        self.on_answer = on_answer
        self.sent: list[dict[str, Any]] = []
        self._delivered_keys: set[str] = set()
        self._schedule: deque[int] = deque()

    def answer_next(self, *statuses: int) -> None:
        """The next requests get these statuses, in order, whatever they ask for."""
        with self.lock:
            self._schedule.extend(statuses)

    def handle(self, path: str, body: Any, key: str | None) -> tuple[int, Any, dict[str, str]]:
        if path != "/send" or not isinstance(body, dict) or "to" not in body:
            return 404, {"error": "unknown endpoint"}, {}
        to = str(body["to"])
        with self.lock:
            status = self._schedule.popleft() if self._schedule else 200
            headers: dict[str, str] = {}
            if status == 200 and "." not in to.partition("@")[2]:
                status = 400
            if status == 200 and key is not None and key in self._delivered_keys:
                payload: Any = {"status": "already sent", "to": to}
            elif status == 200:
                if key is not None:
                    self._delivered_keys.add(key)
                self.sent.append(dict(body))
                payload = {"status": "sent", "to": to}
            elif status == 400:
                payload = {"error": f"invalid recipient address {to!r}"}
            else:
                if status == 429:
                    headers["Retry-After"] = str(self.retry_after_s)
                payload = {"error": HTTPStatus(status).phrase}
        if self.on_answer is not None:
            self.on_answer(to, status)
        return status, payload, headers


class FakePaymentApi(_Server):
    """``POST /v1/customers {"account_id": ..., "email": ...}`` with an ``Idempotency-Key``."""

    def __init__(self, *, on_answer: Callable[[str, int, bool], None] | None = None) -> None:
        super().__init__("payments")
        self.on_answer = on_answer
        self.customers: list[dict[str, Any]] = []
        self._answers: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._lose = 0

    def lose_next_answers(self, count: int) -> None:
        """The next ``count`` new customers are created, and their answer replaced by a 503."""
        with self.lock:
            self._lose += count

    def handle(self, path: str, body: Any, key: str | None) -> tuple[int, Any, dict[str, str]]:
        if path != "/v1/customers" or not isinstance(body, dict):
            return 404, {"error": "unknown endpoint"}, {}
        if not key:
            return 400, {"error": "an Idempotency-Key header is required"}, {}
        replay = False
        with self.lock:
            if key in self._answers:
                first_body, answer = self._answers[key]
                if first_body != body:
                    status, payload = 422, {"error": "idempotency key reused with other parameters"}
                else:
                    status, payload, replay = 200, answer, True
            else:
                customer = {"id": f"cus_{len(self.customers) + 1:04d}", **body}
                self.customers.append(customer)
                self._answers[key] = (body, customer)
                if self._lose:
                    self._lose -= 1
                    status, payload = 503, {"error": "upstream timeout"}
                else:
                    status, payload = 200, customer
        if self.on_answer is not None:
            self.on_answer(str(body.get("email")), status, replay)
        return status, payload, {}
