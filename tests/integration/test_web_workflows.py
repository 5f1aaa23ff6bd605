"""The web page's workflows: the list, one workflow's stages and steps, its cancel button, and the job page's link.

The page reads through ``list_workflows``/``workflow_status`` and cancels through
``cancel_workflow``, so these tests check what the page adds: it shows what the library answers,
marks a dead step that holds a ``wait`` workflow, cuts long results, links each step to its job
page and a step's job page back to its workflow, refuses bad input with a 400 page and an unknown
id with a 404 (never a 500), escapes what it shows, and puts cancel behind the rules of the job
cancel (full access, same site, a confirmation first).
"""

from __future__ import annotations

import contextlib
import html as html_module
import re
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.broker import MessageProxy
from starlette.testclient import TestClient

from dramatiq_reliable import OutboxBroker, PostgresBroker, events
from dramatiq_reliable.web import Access, WebAction, create_app
from dramatiq_reliable.workflows import Group, Workflow, Workflows, workflow_status

pytestmark = pytest.mark.integration

LOOPBACK = ("127.0.0.1", 50000)
#: A workflow id a person might choose: a "/" (why the id is in the query) and markup the page must escape.
ODD_ID = "orders/<b>7</b>"


def full(request: Any) -> Access:
    return Access("full", user="ann")


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
        queue = "web_workflows"
    for name in ("fetch", "price", "total"):
        dramatiq.actor(lambda *args: None, actor_name=name, queue_name=queue, broker=made)
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


def steps_shown(page: str) -> list[tuple[str, str]]:
    """(message id, state) of each step row, in the page's order."""
    return re.findall(
        r'data-testid="workflow-step" data-id="([^"]+)".*?data-testid="workflow-step-state">(\w+)<', page, re.S
    )


def flashes(page: str) -> list[str]:
    return [html_module.unescape(text) for text in re.findall(r'data-testid="flash"[^>]*>(.*?)</p>', page, re.S)]


def seed(broker: Any) -> tuple[Workflow, Workflow]:
    """A ``wait`` workflow held by a dead step (fetch done with a long result, one price dead, one
    sent, total waiting), and a newer plain two-step workflow whose first step is sent."""
    fetch, price, total = (broker.actors[name] for name in ("fetch", "price", "total"))
    held = Workflow(
        [fetch.message(7), Group([price.message(1), price.message(2)]), total.message()],
        if_step_dies="wait",
        broker=broker,
        id=ODD_ID,
    )
    with broker.transaction():
        held.run()
    workflows = Workflows()
    first = MessageProxy(held.stages[0][1][0])
    assert workflows.finish(broker, first, dead=False, result={"order": 7, "note": "x" * 500}, conn=None) == "advance"
    assert workflows.finish(broker, MessageProxy(held.stages[1][1][0]), dead=True, result=None, conn=None) == "waiting"
    plain = Workflow([fetch.message(1), total.message()], broker=broker, id="plain")
    with broker.transaction():
        plain.run()
    return held, plain


def test_the_list_and_a_workflow_page_show_its_steps_and_a_dead_step_waiting_for_replay(
    broker: Any, client_for: Any
) -> None:
    held, _ = seed(broker)
    client = client_for(create_app(broker=broker))

    listing = client.get("/workflows")
    assert listing.status_code == 200 and 'data-testid="nav-workflows"' in listing.text
    rows = re.findall(r'data-testid="workflow-row" data-id="([^"]+)"', listing.text)
    assert [html_module.unescape(id) for id in rows] == ["plain", ODD_ID], "newest first"
    assert "<b>7</b>" not in listing.text, "the id must be escaped"
    assert re.findall(r'data-testid="workflow-row-state">(\w+)<', listing.text) == ["running", "running"]
    assert "No cancelled workflows" in client.get("/workflows", params={"state": "cancelled"}).text

    page = client.get("/workflows/show", params={"id": ODD_ID})
    assert page.status_code == 200 and "<b>7</b>" not in page.text
    assert cell(page.text, "workflow-id") == ODD_ID and cell(page.text, "workflow-state") == "running"
    assert cell(page.text, "workflow-stage") == "2 of 3"
    assert cell(page.text, "workflow-policy").startswith("wait")
    assert "Waiting for a replay" in cell(page.text, "workflow-waiting")
    ids = [m.message_id for _, messages in held.stages for m in messages]
    assert steps_shown(page.text) == list(zip(ids, ["done", "dead", "sent", "waiting"], strict=True))
    assert page.text.count('data-testid="workflow-step-replay"') == 1, "the dead step is marked"
    results = [cell(part, "workflow-step-result") for part in page.text.split('data-testid="workflow-step"')[1:]]
    assert results[0].startswith('{"note": "xxx') and results[0].endswith("…") and len(results[0]) == 120
    assert results[1:] == ["-", "-", "-"]
    for id in ids:
        assert f'/jobs/show?id={id}"' in page.text, "each step links to its job page"
    # A result is made from the arguments: hide_args hides it too.
    hiding = client_for(create_app(broker=broker, hide_args=True)).get("/workflows/show", params={"id": ODD_ID}).text
    assert cell(hiding, "workflow-step-result") == "hidden" and "xxxxx" not in hiding

    # A step's job page links back to its workflow, saying where the step sits.
    job = client.get("/jobs/show", params={"id": ids[2]})
    assert job.status_code == 200
    assert cell(job.text, "job-workflow") == f"workflow {ODD_ID} (running): step 2 of stage 2 of 3, sent"
    assert "/workflows/show?id=orders%2F%3Cb%3E7%3C%2Fb%3E" in job.text
    plain_job = broker.actors["fetch"].send(9)
    assert 'data-testid="job-workflow"' not in client.get("/jobs/show", params={"id": plain_job.message_id}).text


