"""The web page's batches: the list, one batch's progress and children, and the job page's link to its batch.

The page reads through ``batch_status`` and the batch tables' readers, so these tests check what
the page adds: it shows what the library answers (on both brokers), puts what keeps a batch from
finishing (dead, then pending children) on top, links children to their job pages and a child's
job page back to its batch, refuses bad input with a 400 page and an unknown id with a 404 (never
a 500), escapes what it shows, and keeps the access rules of every other page.
"""

from __future__ import annotations

import contextlib
import html as html_module
import re
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.broker import MessageProxy
from psycopg import sql
from starlette.testclient import TestClient

from dramatiq_reliable import OutboxBroker, PostgresBroker
from dramatiq_reliable.web import Access, create_app
from dramatiq_reliable.workflows import Batch, Batches

pytestmark = pytest.mark.integration

LOOPBACK = ("127.0.0.1", 50000)
#: A batch id a person might choose: a "/" (why the id is in the query) and markup the page must escape.
ODD_ID = "invoices/<b>2026-11</b>"


def read_only(request: Any) -> Access:
    return Access("read", user="bob")


@pytest.fixture(params=["outbox", "postgres"])
def broker(
    request: pytest.FixtureRequest, database_url: str, db_schema: str
) -> Iterator[OutboxBroker | PostgresBroker]:
    made: OutboxBroker | PostgresBroker
    if request.param == "outbox":
        made = OutboxBroker(url=request.getfixturevalue("rabbitmq_url"), database=database_url, schema=db_schema)
        queue = str(request.getfixturevalue("queue_name"))
    else:
        made = PostgresBroker(database=database_url, schema=db_schema)
        queue = "web_batches"
    dramatiq.actor(lambda n: None, actor_name="invoice", queue_name=queue, broker=made)
    dramatiq.actor(lambda month: None, actor_name="report", queue_name=queue, broker=made)
    yield made
    made.close()


@pytest.fixture
def client_for() -> Iterator[Any]:
    with contextlib.ExitStack() as opened:

        def make(app: Any, client: tuple[str, int] = LOOPBACK) -> TestClient:
            return opened.enter_context(TestClient(app, client=client, base_url="http://localhost"))

        yield make


def cell(page: str, testid: str) -> str:
    """The text of the first element with ``data-testid=testid``."""
    match = re.search(rf'<(\w+)[^>]*data-testid="{re.escape(testid)}"[^>]*>(.*?)</\1>', page, re.S)
    assert match, f"no {testid!r} in the page"
    return " ".join(html_module.unescape(re.sub(r"<[^>]+>", "", match.group(2))).split())


def children_shown(page: str) -> list[tuple[str, str]]:
    """(message id, state) of each child row, in the page's order."""
    rows = re.findall(
        r'data-testid="batch-child" data-id="([^"]+)">.*?data-testid="batch-child-state">(\w+)<', page, re.S
    )
    return [(html_module.unescape(id), state) for id, state in rows]


def seed(broker: Any) -> tuple[Batch, list[Any]]:
    """A sealed batch of four children: one done, one dead, two pending; and a second batch left open."""
    invoice, report = broker.actors["invoice"], broker.actors["report"]
    batch = Batch(callback=report.message("2026-11"), broker=broker, id=ODD_ID)
    with broker.transaction(), batch:
        sent = [batch.add(invoice.message(n)) for n in range(4)]
    counter = Batches()
    assert counter._finish(broker, MessageProxy(sent[0]), dead=False, conn=None) == "counted"
    assert counter._finish(broker, MessageProxy(sent[1]), dead=True, conn=None) == "counted"
    with broker.transaction():
        Batch(callback=report.message("2026-12"), broker=broker, id="still-open").add(invoice.message(9))
    return batch, sent


