"""The web page's jobs: the search box, the job page, the lists by state and the cancel button, on both brokers.

The page reads through ``show_job``/``list_jobs`` and cancels through ``cancel_job``, so these
tests check what the page adds: that it shows what the library answers, refuses bad input with a
400 page and unknown ids with a 404 page (never a 500), and puts cancel behind the rules replay
has (full access, same-site POST, confirmed).  Jobs are seeded by the library's own paths: a send,
the failure record ``ClassifiedRetries`` writes (``record_failure``), the dead-letter capture.
"""

from __future__ import annotations

import contextlib
import html as html_module
import re
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from psycopg import sql
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from support import capture_dead_letter

from dramatiq_reliable import OutboxBroker, PostgresBroker, events
from dramatiq_reliable.jobs.attempts import record_failure
from dramatiq_reliable.web import Access, WebAction, create_app

pytestmark = pytest.mark.integration

LOOPBACK = ("127.0.0.1", 50000)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def full(request: Any) -> Access:
    return Access("full", user="ann")


def read_only(request: Any) -> Access:
    return Access("read", user="bob")


@pytest.fixture(params=["outbox", "postgres"])
def broker(
    request: pytest.FixtureRequest, database_url: str, db_schema: str
) -> Iterator[OutboxBroker | PostgresBroker]:
    """Each test that takes it runs on both Postgres-backed brokers the page supports."""
    made: OutboxBroker | PostgresBroker
    if request.param == "outbox":
        made = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
    else:
        made = PostgresBroker(database=database_url, schema=db_schema)
    dramatiq.set_broker(made)
    yield made
    made.close()


@pytest.fixture
def client_for(database_url: str, db_schema: str) -> Iterator[Any]:
    """``client_for(app=None, **create_app options)``: a loopback test client naming ``localhost``, closed after."""
    with contextlib.ExitStack() as opened:

        def make(app: Any = None, **options: Any) -> TestClient:
            app = app or create_app(database_url, **{"schema": db_schema, **options})
            return opened.enter_context(TestClient(app, client=LOOPBACK, base_url="http://localhost"))

        yield make


@pytest.fixture
def client(broker: OutboxBroker | PostgresBroker, client_for: Any) -> TestClient:
    """A full-access client (user ``ann``) on the page built from ``broker``, as an app mounts it."""
    return client_for(create_app(broker=broker, access=full))  # type: ignore[no-any-return]


def send(broker: OutboxBroker | PostgresBroker, queue: str, *args: Any) -> Message[Any]:
    actor = broker.actors.get(f"{queue}_mail") or dramatiq.actor(
        lambda *_: None, actor_name=f"{queue}_mail", queue_name=queue, broker=broker
    )
    return actor.send(*args)


def smtp_down() -> None:
    raise ConnectionResetError("smtp.example.com reset the connection")


def fail(broker: OutboxBroker | PostgresBroker, message: Message[Any], *, attempt: int = 2) -> None:
    """The failure record ClassifiedRetries writes when attempt ``attempt`` (of at most 4) failed and is retried."""
    proxy = MessageProxy(message.copy(options={**message.options, "trace_context": {"traceparent": TRACEPARENT}}))
    decision = {
        "attempt": attempt,
        "max_retries": 3,
        "outcome": "retry",
        "reason": "transient",
        "error_type": "ConnectionResetError",
        "delay_ms": 600_000,
    }
    error: BaseException | None = None
    try:
        smtp_down()
    except ConnectionResetError as raised:  # raised, so it carries the traceback the record's "where" reads
        error = raised
    assert error is not None and record_failure(broker, proxy, error, decision)


def cell(page: str, testid: str) -> str:
    """The text of the first element with ``data-testid=testid``."""
    match = re.search(rf'<(\w+)[^>]*data-testid="{re.escape(testid)}"[^>]*>(.*?)</\1>', page, re.S)
    assert match, f"no {testid!r} in the page"
    return " ".join(html_module.unescape(re.sub(r"<[^>]+>", "", match.group(2))).split())


def flashes(page: str) -> list[str]:
    return [
        html_module.unescape(text).strip() for text in re.findall(r'data-testid="flash"[^>]*>(.*?)</p>', page, re.S)
    ]


def count(db: psycopg.Connection[Any], schema: str, table: str, message_id: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, table))
    row = db.execute(query, (message_id,)).fetchone()
    assert row is not None
    return int(row[0])


def table_of(broker: OutboxBroker | PostgresBroker) -> str:
    return "outbox" if isinstance(broker, OutboxBroker) else "queue"


# -- search and the job page ---------------------------------------------------------------------


