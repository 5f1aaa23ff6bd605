"""The web page's overview shows the numbers ``status`` shows on every kind of deployment, and its replays say where they went.

Each test has its own schema (the suite's ``db_schema``); queues that reach RabbitMQ are the
``queue_name`` fixture's, deleted afterwards.  Requests come from a loopback client address.
"""

from __future__ import annotations

import html as html_module
import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from support import capture_dead_letter, closed_port, send_many

from dramatiq_reliable import OutboxBroker
from dramatiq_reliable.testing import drain_outbox, wait_for
from dramatiq_reliable.web import Access, create_app

pytestmark = pytest.mark.integration

LOOPBACK = ("127.0.0.1", 50000)


def full(request: Any) -> Access:
    return Access("full", user="ann")


@pytest.fixture
def client_for() -> Iterator[Any]:
    """``client_for(app)``: a loopback test client, closed after the test."""
    clients: list[TestClient] = []

    def make(app: Any) -> TestClient:
        client = TestClient(app, client=LOOPBACK, base_url="http://localhost")
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def cell(page: str, testid: str, queue_name: str) -> str:
    """The text of the ``testid`` cell in ``queue_name``'s row of the overview."""
    row = page[page.index(f'data-queue="{queue_name}"') :]
    match = re.search(rf'<(\w+)[^>]*data-testid="{re.escape(testid)}"[^>]*>(.*?)</\1>', row, re.S)
    assert match, f"no {testid!r} in the row of {queue_name!r}"
    return html_module.unescape(re.sub(r"<[^>]+>", "", match.group(2))).strip()


def flash(page: str) -> str:
    return " ".join(
        html_module.unescape(re.sub(r"<[^>]+>", "", text))
        for text in re.findall(r'data-testid="flash"[^>]*>(.*?)</p>', page, re.S)
    )


# -- the overview ----------------------------------------------------------------------------------


def test_the_overview_shows_a_postgres_queues_depth_when_rabbitmq_answers(
    client_for, pg_broker, queue_name, database_url, db_schema, rabbitmq_url
):
    # Before: RabbitMQ's "no such queue" overwrote the Postgres depth with 0.
    send_many(pg_broker, queue_name, 2)
    page = client_for(create_app(database_url, schema=db_schema, target="queue", rabbitmq_url=rabbitmq_url)).get("/")
    assert page.status_code == 200
    assert cell(page.text, "depth", queue_name) == "2 = 2 pg + 0 mq"
    assert cell(page.text, "oldest-age", queue_name) not in ("", "-")
    assert 'data-testid="split-legend"' in page.text
    assert 'data-testid="problems"' not in page.text


def test_the_overview_of_a_queue_moving_to_rabbitmq_shows_the_sum_and_each_place(
    client_for, pg_broker, broker, queue_name, rabbit, rabbitmq_url, database_url, db_schema
):
    send_many(pg_broker, queue_name, 2)
    send_many(pg_broker, queue_name, 1, delay=600_000)
    send_many(broker, queue_name, 3)
    assert drain_outbox(broker) == 3
    wait_for(lambda: rabbit.count(queue_name) == 3, message="the relay's 3 messages in RabbitMQ")
    page = client_for(create_app(broker=broker)).get("/fragments/overview")
    assert cell(page.text, "depth", queue_name) == "5 = 2 pg + 3 mq"
    assert cell(page.text, "delayed", queue_name) == "1 = 1 pg + 0 mq"


@pytest.mark.parametrize("how", ["broker", "target"])
def test_a_postgres_broker_page_shows_no_rabbitmq_banner(
    client_for, pg_broker, queue_name, database_url, db_schema, how
):
    send_many(pg_broker, queue_name, 2)
    app = (
        create_app(broker=pg_broker) if how == "broker" else create_app(database_url, schema=db_schema, target="queue")
    )
    page = client_for(app).get("/")
    assert page.status_code == 200
    assert 'data-testid="problems"' not in page.text and "RabbitMQ" not in page.text.split("<table")[0]
    assert cell(page.text, "depth", queue_name) == "2"


def test_a_rabbitmq_given_to_the_page_and_down_is_said_and_the_postgres_part_still_shown(
    client_for, pg_broker, queue_name, database_url, db_schema
):
    send_many(pg_broker, queue_name, 2)
    down = f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F"
    page = client_for(create_app(database_url, schema=db_schema, target="queue", rabbitmq_url=down)).get("/")
    assert "cannot reach RabbitMQ" in page.text
    assert cell(page.text, "depth", queue_name) == "2 pg + ? mq"


# -- replays say where they went --------------------------------------------------------------------


def test_a_replay_onto_postgres_queues_says_so_on_the_confirmation_and_in_the_flash(client_for, pg_broker):
    item = capture_dead_letter(pg_broker, queue_name="web_pg")
    client = client_for(create_app(broker=pg_broker, access=full))
    confirm = client.post("/dead-letters/replay", data={"id": str(item.id)})
    assert "to the Postgres queues (PostgresBroker workers take them from the queue table)" in confirm.text
    assert "relay" not in confirm.text
    done = client.post("/dead-letters/replay", data={"id": str(item.id), "confirm": "1"})
    said = flash(done.text)
    assert (
        "replayed 1 dead letter(s) to their Postgres queues; PostgresBroker workers take them from the queue table"
        in said
    )
    assert "relay" not in said and "outbox" not in said


def test_a_replay_through_the_outbox_says_the_relay_publishes_it(client_for, broker: OutboxBroker):
    item = capture_dead_letter(broker, queue_name="web_mail")
    client = client_for(create_app(broker=broker, access=full))
    confirm = client.post("/dead-letters/replay", data={"id": str(item.id)})
    assert "through the outbox (the relay publishes them)" in confirm.text
    done = client.post("/dead-letters/replay", data={"id": str(item.id), "confirm": "1"})
    assert "replayed 1 dead letter(s) to their queues through the outbox; the relay publishes them" in flash(done.text)