def test_the_list_and_a_batch_page_show_its_progress_and_children_dead_then_pending_then_done(
    broker: Any, client_for: Any, db: psycopg.Connection[Any], db_schema: str
) -> None:
    _, sent = seed(broker)
    client = client_for(create_app(broker=broker))

    listing = client.get("/batches")
    assert listing.status_code == 200
    rows = re.findall(r'data-testid="batch-row" data-id="([^"]+)"', listing.text)
    assert [html_module.unescape(id) for id in rows] == ["still-open", ODD_ID], "newest first"
    assert "<b>2026-11</b>" not in listing.text, "the id must be escaped"
    assert re.findall(r'data-testid="batch-row-state">(\w+)<', listing.text) == ["open", "running"]
    only_open = client.get("/batches", params={"state": "open"}).text
    assert re.findall(r'data-testid="batch-row" data-id="([^"]+)"', only_open) == ["still-open"]
    assert "No failed batches" in client.get("/batches", params={"state": "failed"}).text

    page = client.get("/batches/show", params={"id": ODD_ID})
    assert page.status_code == 200
    assert cell(page.text, "batch-id") == ODD_ID and cell(page.text, "batch-state") == "running"
    assert "2 of 4 children finished: 1 done, 1 dead, 2 pending" in cell(page.text, "batch-progress")
    assert cell(page.text, "batch-callback") == "report"
    shown = children_shown(page.text)
    assert shown[:1] == [(sent[1].message_id, "dead")] and shown[-1] == (sent[0].message_id, "done")
    assert sorted(shown[1:3]) == sorted([(sent[2].message_id, "pending"), (sent[3].message_id, "pending")])
    assert f'/jobs/show?id={sent[2].message_id}"' in page.text, "each child links to its job page"
    dead_only = client.get("/batches/show", params={"id": ODD_ID, "state": "dead"}).text
    assert children_shown(dead_only) == [(sent[1].message_id, "dead")]

    # A pending child's job page links back to its batch (found through its waiting message).
    job = client.get("/jobs/show", params={"id": sent[2].message_id})
    assert job.status_code == 200
    assert cell(job.text, "job-batch") == f"batch {ODD_ID} (this job is one of its children, counted pending)"
    assert "/batches/show?id=invoices%2F%3Cb%3E2026-11%3C%2Fb%3E" in job.text
    # A job that is no batch's child has no batch line.
    plain = broker.actors["invoice"].send(7)
    assert 'data-testid="job-batch"' not in client.get("/jobs/show", params={"id": plain.message_id}).text
    # Nor has a job whose stored body another encoder wrote (not JSON): its page still draws.
    table = "queue" if isinstance(broker, PostgresBroker) else "outbox"
    db.execute(
        sql.SQL("INSERT INTO {} (message_id, queue_name, actor_name, body) VALUES (%s, %s, 'invoice', %s)").format(
            sql.Identifier(db_schema, table)
        ),
        ("pickled-1", broker.actors["invoice"].queue_name, b"\x80\x04\x95not json"),
    )
    pickled = client.get("/jobs/show", params={"id": "pickled-1"})
    assert pickled.status_code == 200 and 'data-testid="job-batch"' not in pickled.text


# What these two check does not depend on the broker: one is enough (the suite's time is shared).
@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_bad_input_gets_a_400_page_an_unknown_batch_a_404_never_a_500(broker: Any, client_for: Any) -> None:
    client = client_for(create_app(broker=broker))
    refused = client.get("/batches", params={"state": "exploded"})
    assert refused.status_code == 400 and "state must be one of open, running, succeeded, failed" in refused.text
    for params in ({}, {"id": "  "}, {"id": "x" * 201}, {"id": "a\x00b"}):
        assert client.get("/batches/show", params=params).status_code == 400, params
    missing = client.get("/batches/show", params={"id": "no-such-batch"})
    assert missing.status_code == 404 and "no batch 'no-such-batch'" in html_module.unescape(missing.text)
    seed(broker)
    bad_child = client.get("/batches/show", params={"id": ODD_ID, "state": "lost"})
    assert bad_child.status_code == 400 and "state must be one of pending, done, dead" in bad_child.text


@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_the_batch_pages_keep_the_access_rules_of_every_page(broker: Any, client_for: Any) -> None:
    seed(broker)
    # No hook: loopback only.
    outside = client_for(create_app(broker=broker), client=("10.1.2.3", 4000))
    for path in ("/batches", f"/batches/show?id={ODD_ID}"):
        assert outside.get(path).status_code == 403, path
    # A read-only user sees them (they are GET only, and offer no action).
    looking = client_for(create_app(broker=broker, access=read_only))
    page = looking.get("/batches/show", params={"id": ODD_ID})
    assert page.status_code == 200 and '<form method="post"' not in page.text
    assert looking.post("/batches/show", params={"id": ODD_ID}).status_code == 403
    # A Host the page does not answer to: 400 before anything is read.
    plain = client_for(create_app(broker=broker))
    assert plain.get("/batches", headers={"host": "evil.example"}).status_code == 400