def test_every_page_has_the_search_box_and_it_leads_to_the_job_page(broker, client, queue_name):
    message = send(broker, queue_name, 1)
    for path in ("/", "/dead-letters", "/outbox", "/schedules", "/jobs"):
        page = client.get(path)
        assert page.status_code == 200, path
        form = re.search(r'<form role="search" method="get" action="([^"]+)"[^>]*data-testid="job-search"', page.text)
        assert form and form.group(1) == "/jobs/show", path
    # What the form sends: the id as typed, whitespace of a paste included.
    found = client.get("/jobs/show", params={"id": f"  {message.message_id}\n"})
    assert found.status_code == 200
    assert cell(found.text, "job-message-id") == message.message_id
    assert cell(found.text, "job-state") == "waiting"


def test_a_retrying_job_shows_its_attempts_last_error_where_next_try_and_trace_id(broker, client, queue_name):
    message = send(broker, queue_name, 7)
    fail(broker, message, attempt=2)
    page = client.get("/jobs/show", params={"id": message.message_id}).text
    assert cell(page, "job-state") == "retrying"
    assert cell(page, "job-actor") == f"{queue_name}_mail" and cell(page, "job-queue") == queue_name
    assert cell(page, "job-attempts") == "2 failed of at most 4 (max retries 3)"
    assert cell(page, "job-error") == "ConnectionResetError: smtp.example.com reset the connection"
    assert re.fullmatch(r".*test_web_jobs\.py:\d+ in smtp_down", cell(page, "job-error-where"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(in \d+m.*\)", cell(page, "job-next-due"))
    assert cell(page, "job-trace-id") == TRACE_ID
    assert cell(page, "job-dead-letter") == "-"


def test_an_idempotency_key_finds_its_job_which_says_it_was_found_by_that_key(
    broker, client, queue_name, db, db_schema
):
    message = send(broker, queue_name, 3)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (actor_name, job_key, payload_hash, message_id, expires_at) "
            "VALUES (%s, 'invoice-42/2026?#', '\\x00', %s, now() + interval '1 hour')"
        ).format(sql.Identifier(db_schema, "processed_jobs")),
        (message.actor_name, message.message_id),
    )
    page = client.get("/jobs/show", params={"id": "invoice-42/2026?#"})
    assert page.status_code == 200
    assert cell(page.text, "job-message-id") == message.message_id
    assert cell(page.text, "job-searched") == "invoice-42/2026?#"
    assert cell(page.text, "job-state") == "done"
    assert 'data-testid="job-cancel"' not in page.text  # nothing left to cancel


def test_an_unknown_id_gets_a_404_page_with_the_search_box_to_try_again(broker, client):
    unknown = str(uuid.uuid4())
    page = client.get("/jobs/show", params={"id": unknown})
    assert page.status_code == 404
    assert "no job" in cell(page.text, "error-panel") and unknown in page.text
    again = re.search(
        r'<input type="search" name="id" value="([^"]*)"[^>]*data-testid="job-search-again-input"', page.text
    )
    assert again and again.group(1) == unknown


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("abc\x00def", "NUL"),
        ("k" * 1001, "at most 1000 characters"),
        ("é" * 501, "at most 1000 bytes"),
    ],
    ids=["empty", "blank", "nul", "long", "long-in-bytes"],
)
def test_a_bad_id_gets_a_400_page_saying_what_is_wrong_never_a_500(client_for, db_schema, given, says):
    client = client_for(access=full)
    page = client.get("/jobs/show", params={"id": given})
    assert page.status_code == 400 and says in cell(page.text, "error-panel")
    posted = client.post("/jobs/cancel", data={"id": given, "confirm": "1"})
    assert posted.status_code == 400 and says in cell(posted.text, "error-panel")
    assert client.get("/jobs/show").status_code == 400  # no id at all


def test_a_dead_job_links_its_dead_letter_and_hide_args_keeps_its_arguments_off_the_pages(
    broker, client_for, queue_name
):
    item = capture_dead_letter(broker, queue_name=queue_name, kwargs={"email": "ann@example.com"})
    for hide_args in (True, False):
        client = client_for(create_app(broker=broker, access=full, hide_args=hide_args))
        page = client.get("/jobs/show", params={"id": item.message_id}).text
        assert cell(page, "job-state") == "dead"
        assert "ann@example.com" not in page  # the job page never shows arguments
        link = re.search(r'data-testid="job-dead-letter"><a href="([^"]+)"', page)
        assert link and link.group(1) == f"/dead-letters/{item.id}"
        letter = client.get(link.group(1)).text
        assert ("ann@example.com" in letter) is not hide_args
        assert (cell(letter, "dl-args") == "hidden") is hide_args


# -- the list ------------------------------------------------------------------------------------


