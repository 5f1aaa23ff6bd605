"""The web page against a real Postgres: the pages show the library's numbers, and the actions do what the CLI does.

Each test has its own ``web_<random>`` schema with dead letters seeded through the
``DeadLetters`` middleware's own capture, dropped afterwards.  Requests come from a loopback
client address (Starlette's test client is ``testclient`` otherwise, which the default gate
refuses as remote) and name ``localhost`` in ``Host`` (not ``testserver``, which it refuses as a
name it does not answer to).
"""

from __future__ import annotations

import html as html_module
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from support import capture_dead_letter

from dramatiq_reliable import OutboxBroker, PostgresBroker, PostgresDeadLetterStore, events
from dramatiq_reliable.dead_letters import DeadLetter
from dramatiq_reliable.health import collect_health
from dramatiq_reliable.scheduler import Registry, Scheduler
from dramatiq_reliable.scheduler import schedule as declare
from dramatiq_reliable.web import Access, WebAction, create_app, create_wsgi_app

pytestmark = pytest.mark.integration

LOOPBACK = ("127.0.0.1", 50000)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def unmigrated_schema(database_url: str) -> Iterator[str]:
    """This module's schemas are ``web_<random>`` (overrides the suite's ``t_`` one); dropped after."""
    name = f"web_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def broker(rabbitmq_url: str, database_url: str, db_schema: str) -> Iterator[OutboxBroker]:
    outbox_broker = OutboxBroker(url=rabbitmq_url, database=database_url, schema=db_schema)
    dramatiq.set_broker(outbox_broker)
    yield outbox_broker
    outbox_broker.close()


def capture(
    broker: OutboxBroker | PostgresBroker,
    *,
    actor_name: str = "send_email",
    queue_name: str = "web_mail",
    error: BaseException | None = None,
    sent_days_ago: float = 0,
    args: tuple[Any, ...] = (42,),
    options: dict[str, Any] | None = None,
) -> DeadLetter:
    """One dead letter, stored as the middleware stores a message that failed for good."""
    return capture_dead_letter(
        broker,
        actor_name=actor_name,
        queue_name=queue_name,
        error=error,
        sent_days_ago=sent_days_ago,
        args=args,
        kwargs={"email": "ann@example.com"},
        options=options,
    )


def full(request: Any) -> Access:
    return Access("full", user="ann")


@pytest.fixture
def client_for(database_url: str, db_schema: str) -> Iterator[Any]:
    """``client_for(**create_app options)``: a test client on the test's schema, closed after."""
    clients: list[TestClient] = []

    def make(app: Any = None, *, client: tuple[str, int] = LOOPBACK, **options: Any) -> TestClient:
        options.setdefault("schema", db_schema)
        # Host: localhost, as a browser on this machine sends it (the hook-less page refuses others).
        test_client = TestClient(app or create_app(database_url, **options), client=client, base_url="http://localhost")
        test_client.__enter__()
        clients.append(test_client)
        return test_client

    yield make
    for item in clients:
        item.__exit__(None, None, None)


def states(db: psycopg.Connection[Any], db_schema: str) -> dict[int, str]:
    rows = db.execute(sql.SQL("SELECT id, state FROM {}.dead_letters").format(sql.Identifier(db_schema))).fetchall()
    return dict(rows)


def outbox_rows(db: psycopg.Connection[Any], db_schema: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}.outbox").format(sql.Identifier(db_schema))).fetchone()
    return int(row[0]) if row else 0


def cell(html: str, testid: str, *, within: str | None = None) -> str:
    """The text of the first element with ``data-testid=testid`` (inside the element ``within`` starts)."""
    if within is not None:
        html = html[html.index(within) :]
    match = re.search(rf'<(\w+)[^>]*data-testid="{re.escape(testid)}"[^>]*>(.*?)</\1>', html, re.S)
    assert match, f"no {testid!r} in the page"
    return html_module.unescape(re.sub(r"<[^>]+>", "", match.group(2))).strip()


def problems(html: str) -> str:
    """The text of the problems panel."""
    start = html.index('data-testid="problems"')
    return re.sub(r"<[^>]+>", " ", html[start : html.index("</div>", start)])


def ids_shown(html: str) -> set[int]:
    return {int(value) for value in re.findall(r'data-testid="dl-row" data-id="(\d+)"', html)}


