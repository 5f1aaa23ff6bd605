"""A job by its id in a real Chromium: the search box, the job page, the list, and cancel (full access
only), against the seeded schema: a job retrying after its second attempt failed, one waiting in
the outbox."""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from webseed import TRACE_ID

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips (or fails in CI) naming the install command
    expect = None


def _search(page: Any, id: str) -> None:
    """Type ``id`` into the header's search box and send it, as a person does."""
    page.get_by_test_id("job-search-input").fill(id)
    page.get_by_test_id("job-search-input").press("Enter")


def _outbox_rows(db: psycopg.Connection[Any], schema: str, message_id: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, "outbox"))
    row = db.execute(query, (message_id,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("where", ["full", "jobs"], ids=["alone", "mounted-at-jobs"])
def test_searching_a_job_by_id_shows_its_state_attempts_and_last_error(site, page, where):
    base = getattr(site, where)
    retrying = site.seeded.retrying_id
    page.goto(f"{base}/dead-letters")
    _search(page, retrying)
    page.wait_for_url(re.compile(r"/jobs/show\?id="))
    expect(page.get_by_test_id("job-message-id")).to_have_text(retrying)
    expect(page.get_by_test_id("job-state")).to_have_text("retrying")
    expect(page.get_by_test_id("job-attempts")).to_have_text("2 failed of at most 6 (max retries 5)")
    expect(page.get_by_test_id("job-error")).to_contain_text("ConnectionResetError")
    expect(page.get_by_test_id("job-error")).to_contain_text("invoice of order 1042")
    expect(page.get_by_test_id("job-error-where")).to_contain_text("shop/tasks.py")
    expect(page.get_by_test_id("job-next-due")).to_contain_text("in ")
    expect(page.get_by_test_id("job-trace-id")).to_have_text(TRACE_ID)
    expect(page.get_by_test_id("job-cancel")).to_be_visible()


def test_the_jobs_list_links_each_job_to_its_page(site, page):
    page.goto(f"{site.jobs}/")
    page.get_by_test_id("nav-jobs").click()
    rows = page.get_by_test_id("job-row")
    expect(rows).to_have_count(1)
    rows.first.get_by_test_id("job-link").click()
    expect(page.get_by_test_id("job-message-id")).to_have_text(site.seeded.retrying_id)
    page.goto(f"{site.jobs}/jobs?state=waiting")
    expect(page.locator(f'[data-testid="job-row"][data-id="{site.seeded.waiting_id}"]')).to_have_count(1)


def test_an_unknown_id_shows_a_not_found_page_whose_search_box_finds_the_next_one(site, page):
    unknown = str(uuid.uuid4())
    page.goto(f"{site.jobs}/")
    with page.expect_response(re.compile(r"/jobs/show\?")) as answered:
        _search(page, unknown)
    assert answered.value.status == 404
    expect(page.get_by_test_id("error-panel")).to_contain_text("no job")
    again = page.get_by_test_id("job-search-again-input")
    expect(again).to_have_value(unknown)
    again.fill(site.seeded.waiting_id)
    page.get_by_test_id("job-search-again-go").click()
    expect(page.get_by_test_id("job-state")).to_have_text("waiting")


def test_cancelling_a_waiting_job_confirms_then_its_page_shows_who_cancelled_it(site, page, db):
    waiting = site.seeded.waiting_id
    page.goto(f"{site.jobs}/jobs/show?id={waiting}")
    expect(page.get_by_test_id("job-state")).to_have_text("waiting")
    page.get_by_test_id("job-cancel").click()

    # The confirmation says what cancelling does where the job is; nothing has changed yet.
    expect(page.get_by_test_id("job-cancel-effect")).to_contain_text("deleted from the outbox")
    assert _outbox_rows(db, site.seeded.schema, waiting) == 1
    page.get_by_test_id("job-cancel-reason").fill("customer asked twice")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.get_by_test_id("job-cancel-confirm").click()
    assert posted.value.status == 303

    page.wait_for_url(re.compile(r"/jobs/jobs/show\?id="))
    expect(page.get_by_test_id("flash")).to_contain_text("cancelled by web:alice")
    expect(page.get_by_test_id("job-state")).to_have_text("cancelled")
    expect(page.get_by_test_id("job-cancelled-by")).to_have_text("web:alice")
    expect(page.get_by_test_id("job-cancelled")).to_contain_text("customer asked twice")
    expect(page.get_by_test_id("job-cancel")).to_have_count(0)
    assert _outbox_rows(db, site.seeded.schema, waiting) == 0


def test_a_read_only_site_shows_the_job_but_no_cancel_button(site, page, db):
    waiting = site.seeded.waiting_id
    page.goto(f"{site.read}/jobs/show?id={waiting}")
    expect(page.get_by_test_id("job-state")).to_have_text("waiting")
    expect(page.get_by_test_id("job-cancel")).to_have_count(0)
    expect(page.get_by_test_id("job-cancel-read-only")).to_contain_text("ask for full access")
    # A POST crafted anyway (same-site, from the page itself) is refused by the gate.
    status = page.evaluate(
        """async ([url, id]) => {
            const body = new URLSearchParams({id: id, confirm: "1"});
            const response = await fetch(url, {method: "POST", body: body});
            return response.status;
        }""",
        [f"{site.read}/jobs/cancel", waiting],
    )
    assert status == 403
    assert _outbox_rows(db, site.seeded.schema, waiting) == 1