def test_the_list_shows_retrying_dead_and_waiting_jobs_with_links_and_filters(broker, client, queue_name):
    waiting = send(broker, queue_name, 1)
    retrying = send(broker, queue_name, 2)
    fail(broker, retrying)
    dead = capture_dead_letter(broker, queue_name=queue_name, actor_name="charge_card")

    def listed(**query: str) -> list[str]:
        page = client.get("/jobs", params=query)
        assert page.status_code == 200
        return re.findall(r'data-testid="job-row" data-id="([^"]+)"', page.text)

    assert listed() == [retrying.message_id]  # retrying is the default view
    assert listed(state="dead") == [dead.message_id]
    assert listed(state="dead", actor="charge_card", queue=queue_name) == [dead.message_id]
    assert listed(state="dead", actor="someone_else") == []
    assert waiting.message_id in listed(state="waiting")
    page = client.get("/jobs", params={"state": "retrying"}).text
    assert f'href="/jobs/show?id={retrying.message_id}"' in page
    for bad in ({"state": "running"}, {"actor": "a\x00b"}, {"queue": "q" * 300}):
        refused = client.get("/jobs", params=bad)
        assert refused.status_code == 400, bad
        assert "must be" in cell(refused.text, "error-panel")


# -- cancel --------------------------------------------------------------------------------------


def test_a_waiting_job_is_cancelled_after_a_confirmation_and_its_page_says_by_whom_and_when(
    broker, client, queue_name, db, db_schema
):
    message = send(broker, queue_name, 1)
    page = client.get("/jobs/show", params={"id": message.message_id}).text
    assert 'data-testid="job-cancel"' in page
    confirm = client.post("/jobs/cancel", data={"id": message.message_id})
    assert confirm.status_code == 200 and cell(confirm.text, "job-cancel-state") == "waiting"
    assert "deleted from the outbox or the Postgres queue table" in cell(confirm.text, "job-cancel-effect")
    assert count(db, db_schema, table_of(broker), message.message_id) == 1  # nothing changed yet
    received: list[events.Event] = []
    events.subscribe(received.append)
    try:
        done = client.post(
            "/jobs/cancel",
            data={"id": message.message_id, "confirm": "1", "reason": "sent twice"},
            follow_redirects=False,
        )
    finally:
        events.unsubscribe(received.append)
    assert done.status_code == 303 and done.headers["location"] == f"/jobs/show?id={message.message_id}"
    assert count(db, db_schema, table_of(broker), message.message_id) == 0
    after = client.get(done.headers["location"]).text
    where = "the outbox" if isinstance(broker, OutboxBroker) else "the Postgres queue"
    assert [text for text in flashes(after) if "cancelled by web:ann at" in text and where in text]
    assert cell(after, "job-state") == "cancelled"
    assert cell(after, "job-cancelled-by") == "web:ann"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", cell(after, "job-cancelled-at"))
    assert "sent twice" in cell(after, "job-cancelled")
    assert 'data-testid="job-cancel"' not in after
    action = next(event for event in received if isinstance(event, WebAction))
    assert (action.action, action.who, action.done, action.refused) == ("job.cancel", "web:ann", 1, 0)
    again = client.post("/jobs/cancel", data={"id": message.message_id, "confirm": "1"})
    assert [text for text in flashes(again.text) if "already cancelled by web:ann" in text]


def test_a_job_beyond_postgres_gets_a_tombstone(broker, client, queue_name, db, db_schema):
    message = send(broker, queue_name, 1)
    if isinstance(broker, OutboxBroker):
        # Published: RabbitMQ holds it (as the relay leaves the row).
        db.execute(
            sql.SQL("UPDATE {} SET published_at = now() WHERE message_id = %s").format(
                sql.Identifier(db_schema, "outbox")
            ),
            (message.message_id,),
        )
        state = "published, no news"
    else:
        # Held by a worker.
        db.execute(
            sql.SQL("UPDATE {} SET lease = 42, deliveries = 1 WHERE message_id = %s").format(
                sql.Identifier(db_schema, "queue")
            ),
            (message.message_id,),
        )
        state = "running"
    assert cell(client.get("/jobs/show", params={"id": message.message_id}).text, "job-state") == state
    assert "Cancellation middleware" in cell(
        client.post("/jobs/cancel", data={"id": message.message_id}).text, "job-cancel-effect"
    )
    after = client.post("/jobs/cancel", data={"id": message.message_id, "confirm": "1"})
    assert [text for text in flashes(after.text) if "skips it on delivery" in text]
    assert cell(after.text, "job-state") == "cancelled"
    assert count(db, db_schema, "job_cancellations", message.message_id) == 1