def insert_outbox(
    db: psycopg.Connection[Any], db_schema: str, queue: str, *, attempts: int = 0, error: str | None = None
) -> int:
    row = db.execute(
        sql.SQL(
            "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body, attempts, last_error, created_at) "
            "VALUES (%s, %s, 'send_email', '\\x7b7d', %s, %s, now() - interval '5 minutes') RETURNING id"
        ).format(sql.Identifier(db_schema)),
        (str(uuid.uuid4()), queue, attempts, error),
    ).fetchone()
    assert row is not None
    return int(row[0])


# -- pages ---------------------------------------------------------------------------------------


def test_the_overview_shows_the_numbers_status_shows_and_refreshes_in_place(
    broker, client_for, db, db_schema, database_url
):
    for _ in range(3):
        capture(broker, queue_name="web_mail")
    capture(broker, queue_name="web_bill")
    insert_outbox(db, db_schema, "web_mail")
    insert_outbox(db, db_schema, "web_mail")
    client = client_for()
    page = client.get("/")
    assert page.status_code == 200
    expected = collect_health(database=database_url, schema=db_schema, discover_queues=True, retries_waiting=True)
    for item in expected.queues:
        row = f'data-testid="queue-row" data-queue="{item.queue}"'
        assert cell(page.text, "dead-letters", within=row) == str(item.dead_letters)
        assert cell(page.text, "outbox-backlog", within=row) == str(item.outbox_backlog)
        assert cell(page.text, "retries-waiting", within=row) == str(item.retries_waiting)
    assert cell(page.text, "dead-letters", within='data-queue="web_mail"') == "3"
    assert cell(page.text, "outbox-backlog", within='data-queue="web_mail"') == "2"
    assert cell(page.text, "outbox-oldest", within='data-queue="web_mail"') == "5m"
    assert cell(page.text, "depth", within='data-queue="web_mail"') == "-"  # no RabbitMQ given
    assert cell(page.text, "access-mode") == "read-only"
    fragment = client.get("/fragments/overview")
    assert fragment.status_code == 200 and "<header>" not in fragment.text
    assert 'hx-get="/fragments/overview" hx-trigger="every 5s" hx-swap="outerHTML"' in fragment.text
    assert 'data-testid="overview"' in fragment.text and 'data-queue="web_bill"' in fragment.text


def test_the_overview_reads_queue_depths_from_rabbitmq_when_given_and_says_when_it_cannot(
    broker, client_for, rabbitmq_url
):
    capture(broker, queue_name="web_mail")
    page = client_for(rabbitmq_url=rabbitmq_url).get("/")
    assert cell(page.text, "depth", within='data-queue="web_mail"') == "0"  # the queue does not exist: empty
    assert 'data-testid="problems"' not in page.text
    down = client_for(rabbitmq_url="amqp://guest:guest@127.0.0.1:1/%2F").get("/")
    assert down.status_code == 200
    assert "cannot reach RabbitMQ" in problems(down.text)


def test_dead_letters_are_grouped_by_fingerprint_with_counts_newest_and_a_link(broker, client_for):
    for _ in range(3):
        capture(broker, error=ValueError("card declined"))
    lone = capture(broker, error=KeyError("missing"), actor_name="bill")
    page = client_for().get("/dead-letters")
    assert page.status_code == 200
    groups = re.findall(r'data-testid="dl-group" data-fingerprint="(\w+)"', page.text)
    assert len(groups) == 2
    assert cell(page.text, "dl-group-count", within=f'data-fingerprint="{groups[0]}"') == "3"
    assert cell(page.text, "dl-group-count", within=f'data-fingerprint="{lone.fingerprint}"') == "1"
    assert "ValueError" in cell(page.text, "dl-group-error", within=f'data-fingerprint="{groups[0]}"')
    assert cell(page.text, "dl-group-newest").endswith("ago")
    assert f'href="/dead-letters/list?fingerprint={lone.fingerprint}"' in page.text
    assert cell(page.text, "dl-total") == "4"


