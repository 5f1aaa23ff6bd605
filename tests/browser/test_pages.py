"""What the person on call sees: the overview, the dead letters grouped and filtered, one letter,
the outbox and the schedules, in a real Chromium against the seeded schema."""

from __future__ import annotations

import re

import pytest
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.message import Message
from webseed import TRACE_ID
from webtools import number, row_ids

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips (or fails in CI) naming the install command
    expect = None

from dramatiq_reliable import PostgresDeadLetterStore
from dramatiq_reliable.testing import wait_for


@pytest.mark.parametrize("where", ["full", "jobs"], ids=["alone", "mounted-at-jobs"])
def test_the_overview_shows_the_seeded_numbers_refreshes_in_place_and_links_under_its_mount_point(
    site, page, where, rabbitmq_url, rabbit
):
    base = getattr(site, where)
    seeded = site.seeded
    # Two messages waiting in RabbitMQ, sent as a plain Dramatiq producer sends them.
    producer = RabbitmqBroker(url=rabbitmq_url, middleware=[])
    try:
        for order in (1, 2):
            producer.enqueue(Message(seeded.payments, "capture_payment", (order,), {}, {}))
    finally:
        producer.close()
    wait_for(lambda: rabbit.count(seeded.payments) == 2, message="the two messages did not reach RabbitMQ")
    page.clock.install()  # htmx's "every 5s" runs on this clock: the test moves it on instead of waiting
    page.goto(f"{base}/")
    expect(page.get_by_test_id("access-mode")).to_contain_text("full")
    expect(page.get_by_test_id("access-mode")).to_contain_text("alice")
    for queue, dead in seeded.dead_per_queue.items():
        row = page.locator(f'[data-testid="queue-row"][data-queue="{queue}"]')
        expect(row).to_have_count(1)
        assert number(row.get_by_test_id("dead-letters")) == dead, queue
    payments = page.locator(f'[data-testid="queue-row"][data-queue="{seeded.payments}"]')
    assert number(payments.get_by_test_id("depth")) == 2
    expect(payments.get_by_test_id("oldest-age")).to_have_count(1)
    for queue, backlog in seeded.outbox_backlog.items():
        row = page.locator(f'[data-testid="queue-row"][data-queue="{queue}"]')
        assert number(row.get_by_test_id("outbox-backlog")) == backlog, queue
        expect(row.get_by_test_id("outbox-oldest")).to_contain_text(re.compile(r"\d"))
    expect(page.get_by_test_id("problems")).to_have_count(0)

    # The data changes; the table follows without the page being loaded again.
    page.evaluate("window.notReloaded = true")
    store = PostgresDeadLetterStore(database=site.database, schema=seeded.schema)
    store.discard(ids=seeded.groups[seeded.fingerprint_of(seeded.payments)][1:2], by="browser-test")
    with page.expect_response(lambda response: "/fragments/overview" in response.url):
        page.clock.fast_forward(6000)
    expect(payments.get_by_test_id("dead-letters")).to_have_text(re.compile(r"^\s*3\b"))
    assert page.evaluate("window.notReloaded") is True, "the overview reloaded the page instead of swapping the table"

    # Every nav link stays under the mount point.
    for name, path in (
        ("outbox", "/outbox"),
        ("schedules", "/schedules"),
        ("dead-letters", "/dead-letters"),
        ("overview", "/"),
    ):
        page.get_by_test_id(f"nav-{name}").click()
        page.wait_for_url(f"{base}{path}")
        expect(page.get_by_test_id("access-mode")).to_contain_text("alice")


def test_dead_letters_are_grouped_by_fingerprint_and_the_list_filters_by_queue_and_fingerprint(site, page):
    seeded = site.seeded
    page.goto(f"{site.full}/dead-letters")
    groups = page.get_by_test_id("dl-group")
    expect(groups).to_have_count(3)
    counts = {
        group.get_attribute("data-fingerprint"): number(group.get_by_test_id("dl-group-count"))
        for group in groups.all()
    }
    assert counts == {fp: len(ids) for fp, ids in seeded.groups.items()}
    emails_fp = seeded.fingerprint_of(seeded.emails)
    email_group = page.locator(f'[data-testid="dl-group"][data-fingerprint="{emails_fp}"]')
    expect(email_group.get_by_test_id("dl-group-error")).to_contain_text("welcome_v2.html")
    expect(email_group.get_by_test_id("dl-group-newest")).not_to_be_empty()

    # The group's link opens the list filtered to it.
    email_group.get_by_test_id("dl-group-link").click()
    expect(page.get_by_test_id("dl-row")).to_have_count(2)
    assert sorted(row_ids(page)) == seeded.groups[emails_fp]

    # The filter form: by queue, then by fingerprint as well.
    page.goto(f"{site.full}/dead-letters/list")
    expect(page.get_by_test_id("dl-row")).to_have_count(7)
    form = page.get_by_test_id("dl-filter")
    form.locator('[name="queue"]').fill(seeded.payments)
    form.locator('[name="fingerprint"]').fill("")
    page.get_by_test_id("dl-filter-apply").click()
    expect(page.get_by_test_id("dl-row")).to_have_count(4)
    assert sorted(row_ids(page)) == seeded.groups[seeded.fingerprint_of(seeded.payments)]
    assert f"queue={seeded.payments}" in page.url

    form = page.get_by_test_id("dl-filter")
    form.locator('[name="queue"]').fill("")
    form.locator('[name="fingerprint"]').fill(seeded.fingerprint_of(seeded.reports))
    page.get_by_test_id("dl-filter-apply").click()
    expect(page.get_by_test_id("dl-row")).to_have_count(1)
    assert row_ids(page) == seeded.groups[seeded.fingerprint_of(seeded.reports)]


def test_one_letter_shows_its_error_traceback_attempts_classification_and_trace_id(site, page):
    seeded = site.seeded
    page.goto(f"{site.jobs}/dead-letters/list?queue={seeded.emails}")
    page.locator(f'[data-testid="dl-row"][data-id="{seeded.detail_id}"]').get_by_test_id("dl-link").click()
    page.wait_for_url(re.compile(rf"/jobs/dead-letters/{seeded.detail_id}$"))
    expect(page.get_by_test_id("dl-error")).to_contain_text("TemplateMissing")
    expect(page.get_by_test_id("dl-error")).to_contain_text("welcome_v2.html")
    traceback = page.get_by_test_id("dl-traceback")
    expect(traceback).to_contain_text("Traceback (most recent call last)")
    expect(traceback).to_contain_text("send_welcome_email")
    assert number(page.get_by_test_id("dl-attempts")) == 3
    expect(page.get_by_test_id("dl-classification")).to_contain_text("retries_exhausted")
    expect(page.get_by_test_id("dl-trace-id")).to_contain_text(TRACE_ID)
    expect(page.get_by_test_id("dl-args")).to_contain_text("7")
    expect(page.get_by_test_id("replay-one")).to_be_enabled()
    expect(page.get_by_test_id("discard-one")).to_be_enabled()

    # With hide_args=True the arguments (they may hold personal data) are not shown.
    page.goto(f"{site.private}/dead-letters/{seeded.detail_id}")
    expect(page.get_by_test_id("dl-args")).to_have_text(re.compile(r"^\s*hidden\s*$"))
    expect(page.get_by_test_id("dl-error")).to_contain_text("welcome_v2.html")