def test_cancelling_a_finished_job_says_so_and_changes_nothing(broker, client, queue_name, db, db_schema):
    item = capture_dead_letter(broker, queue_name=queue_name)
    page = client.get("/jobs/show", params={"id": item.message_id}).text
    assert 'data-testid="job-cancel"' not in page  # no button for a job that is over
    confirm = client.post("/jobs/cancel", data={"id": item.message_id})
    assert "nothing left to cancel" in cell(confirm.text, "job-cancel-effect")
    received: list[events.Event] = []
    events.subscribe(received.append)
    try:
        after = client.post("/jobs/cancel", data={"id": item.message_id, "confirm": "1"})
    finally:
        events.unsubscribe(received.append)
    assert after.status_code == 200
    assert [text for text in flashes(after.text) if "already finished (dead); nothing changed" in text]
    assert "flash flash-warn" in after.text
    assert cell(after.text, "job-state") == "dead"
    assert count(db, db_schema, "job_cancellations", item.message_id) == 0
    action = next(event for event in received if isinstance(event, WebAction))
    assert (action.done, action.refused) == (0, 1)


def test_cancelling_an_unknown_id_gets_a_404_and_writes_nothing(broker, client, db, db_schema):
    unknown = str(uuid.uuid4())
    assert client.post("/jobs/cancel", data={"id": unknown}).status_code == 404
    refused = client.post("/jobs/cancel", data={"id": unknown, "confirm": "1"})
    assert refused.status_code == 404 and "nothing was cancelled" in cell(refused.text, "error-panel")
    assert count(db, db_schema, "job_cancellations", unknown) == 0
    # Longer than a message id can be (though a valid search): refused by cancel_job, as a 400.
    long_id = "m" * 300
    assert client.post("/jobs/cancel", data={"id": long_id, "confirm": "1"}).status_code == 400


def test_a_read_only_user_sees_no_cancel_button_and_their_post_is_403_and_changes_nothing(
    broker, client_for, queue_name, db, db_schema
):
    message = send(broker, queue_name, 1)
    client = client_for(create_app(broker=broker, access=read_only))
    page = client.get("/jobs/show", params={"id": message.message_id}).text
    assert 'data-testid="job-cancel"' not in page and "job-cancel-form" not in page
    assert "ask for full access to cancel" in cell(page, "job-cancel-read-only")
    for data in ({"id": message.message_id}, {"id": message.message_id, "confirm": "1"}):
        refused = client.post("/jobs/cancel", data=data)
        assert refused.status_code == 403 and "read-only access" in refused.text
    assert count(db, db_schema, table_of(broker), message.message_id) == 1
    assert count(db, db_schema, "job_cancellations", message.message_id) == 0
    # The hook-less default (read-only, loopback) too.
    assert (
        client_for(create_app(broker=broker)).post("/jobs/cancel", data={"id": message.message_id}).status_code == 403
    )


def test_a_cross_site_cancel_is_refused(broker, client, queue_name, db, db_schema):
    message = send(broker, queue_name, 1)
    data = {"id": message.message_id, "confirm": "1"}
    assert client.post("/jobs/cancel", data=data, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.post("/jobs/cancel", data=data, headers={"Origin": "https://evil.example"}).status_code == 403
    assert count(db, db_schema, "job_cancellations", message.message_id) == 0
    same = client.post("/jobs/cancel", data=data, headers={"Sec-Fetch-Site": "same-origin"}, follow_redirects=False)
    assert same.status_code == 303 and count(db, db_schema, "job_cancellations", message.message_id) == 1


def test_mounted_under_a_prefix_the_search_the_list_and_the_cancel_redirect_carry_it(broker, client_for, queue_name):
    message = send(broker, queue_name, 1)
    client = client_for(Starlette(routes=[Mount("/ops", app=create_app(broker=broker, access=full))]))
    page = client.get("/ops/jobs", params={"state": "waiting"}).text
    links = re.findall(r'(?:href|action|src)="([^"#]+)"', page)
    assert links and all(link.startswith("/ops/") for link in links), links
    done = client.post("/ops/jobs/cancel", data={"id": message.message_id, "confirm": "1"}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/ops/jobs/show?id={message.message_id}"
    assert "Path=/ops/" in done.headers["set-cookie"]


def test_every_jobs_page_carries_the_security_headers(broker, client, queue_name):
    message = send(broker, queue_name, 1)
    for response in (
        client.get("/jobs"),
        client.get("/jobs/show", params={"id": message.message_id}),
        client.get("/jobs/show", params={"id": "nope"}),
        client.get("/jobs/show", params={"id": ""}),
        client.post("/jobs/cancel", data={"id": message.message_id}),
    ):
        assert "default-src 'none'" in response.headers["content-security-policy"]
        assert "<script>" not in response.text and " style=" not in response.text