def test_the_list_filters_by_queue_actor_fingerprint_and_state_and_pages(broker, client_for, database_url, db_schema):
    mail = [capture(broker, queue_name="web_mail") for _ in range(3)]
    bill = capture(broker, queue_name="web_bill", actor_name="bill", error=KeyError("x"))
    client = client_for(page_size=2)
    first = client.get("/dead-letters/list")
    assert first.status_code == 200 and len(ids_shown(first.text)) == 2 and 'data-testid="pager"' in first.text
    cursor = re.search(r'data-testid="pager-next" href="([^"]+)"', first.text)
    assert cursor
    second = client.get(cursor.group(1).replace("&amp;", "&"))
    assert len(ids_shown(second.text)) == 2 and not ids_shown(first.text) & ids_shown(second.text)
    assert ids_shown(client.get("/dead-letters/list?queue=web_bill").text) == {bill.id}
    assert ids_shown(client_for().get("/dead-letters/list?actor=send_email").text) == {item.id for item in mail}
    assert ids_shown(client_for().get(f"/dead-letters/list?fingerprint={bill.fingerprint}").text) == {bill.id}
    with PostgresDeadLetterStore(database=database_url, schema=db_schema) as store:
        store.discard(ids=[bill.id])
    assert bill.id not in ids_shown(client_for().get("/dead-letters/list").text)
    assert ids_shown(client_for().get("/dead-letters/list?state=discarded").text) == {bill.id}
    assert bill.id in ids_shown(client_for().get("/dead-letters/list?state=all").text)
    bad = client.get("/dead-letters/list?state=lost")
    assert bad.status_code == 400 and "state must be one of" in bad.text


def test_one_letter_shows_its_error_traceback_attempts_classification_trace_id_and_args(broker, client_for):
    item = capture(broker, options={"trace_context": {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}})
    page = client_for().get(f"/dead-letters/{item.id}")
    assert page.status_code == 200
    assert cell(page.text, "dl-error") == "ValueError: card declined"
    assert "raise error or ValueError" in cell(page.text, "dl-traceback")
    assert cell(page.text, "dl-attempts") == str(item.attempts)
    assert cell(page.text, "dl-classification").startswith(item.reason)
    assert cell(page.text, "dl-trace-id") == TRACE_ID
    assert "ann@example.com" in page.text and "42" in cell(page.text, "dl-args")
    assert client_for().get("/dead-letters/999999").status_code == 404


def test_hide_args_replaces_the_arguments_with_hidden(broker, client_for):
    item = capture(broker)
    page = client_for(hide_args=True).get(f"/dead-letters/{item.id}")
    assert cell(page.text, "dl-args") == "hidden"
    assert "ann@example.com" not in page.text


# -- actions -------------------------------------------------------------------------------------


def test_replaying_a_group_confirms_the_count_refuses_too_old_rows_then_replays(broker, client_for, db, db_schema):
    fresh = [capture(broker) for _ in range(2)]
    old = capture(broker, sent_days_ago=10)
    other = capture(broker, error=KeyError("x"))
    client = client_for(access=full)
    confirm = client.post("/dead-letters/replay", data={"fingerprint": old.fingerprint})
    assert confirm.status_code == 200
    assert cell(confirm.text, "confirm-count") == "3" and cell(confirm.text, "confirm-too-old") == "1"
    assert 'data-testid="confirm-force"' in confirm.text and 'name="confirm" value="1"' in confirm.text
    assert outbox_rows(db, db_schema) == 0  # the confirmation changed nothing
    done = client.post(
        "/dead-letters/replay", data={"fingerprint": old.fingerprint, "confirm": "1"}, follow_redirects=False
    )
    assert done.status_code == 303
    assert done.headers["location"] == f"/dead-letters/list?fingerprint={old.fingerprint}"
    assert states(db, db_schema) == {fresh[0].id: "replayed", fresh[1].id: "replayed", old.id: "dead", other.id: "dead"}
    assert outbox_rows(db, db_schema) == 2
    listed = client.get(done.headers["location"])
    flashes = re.findall(r'data-testid="flash"[^>]*>([^<]*)<', listed.text)
    assert flashes[0].startswith("replayed 2 dead letter(s)")
    assert "1 first sent more than 7.0d ago stayed dead" in flashes[1]
    assert ids_shown(listed.text) == {old.id}
    assert 'data-testid="flash"' not in client.get("/dead-letters").text  # shown once
    forced = client.post("/dead-letters/replay", data={"fingerprint": old.fingerprint, "confirm": "1", "force": "1"})
    assert forced.status_code == 200 and states(db, db_schema)[old.id] == "replayed"


