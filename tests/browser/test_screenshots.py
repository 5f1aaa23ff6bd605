"""The screenshots in the docs, taken from the pages the tests drive, at 1280x800.

``WEB_SCREENSHOTS=1 pytest tests/browser/test_screenshots.py`` writes them to ``docs/img``;
without it they go to the test's tmp dir, so a CI run leaves the tree clean and still checks
that every page renders at that size without a horizontal scroll bar.
"""

from __future__ import annotations

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips (or fails in CI) naming the install command
    expect = None


@pytest.fixture
def queue_base() -> str:
    """Readable queue names for the pictures.  Nothing in this test publishes to RabbitMQ, so no
    queue of these names is ever declared in the shared vhost."""
    return "shop"


def _fits(page) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 1280, f"{page.url} is {width}px wide: it scrolls sideways at 1280px"


def test_each_page_renders_at_1280x800_and_is_photographed_for_the_docs(site, page, shot):
    seeded = site.seeded
    base = site.jobs
    pages = [
        ("web-overview", "/", "queue-row"),
        ("web-dead-letters", "/dead-letters", "dl-group"),
        ("web-dead-letter", f"/dead-letters/{seeded.detail_id}", "dl-traceback"),
        ("web-outbox", "/outbox", "outbox-poison-row"),
        ("web-schedules", "/schedules", "schedule-row"),
        ("web-job", f"/jobs/show?id={seeded.retrying_id}", "job-state"),
    ]
    for name, path, testid in pages:
        page.goto(f"{base}{path}")
        expect(page.get_by_test_id(testid).first).to_be_visible()
        _fits(page)
        shot(page, name)

    # The confirmation of a group replay, with a row too old to replay unforced.
    page.goto(f"{base}/dead-letters")
    fingerprint = seeded.fingerprint_of(seeded.payments)
    page.locator(f'[data-testid="dl-group"][data-fingerprint="{fingerprint}"]').get_by_test_id("replay-group").click()
    expect(page.get_by_test_id("confirm-too-old")).to_be_visible()
    _fits(page)
    shot(page, "web-confirm")
