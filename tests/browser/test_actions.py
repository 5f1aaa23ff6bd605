"""What the person on call does: replay and discard with a confirmation, schedules paused, resumed
and triggered, the outbox retried; and what a read-only user and another site cannot do.

Replays go through the outbox; a relay the test runs publishes them, and the test reads them
back from RabbitMQ: a replay counts only once its message has arrived.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg import sql
from support import Rabbit, running
from webseed import POISON_ERROR
from webtools import csp_violations, number, row_ids, serve_static, states

try:
    from playwright.sync_api import expect
except ImportError:  # the browser fixture skips (or fails in CI) naming the install command
    expect = None

from dramatiq_reliable import Relay
from dramatiq_reliable.scheduler.admin import pause_schedule
from dramatiq_reliable.testing import wait_for


def _group(page: Any, fingerprint: str) -> Any:
    return page.locator(f'[data-testid="dl-group"][data-fingerprint="{fingerprint}"]')


def _flash(page: Any, text: str | re.Pattern[str]) -> Any:
    """The one flash message containing ``text`` (an action may leave several)."""
    pattern = text if isinstance(text, re.Pattern) else re.compile(re.escape(text), re.IGNORECASE)
    found = page.get_by_test_id("flash").filter(has_text=pattern)
    expect(found).to_have_count(1)
    return found


def _arrived(rabbit: Rabbit, queue: str, count: int) -> list[dict[str, Any]]:
    """The bodies in ``queue`` once ``count`` have arrived (the relay declares the queue first)."""
    wait_for(lambda: rabbit.count(queue) >= count, timeout_ms=20_000, message=f"{count} messages in {queue}")
    return rabbit.take_all(queue, expect=count)


def _message_ids(db: psycopg.Connection[Any], schema: str, ids: list[int]) -> dict[str, int]:
    query = sql.SQL("SELECT message_id, id FROM {} WHERE id = ANY(%s)").format(sql.Identifier(schema, "dead_letters"))
    return {str(row[0]): int(row[1]) for row in db.execute(query, (ids,)).fetchall()}


def test_replaying_a_group_confirms_the_counts_then_the_rows_leave_and_the_messages_arrive(site, page, db, rabbit):
    seeded = site.seeded
    fingerprint = seeded.fingerprint_of(seeded.payments)
    group_ids = seeded.groups[fingerprint]
    fresh = [i for i in group_ids if i not in seeded.too_old]
    page.goto(f"{site.full}/dead-letters")
    _group(page, fingerprint).get_by_test_id("replay-group").click()

    # The confirmation says how many rows the replay touches and how many it refuses as too old;
    # nothing has changed yet.
    assert number(page.get_by_test_id("confirm-count")) == len(group_ids) == 4
    assert number(page.get_by_test_id("confirm-too-old")) == len(seeded.too_old) == 1
    expect(page.get_by_test_id("confirm-force")).to_be_visible()
    assert set(states(db, seeded.schema).values()) == {"dead"}
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.get_by_test_id("confirm").click()

    # Redirected (303) to the list, with a flash naming what was done; the replayed rows left it.
    assert posted.value.status == 303
    page.wait_for_url(re.compile(r"/dead-letters/list"))
    expect(_flash(page, "replayed")).to_contain_text("3")
    _flash(page, re.compile(r"\b1\b.*(too old|ago|refused)", re.IGNORECASE))
    page.goto(f"{site.full}/dead-letters/list?fingerprint={fingerprint}")
    expect(page.get_by_test_id("dl-row")).to_have_count(1)
    assert row_ids(page) == seeded.too_old
    now = states(db, seeded.schema)
    assert [now[i] for i in fresh] == ["replayed"] * 3 and now[seeded.too_old[0]] == "dead"

    # A relay publishes the replays from the outbox; each arrives in RabbitMQ with its message id.
    expected = _message_ids(db, seeded.schema, fresh)
    relay = Relay.from_broker(site.broker, poll_interval_ms=100)
    with running(relay.run, relay.stop):
        bodies = _arrived(rabbit, seeded.payments, len(expected) + seeded.outbox_backlog[seeded.payments])
    replays = {body["message_id"]: body for body in bodies if body["actor_name"] == "charge_card"}
    assert set(replays) == set(expected)
    for message_id, body in replays.items():
        assert body["options"]["replay_of"]["dead_letter_id"] == expected[message_id]
        assert "retries" not in body["options"]


def test_a_forced_replay_sends_the_too_old_letter_as_well(site, page, db, rabbit):
    seeded = site.seeded
    (old,) = seeded.too_old
    page.goto(f"{site.jobs}/dead-letters/{old}")
    page.get_by_test_id("replay-one").click()
    assert number(page.get_by_test_id("confirm-count")) == 1
    assert number(page.get_by_test_id("confirm-too-old")) == 1
    page.get_by_test_id("confirm-force").check()
    page.get_by_test_id("confirm").click()
    expect(_flash(page, "replayed")).to_contain_text("1")
    assert states(db, seeded.schema)[old] == "replayed"
    (message_id,) = _message_ids(db, seeded.schema, [old])
    relay = Relay.from_broker(site.broker, poll_interval_ms=100)
    with running(relay.run, relay.stop):
        bodies = _arrived(rabbit, seeded.payments, 1 + seeded.outbox_backlog[seeded.payments])
    assert [body["message_id"] for body in bodies if body["actor_name"] == "charge_card"] == [message_id]


def test_discarding_a_selection_touches_only_the_ticked_rows_and_cancel_touches_none(site, page, db, seen):
    seeded = site.seeded
    page.goto(f"{site.full}/dead-letters")
    _group(page, seeded.fingerprint_of(seeded.emails)).get_by_test_id("discard-group").click()
    assert number(page.get_by_test_id("confirm-count")) == 2
    page.get_by_test_id("cancel").click()
    page.wait_for_url(re.compile(r"/dead-letters"))
    assert set(states(db, seeded.schema).values()) == {"dead"}

    page.goto(f"{site.full}/dead-letters/list?queue={seeded.payments}")
    expect(page.get_by_test_id("dl-row")).to_have_count(4)
    ticked = row_ids(page)[:2]
    for dead_letter_id in ticked:
        page.locator(f'[data-testid="dl-row"][data-id="{dead_letter_id}"]').get_by_test_id("dl-select").check()
    page.get_by_test_id("discard-selected").click()
    assert number(page.get_by_test_id("confirm-count")) == 2
    assert set(states(db, seeded.schema).values()) == {"dead"}, "the confirmation page changed something"
    page.get_by_test_id("confirm").click()
    expect(_flash(page, "discarded")).to_contain_text("2")
    page.goto(f"{site.full}/dead-letters/list?queue={seeded.payments}")
    expect(page.get_by_test_id("dl-row")).to_have_count(2)
    assert not set(row_ids(page)) & set(ticked)
    now = states(db, seeded.schema)
    assert sorted(i for i, state in now.items() if state == "discarded") == sorted(ticked)
    # Who did it is on record: the access hook's user, in the event and on the rows.
    (event,) = [e for e in seen if e.name == "web.action"]
    assert (event.action, event.who, event.matched, event.done) == ("dead_letters.discard", "web:alice", 2, 2)
    handled = sql.SQL("SELECT DISTINCT handled_by FROM {} WHERE state = 'discarded'").format(
        sql.Identifier(seeded.schema, "dead_letters")
    )
    assert db.execute(handled).fetchall() == [("web:alice",)]


def test_a_read_only_user_sees_every_action_disabled_and_a_forced_post_gets_403(site, page, db):
    seeded = site.seeded
    page.goto(f"{site.read}/dead-letters")
    expect(page.get_by_test_id("access-mode")).to_contain_text("read-only")
    for testid in ("replay-group", "discard-group"):
        buttons = page.get_by_test_id(testid)
        expect(buttons).to_have_count(3)
        for button in buttons.all():
            expect(button).to_be_disabled()
            expect(button).to_have_attribute("title", re.compile(r"\w"))
    page.goto(f"{site.read}/dead-letters/list")
    for testid in ("replay-selected", "discard-selected"):
        expect(page.get_by_test_id(testid)).to_be_disabled()
    page.goto(f"{site.read}/schedules")
    for testid in ("schedule-pause", "schedule-trigger"):
        for button in page.get_by_test_id(testid).all():
            expect(button).to_be_disabled()
    page.goto(f"{site.read}/dead-letters/{seeded.detail_id}")
    for testid in ("replay-one", "discard-one"):
        expect(page.get_by_test_id(testid)).to_be_disabled()

    # Someone enables the button in the DOM and submits: the server refuses, nothing changes.
    button = page.get_by_test_id("discard-one")
    button.evaluate("b => b.removeAttribute('disabled')")
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        button.click()
    assert posted.value.status == 403
    # The same straight at the action with confirm=1 (no confirmation page in between).
    response = page.request.post(
        f"{site.read}/dead-letters/discard", form={"id": str(seeded.detail_id), "confirm": "1"}, max_redirects=0
    )
    assert response.status == 403
    assert set(states(db, seeded.schema).values()) == {"dead"}


def test_a_forbidden_user_gets_403_on_every_page_and_static_file(site, page):
    for path in ("/", "/dead-letters", f"/dead-letters/{site.seeded.detail_id}", "/outbox", "/schedules"):
        response = page.goto(f"{site.closed}{path}")
        assert response is not None and response.status == 403, path
    expect(page.get_by_test_id("dl-traceback")).to_have_count(0)
    assert page.request.get(f"{site.closed}/static/htmx.min.js").status == 403
    assert page.request.get(f"{site.read}/static/htmx.min.js").status == 200


def test_without_javascript_the_forms_still_confirm_and_discard(site, browser, db):
    seeded = site.seeded
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto(f"{site.full}/dead-letters")
        _group(page, seeded.fingerprint_of(seeded.reports)).get_by_test_id("discard-group").click()
        assert number(page.get_by_test_id("confirm-count")) == 1
        page.get_by_test_id("confirm").click()
        expect(_flash(page, "discarded")).to_contain_text("1")
    finally:
        context.close()
    (only,) = seeded.groups[seeded.fingerprint_of(seeded.reports)]
    assert states(db, seeded.schema)[only] == "discarded"


@pytest.mark.parametrize("other_host", ["localhost", "127.0.0.1"], ids=["cross-site", "same-site-other-port"])
def test_a_post_from_another_origin_is_refused(site, page, db, other_host):
    seeded = site.seeded
    fingerprint = seeded.fingerprint_of(seeded.payments)
    # Another site's page submits a form to the app; the browser itself says where it came from.
    attack = f"""<!doctype html><html><body>
      <form id="f" method="post" action="{site.full}/dead-letters/discard">
        <input name="fingerprint" value="{fingerprint}"><input name="confirm" value="1">
      </form>
      <script>document.getElementById("f").submit()</script>
    </body></html>"""
    with serve_static(attack) as port:
        with page.expect_response(lambda r: r.url.startswith(site.full) and r.request.method == "POST") as posted:
            page.goto(f"http://{other_host}:{port}/")
        response = posted.value
    sent = response.request.all_headers()
    assert sent.get("sec-fetch-site") == ("cross-site" if other_host == "localhost" else "same-site")
    assert response.status == 403
    assert re.search(r"site|origin", response.text(), re.IGNORECASE), response.text()
    assert set(states(db, seeded.schema).values()) == {"dead"}


def _schedule(db: psycopg.Connection[Any], schema: str, name: str) -> tuple[bool, int]:
    paused = db.execute(
        sql.SQL("SELECT paused FROM {} WHERE name = %s").format(sql.Identifier(schema, "schedules")), (name,)
    ).fetchone()
    ticks = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE schedule_name = %s").format(sql.Identifier(schema, "schedule_ticks")),
        (name,),
    ).fetchone()
    assert paused is not None and ticks is not None
    return bool(paused[0]), int(ticks[0])


def test_schedules_show_their_state_and_next_run_and_pause_resume_and_trigger_from_their_buttons(
    site, page, db, rabbit
):
    seeded = site.seeded
    page.goto(f"{site.jobs}/schedules")
    expect(page.get_by_test_id("schedule-row")).to_have_count(len(seeded.schedules))
    for name in seeded.schedules:
        listed = page.locator(f'[data-testid="schedule-row"][data-schedule="{name}"]')
        expect(listed.get_by_test_id("schedule-state")).to_have_text(re.compile(r"^\s*active\s*$"))
        expect(listed.get_by_test_id("schedule-next-run")).to_contain_text(re.compile(r"\d"))
        expect(listed.get_by_test_id("schedule-last-run")).to_have_text(re.compile(r"^\s*never\s*$"))

    def row() -> Any:
        return page.locator('[data-testid="schedule-row"][data-schedule="refresh-rates"]')

    row().get_by_test_id("schedule-pause").click()
    expect(row().get_by_test_id("schedule-state")).to_have_text(re.compile(r"^\s*paused\s*$"))
    assert _schedule(db, seeded.schema, "refresh-rates") == (True, 0)
    expect(row().get_by_test_id("schedule-resume")).to_be_enabled()
    row().get_by_test_id("schedule-resume").click()
    expect(row().get_by_test_id("schedule-state")).to_have_text(re.compile(r"^\s*active\s*$"))
    assert _schedule(db, seeded.schema, "refresh-rates") == (False, 0)

    nightly = page.locator('[data-testid="schedule-row"][data-schedule="nightly-report"]')
    nightly.get_by_test_id("schedule-trigger").click()
    expect(_flash(page, "nightly-report")).to_have_count(1)
    assert _schedule(db, seeded.schema, "nightly-report")[1] == 1
    expect(
        page.locator('[data-testid="schedule-row"][data-schedule="nightly-report"]').get_by_test_id("schedule-last-run")
    ).to_contain_text(re.compile(r"\d"))
    # The manual run is a real message: the relay publishes it to the schedule's queue.
    relay = Relay.from_broker(site.broker, poll_interval_ms=100)
    with running(relay.run, relay.stop):
        bodies = _arrived(rabbit, seeded.reports, 1)
    assert [body["actor_name"] for body in bodies] == ["build_report"]


def test_the_outbox_shows_the_backlog_and_the_poison_rows_last_error_and_retry_gives_it_a_fresh_start(site, page, db):
    seeded = site.seeded
    page.goto(f"{site.full}/outbox")
    for queue, backlog in seeded.outbox_backlog.items():
        row = page.locator(f'[data-testid="outbox-row"][data-queue="{queue}"]')
        expect(row).to_have_count(1)
        expect(row).to_contain_text(str(backlog))
    expect(page.get_by_test_id("outbox-poison-row")).to_have_count(1)
    poison = page.locator(f'[data-testid="outbox-poison-row"][data-id="{seeded.poison_id}"]')
    expect(poison.get_by_test_id("outbox-last-error")).to_have_text(POISON_ERROR)

    page.get_by_test_id("outbox-retry").click()
    expect(page.get_by_test_id("flash")).to_have_count(1)
    expect(page.get_by_test_id("flash")).to_contain_text("1")
    query = sql.SQL("SELECT attempts, available_at <= now() FROM {} WHERE id = %s").format(
        sql.Identifier(seeded.schema, "outbox")
    )
    assert db.execute(query, (seeded.poison_id,)).fetchone() == (0, True)


def test_another_site_cannot_show_the_page_in_a_frame_so_a_click_there_resumes_nothing(site, browser, db):
    seeded = site.seeded
    pause_schedule(site.database, "refresh-rates", schema=seeded.schema)
    # Another site frames the schedules page, to trick a click on Resume (clickjacking).
    attack = f"""<!doctype html><html><body>
      <iframe id="victim" src="{site.full}/schedules" width="1200" height="700"
              onload="document.title = 'frame loaded'"></iframe>
    </body></html>"""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    violations = csp_violations(context)
    try:
        # Where Resume is drawn, as the other site would measure it on its own copy of the page.
        measured = context.new_page()
        measured.set_viewport_size({"width": 1200, "height": 700})
        measured.goto(f"{site.full}/schedules")
        row = measured.locator('[data-testid="schedule-row"][data-schedule="refresh-rates"]')
        button = row.get_by_test_id("schedule-resume").bounding_box()
        measured.close()
        assert button is not None
        page = context.new_page()
        with serve_static(attack) as port:
            with page.expect_response(lambda r: r.url == f"{site.full}/schedules") as framed:
                page.goto(f"http://localhost:{port}/")
            page.wait_for_function("document.title === 'frame loaded'")
            victim = page.frame_locator("#victim")
            expect(victim.get_by_test_id("schedule-row")).to_have_count(0)
            frame = next(frame for frame in page.frames if frame != page.main_frame)
            assert not frame.url.startswith(site.full), frame.url
            # The click the visitor is tricked into, on the spot where Resume would be.
            where = page.locator("#victim").bounding_box()
            assert where is not None
            page.mouse.click(
                where["x"] + 2 + button["x"] + button["width"] / 2, where["y"] + 2 + button["y"] + button["height"] / 2
            )
        assert framed.value.status == 200  # served, but the browser did not show it
        assert "frame-ancestors 'none'" in framed.value.headers["content-security-policy"]
        assert framed.value.headers["x-frame-options"] == "DENY"
        wait_for(lambda: any("frame-ancestors" in text for text in violations), message="no frame-ancestors report")
    finally:
        context.close()
    assert _schedule(db, seeded.schema, "refresh-rates") == (True, 0)  # still paused