def test_without_an_age_limit_nothing_is_refused_as_too_old(broker, client_for, db, db_schema):
    old = capture(broker, sent_days_ago=30)
    client = client_for(access=full, replay_max_age_ms=None)
    confirm = client.post("/dead-letters/replay", data={"id": str(old.id)})
    assert cell(confirm.text, "confirm-too-old") == "0" and "no replay age limit" in confirm.text
    client.post("/dead-letters/replay", data={"id": str(old.id), "confirm": "1"})
    assert states(db, db_schema) == {old.id: "replayed"}


def test_replaying_and_discarding_a_selection_and_one_letter(broker, client_for, db, db_schema, seen):
    rows = [capture(broker) for _ in range(4)]
    client = client_for(access=full)
    confirm = client.post("/dead-letters/replay", data={"id": [str(rows[0].id), str(rows[1].id)]})
    assert cell(confirm.text, "confirm-count") == "2"
    client.post("/dead-letters/replay", data={"id": [str(rows[0].id), str(rows[1].id)], "confirm": "1"})
    confirm = client.post("/dead-letters/discard", data={"id": str(rows[2].id)})
    assert cell(confirm.text, "confirm-count") == "1" and 'data-testid="confirm-too-old"' not in confirm.text
    assert f'href="/dead-letters/{rows[2].id}"' in confirm.text  # cancel goes back to the letter
    page = client.post(
        "/dead-letters/discard", data={"id": [str(rows[2].id), str(rows[0].id)], "reason": "test data", "confirm": "1"}
    )
    assert states(db, db_schema) == {
        rows[0].id: "replayed",
        rows[1].id: "replayed",
        rows[2].id: "discarded",
        rows[3].id: "dead",
    }
    flashes = re.findall(r'data-testid="flash"[^>]*>([^<]*)<', page.text)
    assert flashes[0] == "discarded 1 dead letter(s)"
    assert flashes[1] == f"1 not discarded (id {rows[0].id}): already replayed"
    note = db.execute(
        sql.SQL("SELECT note, handled_by FROM {}.dead_letters WHERE id = %s").format(sql.Identifier(db_schema)),
        (rows[2].id,),
    ).fetchone()
    assert note == ("test data", "web:ann")
    actions = [event for event in seen if isinstance(event, WebAction)]
    assert [(event.action, event.who, event.done, event.refused) for event in actions] == [
        ("dead_letters.replay", "web:ann", 2, 0),
        ("dead_letters.discard", "web:ann", 1, 1),
    ]
    assert actions[1].selection.startswith("2 ids (")
    nothing = client.post("/dead-letters/replay", data={"confirm": "1"})
    assert nothing.status_code == 400 and "select at least one dead letter" in nothing.text


def test_a_read_only_user_sees_disabled_buttons_and_gets_403_for_a_post(broker, client_for, db, db_schema):
    item = capture(broker)
    client = client_for(access=lambda request: Access("read", user="bob"))
    for path in ("/dead-letters", "/dead-letters/list", f"/dead-letters/{item.id}"):
        page = client.get(path)
        buttons = re.findall(r"<button[^>]*data-testid=\"(?:replay|discard)-[a-z]+\"[^>]*>", page.text)
        assert buttons, path
        assert all(" disabled" in button and "read-only access" in button for button in buttons), path
    assert cell(client.get("/").text, "access-mode") == "read-only · bob"
    refused = client.post("/dead-letters/replay", data={"id": str(item.id), "confirm": "1"})
    assert refused.status_code == 403 and states(db, db_schema) == {item.id: "dead"}
    full_page = client_for(access=full).get("/dead-letters")
    assert " disabled" not in re.search(r'<button[^>]*data-testid="replay-group"[^>]*>', full_page.text).group(0)  # type: ignore[union-attr]