# What these two check does not depend on the broker: one is enough (the suite's time is shared).
@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_a_workflow_is_cancelled_after_a_confirmation_under_the_job_cancel_rules(
    broker: Any, client_for: Any, db_schema: str
) -> None:
    seed(broker)
    # A read-only user sees no button, and their POST is refused; so is a client off the machine.
    looking = client_for(create_app(broker=broker, access=read_only))
    page = looking.get("/workflows/show", params={"id": "plain"}).text
    assert 'data-testid="workflow-cancel"' not in page and "ask for full access" in page
    assert looking.post("/workflows/cancel", data={"id": "plain", "confirm": "1"}).status_code == 403
    outside = client_for(create_app(broker=broker), client=("10.1.2.3", 4000))
    assert outside.get("/workflows").status_code == 403
    client = client_for(create_app(broker=broker, access=full))
    crossed = {"id": "plain", "confirm": "1"}
    assert client.post("/workflows/cancel", data=crossed, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.post("/workflows/cancel", data=crossed, headers={"Origin": "https://evil.example"}).status_code == 403
    assert workflow_status(broker.database, db_schema, "plain").state == "running", "nothing changed yet"

    assert 'data-testid="workflow-cancel"' in client.get("/workflows/show", params={"id": "plain"}).text
    confirm = client.post("/workflows/cancel", data={"id": "plain"})
    assert confirm.status_code == 200 and cell(confirm.text, "workflow-cancel-state") == "running"
    assert "1 step(s) of later stages are never sent, and 1 step(s) sent" in cell(
        confirm.text, "workflow-cancel-effect"
    )
    assert workflow_status(broker.database, db_schema, "plain").state == "running", "the confirmation changes nothing"
    received: list[events.Event] = []
    events.subscribe(received.append)
    try:
        done = client.post(
            "/workflows/cancel", data={"id": "plain", "confirm": "1", "reason": "wrong order"}, follow_redirects=False
        )
    finally:
        events.unsubscribe(received.append)
    assert done.status_code == 303 and done.headers["location"] == "/workflows/show?id=plain"
    after = client.get(done.headers["location"]).text
    assert [text for text in flashes(after) if "cancelled; 1 step(s) will never be sent, 1 sent step(s)" in text]
    assert cell(after, "workflow-state") == "cancelled"
    assert cell(after, "workflow-error") == "Cancelled by web:ann: wrong order"
    assert [state for _, state in steps_shown(after)] == ["cancelled", "cancelled"]
    assert 'data-testid="workflow-cancel"' not in after
    action = next(event for event in received if isinstance(event, WebAction))
    assert (action.action, action.who, action.selection, action.done) == (
        "workflow.cancel",
        "web:ann",
        "workflow plain",
        1,
    )
    again = client.post("/workflows/cancel", data={"id": "plain", "confirm": "1"})
    assert [text for text in flashes(again.text) if "already cancelled; nothing changed" in text]
    assert "nothing left to cancel" in client.post("/workflows/cancel", data={"id": "plain"}).text
    assert workflow_status(broker.database, db_schema, ODD_ID).state == "running", "only that workflow"


@pytest.mark.parametrize("broker", ["postgres"], indirect=True)
def test_bad_input_gets_a_400_page_an_unknown_workflow_a_404_never_a_500(broker: Any, client_for: Any) -> None:
    client = client_for(create_app(broker=broker, access=full))
    refused = client.get("/workflows", params={"state": "exploded"})
    assert refused.status_code == 400 and "state must be one of running, succeeded, failed, cancelled" in refused.text
    for params in ({}, {"id": "  "}, {"id": "x" * 201}, {"id": "a\x00b"}):
        assert client.get("/workflows/show", params=params).status_code == 400, params
        assert client.post("/workflows/cancel", data={**params, "confirm": "1"}).status_code == 400, params
    missing = client.get("/workflows/show", params={"id": "no-such-workflow"})
    assert missing.status_code == 404 and "no workflow 'no-such-workflow'" in html_module.unescape(missing.text)
    assert client.post("/workflows/cancel", data={"id": "no-such-workflow"}).status_code == 404
    unknown = client.post("/workflows/cancel", data={"id": "no-such-workflow", "confirm": "1"})
    assert unknown.status_code == 404 and "nothing was cancelled" in html_module.unescape(unknown.text)
    long_reason = client.post("/workflows/cancel", data={"id": "plain", "confirm": "1", "reason": "r" * 2001})
    assert long_reason.status_code == 400 and "reason must be at most 2000 characters" in long_reason.text