def test_a_cross_site_post_changes_nothing(broker, client_for, db, db_schema):
    item = capture(broker)
    client = client_for(access=full)
    data = {"id": str(item.id), "confirm": "1"}
    assert client.post("/dead-letters/discard", data=data, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert (
        client.post("/dead-letters/discard", data=data, headers={"Origin": "https://evil.example"}).status_code == 403
    )
    assert states(db, db_schema) == {item.id: "dead"}
    same = client.post(
        "/dead-letters/discard", data=data, headers={"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"}
    )
    assert same.status_code == 200 and states(db, db_schema) == {item.id: "discarded"}


def test_by_default_only_loopback_clients_get_in(broker, client_for):
    capture(broker)
    assert client_for().get("/dead-letters").status_code == 200
    assert client_for(client=("10.1.2.3", 4000)).get("/dead-letters").status_code == 403
    assert client_for(client=("::1", 4000)).get("/dead-letters").status_code == 200


def test_a_query_over_the_statement_timeout_shows_a_panel_not_a_traceback(broker, client_for, database_url, db_schema):
    capture(broker)
    client = client_for(statement_timeout_ms=200)
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with psycopg.connect(database_url) as conn:
            conn.execute(
                sql.SQL("LOCK TABLE {}.dead_letters IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(db_schema))
            )
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert locked.wait(10)
        page = client.get("/dead-letters")
        assert page.status_code == 503
        assert 'data-kind="timeout"' in page.text and "statement timeout (200 ms)" in page.text
        overview = client.get("/")
        assert overview.status_code == 200 and "statement timeout" in problems(overview.text)
    finally:
        release.set()
        holder.join()
    assert client.get("/dead-letters").status_code == 200


def test_a_schema_without_tables_says_to_migrate(client_for):
    client = client_for(schema=f"web_{uuid.uuid4().hex[:12]}_never_created")
    page = client.get("/dead-letters")
    assert page.status_code == 503 and "dramatiq-reliable migrate" in page.text
    schedules = client.get("/schedules")
    assert schedules.status_code == 200 and 'data-testid="schedules-not-ready"' in schedules.text


def test_mounted_under_a_prefix_every_link_and_redirect_carries_it(broker, client_for, database_url, db_schema):
    item = capture(broker)
    host = Starlette(routes=[Mount("/jobs", app=create_app(database_url, schema=db_schema, access=full))])
    client = client_for(host)
    page = client.get("/jobs/dead-letters")
    assert page.status_code == 200
    links = re.findall(r'(?:href|action|src|hx-get)="([^"#]+)"', page.text)
    assert links and all(link.startswith("/jobs/") for link in links), links
    assert client.get("/jobs/static/web.css").status_code == 200
    done = client.post("/jobs/dead-letters/replay", data={"id": str(item.id), "confirm": "1"}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].startswith("/jobs/dead-letters/list")
    assert "Path=/jobs/" in done.headers["set-cookie"]


def test_the_wsgi_adapter_serves_the_page(broker, database_url, db_schema):
    from wsgiref.util import setup_testing_defaults

    capture(broker)
    app = create_wsgi_app(database_url, schema=db_schema)
    environ: dict[str, Any] = {"PATH_INFO": "/dead-letters", "REMOTE_ADDR": "127.0.0.1"}
    setup_testing_defaults(environ)
    started: list[str] = []
    try:
        body = b"".join(app(environ, lambda status, headers, exc_info=None: started.append(status)))
    finally:
        app.app.state.settings.close()
    assert started == ["200 OK"]
    assert b'data-testid="dl-group"' in body


@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/dead-letters/\xff", ""),  # a WSGI server hands PATH_INFO over percent-decoded, as latin-1
        ("/schedules/\xed\xa0\x80/pause", ""),  # a lone surrogate's bytes: not UTF-8
        ("/dead-letters/list", "queue=\xff"),  # a raw byte a client sent in the query
        ("/dead-letters/list", "cursor=%FF%FE"),
        ("/schedules/a\x00b/pause", ""),
    ],
    ids=["path-not-utf8", "path-surrogate-bytes", "query-raw-byte", "query-percent-junk", "path-nul"],
)
def test_the_wsgi_adapter_answers_hostile_paths_and_queries_with_a_page_not_a_500(
    broker, database_url, db_schema, path, query
):
    from wsgiref.util import setup_testing_defaults

    app = create_wsgi_app(database_url, schema=db_schema, access=full)
    environ: dict[str, Any] = {"PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": "POST"}
    environ["REMOTE_ADDR"] = "127.0.0.1"
    setup_testing_defaults(environ)
    if path.startswith("/dead-letters"):
        environ["REQUEST_METHOD"] = "GET"
    started: list[str] = []
    try:
        body = b"".join(app(environ, lambda status, headers, exc_info=None: started.append(status)))
    finally:
        app.app.state.settings.close()
    assert started and int(started[0][:3]) < 500, (started, body[:200])


# -- outbox and schedules ------------------------------------------------------------------------


def test_the_outbox_page_shows_backlog_and_poison_rows_and_retries_them(client_for, db, db_schema):
    insert_outbox(db, db_schema, "web_mail")
    poison = insert_outbox(db, db_schema, "web_mail", attempts=25, error="PRECONDITION_FAILED - message too large")
    client = client_for(access=full)
    page = client.get("/outbox")
    assert page.status_code == 200
    assert cell(page.text, "outbox-backlog", within='data-testid="outbox-row" data-queue="web_mail"') == "2"
    assert (
        cell(page.text, "outbox-last-error", within=f'data-id="{poison}"') == "PRECONDITION_FAILED - message too large"
    )
    done = client.post("/outbox/retry", follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == "/outbox"
    attempts = db.execute(
        sql.SQL("SELECT attempts FROM {}.outbox WHERE id = %s").format(sql.Identifier(db_schema)), (poison,)
    ).fetchone()
    assert attempts == (0,)
    assert "reset 1 failing row(s)" in cell(client.get("/outbox").text, "flash")


@pytest.fixture
def stored_schedules(database_url: str, db_schema: str) -> Iterator[None]:
    registry = Registry()
    declare("web-nightly", actor="sync", queue_name="web_q", cron="0 3 * * *", tz="Europe/Berlin", registry=registry)
    declare("web-often", actor="tick", queue_name="web_q", every_ms=60_000, registry=registry)
    scheduler = Scheduler(database=database_url, schema=db_schema, registry=registry)
    scheduler.sync()
    yield
    scheduler.close()


def test_schedules_show_their_state_and_pause_resume_trigger(stored_schedules, client_for, db, db_schema):
    client = client_for(access=full)
    page = client.get("/schedules")
    row = 'data-schedule="web-nightly"'
    assert cell(page.text, "schedule-state", within=row) == "active"
    assert cell(page.text, "schedule-next-run", within=row).startswith("in ")
    assert cell(page.text, "schedule-last-run", within=row) == "never"
    paused = client.post("/schedules/web-nightly/pause")
    assert cell(paused.text, "schedule-state", within=row) == "paused"
    assert "paused 'web-nightly'" in cell(paused.text, "flash")
    assert 'data-testid="schedule-resume"' in paused.text[paused.text.index(row) :]
    resumed = client.post("/schedules/web-nightly/resume")
    assert cell(resumed.text, "schedule-state", within=row) == "active"
    triggered = client.post("/schedules/web-often/trigger")
    assert "triggered 'web-often'" in cell(triggered.text, "flash")
    assert outbox_rows(db, db_schema) == 1
    assert cell(triggered.text, "schedule-last-run", within='data-schedule="web-often"').startswith("0.")
    missing = client.post("/schedules/nope/pause")
    assert "no schedule named 'nope'" in cell(missing.text, "flash")


def test_events_go_to_listeners(client_for, db, db_schema):
    insert_outbox(db, db_schema, "web_mail", attempts=3, error="boom")
    received: list[events.Event] = []
    events.subscribe(received.append)
    try:
        client_for(access=full).post("/outbox/retry")
    finally:
        events.unsubscribe(received.append)
    action = next(event for event in received if isinstance(event, WebAction))
    assert (action.action, action.who, action.done) == ("outbox.retry", "web:ann", 1)


def test_with_a_postgres_broker_replays_and_manual_runs_go_to_its_queue_table(
    database_url, db_schema, client_for, db, stored_schedules
):
    postgres_broker = PostgresBroker(database=database_url, schema=db_schema)
    try:
        item = capture(postgres_broker, queue_name="web_pg")
        client = client_for(create_app(broker=postgres_broker, access=full))
        done = client.post("/dead-letters/replay", data={"id": str(item.id), "confirm": "1"})
        assert "replayed 1 dead letter(s) to their Postgres queues" in cell(done.text, "flash")
        client.post("/schedules/web-often/trigger")
        queued = db.execute(
            sql.SQL("SELECT queue_name FROM {}.queue ORDER BY id").format(sql.Identifier(db_schema))
        ).fetchall()
        assert queued == [("web_pg",), ("web_q",)]
        assert outbox_rows(db, db_schema) == 0
        assert cell(client.get("/").text, "depth", within='data-queue="web_pg"') == "1"
    finally:
        postgres_broker.close()


def test_the_overview_runs_the_full_outbox_scans_once_per_interval_not_every_refresh(client_for, db, db_schema):
    insert_outbox(db, db_schema, "web_mail")
    client = client_for(scan_interval_ms=3_600_000)
    first = client.get("/fragments/overview")
    assert 'data-queue="web_mail"' in first.text and "counted by a full scan" in first.text
    # A queue only published rows name is found by the full scan alone.
    db.execute(
        sql.SQL(
            "INSERT INTO {}.outbox (message_id, queue_name, actor_name, body, published_at) "
            "VALUES ('m-late', 'web_late', 'a', '\\x7b7d', now())"
        ).format(sql.Identifier(db_schema))
    )
    insert_outbox(db, db_schema, "web_mail")
    cached = client.get("/fragments/overview")
    assert cell(cached.text, "outbox-backlog", within='data-queue="web_mail"') == "2"  # the backlog is live
    assert cell(cached.text, "retries-waiting", within='data-queue="web_mail"') == "0"  # from the scan
    assert 'data-queue="web_late"' not in cached.text
    assert 'data-queue="web_late"' in client_for(scan_interval_ms=0).get("/fragments/overview").text


# -- hostile input and hostile sites -------------------------------------------------------------

SECURITY_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def test_every_page_and_fragment_carries_the_security_headers(broker, client_for, stored_schedules):
    item = capture(broker)
    client = client_for(access=full)
    paths = ["/", "/fragments/overview", "/dead-letters", "/dead-letters/list", f"/dead-letters/{item.id}"]
    paths += ["/outbox", "/schedules", "/static/web.css", "/dead-letters/999999"]
    for path in paths:
        response = client.get(path)
        assert response.status_code in (200, 404), path
        for name, value in SECURITY_HEADERS.items():
            assert response.headers[name] == value, (path, name)
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"], path
    confirm = client.post("/dead-letters/replay", data={"id": str(item.id)})
    done = client.post("/schedules/web-often/pause", follow_redirects=False)
    for response in (confirm, done):
        assert response.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]


def test_a_rebound_host_cannot_read_a_dead_letters_arguments(broker, client_for, database_url, db_schema):
    item = capture(broker)
    client = client_for()  # no hook: loopback clients only, read-only
    assert "ann@example.com" in client.get(f"/dead-letters/{item.id}").text
    rebound = client.get(f"/dead-letters/{item.id}", headers={"Host": "evil.example:8080"})
    assert rebound.status_code == 400 and "ann@example.com" not in rebound.text
    assert "does not answer to Host 'evil.example'" in rebound.text
    named = client_for(allowed_hosts=["jobs.internal"])
    assert named.get(f"/dead-letters/{item.id}", headers={"Host": "jobs.internal:8080"}).status_code == 200
    host = Starlette(routes=[Mount("/jobs", app=create_app(database_url, schema=db_schema))])
    mounted = client_for(host)
    assert mounted.get(f"/jobs/dead-letters/{item.id}").status_code == 200
    assert mounted.get(f"/jobs/dead-letters/{item.id}", headers={"Host": "evil.example"}).status_code == 400


def test_a_nul_in_a_filter_or_an_overflowing_cursor_gets_a_readable_400_page(broker, client_for):
    capture(broker)
    client = client_for(access=full)
    nul = client.get("/dead-letters/list?queue=web%00mail")
    assert nul.status_code == 400 and 'data-testid="error-panel"' in nul.text
    assert "filter queue_name must be text Postgres can store" in cell(nul.text, "error-panel")
    for cursor in ("99999999999999999999.1", f"1700000000000000.{2**63}"):
        page = client.get(f"/dead-letters/list?cursor={cursor}")
        assert page.status_code == 400 and "pass next_cursor unchanged" in cell(page.text, "error-panel")
    posted = client.post("/dead-letters/discard", data={"actor": "send\x00email", "confirm": "1"})
    assert posted.status_code == 400 and "filter actor_name must be text" in cell(posted.text, "error-panel")


def test_a_schedule_name_with_a_nul_gets_a_readable_400_page_and_changes_nothing(stored_schedules, client_for, db):
    client = client_for(access=full)
    for verb in ("pause", "resume", "trigger"):
        page = client.post(f"/schedules/web-nightly%00/{verb}")
        assert page.status_code == 400, verb
        assert "schedule name must be text Postgres can store" in cell(page.text, "error-panel")
    listed = client.get("/schedules")
    assert cell(listed.text, "schedule-state", within='data-schedule="web-nightly"') == "active"
