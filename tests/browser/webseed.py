"""The data the browser tests look at: dead letters in three groups, an outbox backlog with a
poison row, and two schedules, written into a schema of the test's own by the library's own
code paths (the dead-letter middleware's capture, the outbox broker, the scheduler's sync).

Times are set relative to now, so every run shows the same rows with the same ages: the
screenshots in ``docs/img`` come out the same each time they are regenerated.
"""

from __future__ import annotations

import dataclasses
import linecache
import time
import types
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from psycopg import sql

from dramatiq_reliable import OutboxBroker, classify
from dramatiq_reliable.dead_letters import DeadLetters, PostgresDeadLetterStore
from dramatiq_reliable.dead_letters.records import _PRIOR_ATTR, _RAN_ATTR
from dramatiq_reliable.jobs.attempts import record_failure
from dramatiq_reliable.retries import decision_record
from dramatiq_reliable.scheduler import Registry, Scheduler, schedule

DAY_MIN = 24 * 60

#: A W3C trace id the detail page must show for the ``emails`` letters.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
#: The error the relay recorded on the poison row.
POISON_ERROR = (
    'ChannelClosedByBroker: (406, "PRECONDITION_FAILED - message size 160000000 is larger than '
    'configured max size 134217728")'
)


# The failing actors, as an app would have them.  The fingerprint of a dead letter hashes the
# error type and the innermost frame of user code, so each group raises from a function of its
# own; the code is compiled as the module ``shop.tasks`` (and put in ``linecache``, so the
# tracebacks show its lines) to read on the pages like an app's, not a test's.
APP_FILE = "shop/tasks.py"
APP_SOURCE = """\
from dramatiq_reliable import Unrecoverable


class CardDeclined(Unrecoverable):
    \"\"\"The payment provider refused: permanent, so the job failed on its first attempt.\"\"\"


class TemplateMissing(KeyError):
    \"\"\"The e-mail template the job asked for does not exist (a bug, fixed by a deploy).\"\"\"


def charge_card(order_id):
    raise CardDeclined(f"card declined for order {order_id}: insufficient funds")


def send_welcome_email(user_id):
    template = load_template("welcome_v2.html")
    return template.format(user_id=user_id)


def load_template(name):
    raise TemplateMissing(name)


def build_report(day):
    raise TimeoutError(f"warehouse query for {day} took longer than 30 s")


def run(actor, arg):
    try:
        actor(arg)
    except Exception as error:
        return error
    raise AssertionError(f"{actor.__name__} was meant to fail")


def send_invoice(order_id):
    raise ConnectionResetError(f"smtp.example.com reset the connection sending the invoice of order {order_id}")
"""
linecache.cache[APP_FILE] = (len(APP_SOURCE), None, APP_SOURCE.splitlines(keepends=True), APP_FILE)
shop_tasks = types.ModuleType("shop.tasks")
shop_tasks.__file__ = APP_FILE
exec(compile(APP_SOURCE, APP_FILE, "exec"), shop_tasks.__dict__)


@dataclasses.dataclass(frozen=True)
class Seeded:
    """What :func:`seed` wrote, for the tests to look for on the pages."""

    schema: str
    payments: str
    emails: str
    reports: str
    #: fingerprint -> dead-letter ids (state ``dead``), biggest group first
    groups: dict[str, list[int]]
    #: queue -> the fingerprint of its one group
    fingerprints: dict[str, str]
    #: ids of the dead letters first sent longer ago than the replay limit (7 days)
    too_old: list[int]
    #: one letter with a trace id and a retry decision, for the detail page
    detail_id: int
    outbox_backlog: dict[str, int]
    poison_id: int
    schedules: tuple[str, ...]
    #: a job waiting in the outbox (the first payment captured), for the job page and its cancel
    waiting_id: str = ""
    #: a published job whose second attempt failed (``retrying``, attempt 2 of at most 6)
    retrying_id: str = ""

    @property
    def queues(self) -> tuple[str, str, str]:
        return (self.payments, self.emails, self.reports)

    @property
    def dead_per_queue(self) -> dict[str, int]:
        return {self.payments: 4, self.emails: 2, self.reports: 1}

    def fingerprint_of(self, queue: str) -> str:
        """The fingerprint of the group seeded on ``queue`` (one group per queue)."""
        return self.fingerprints[queue]


@dataclasses.dataclass
class _Writer:
    """Writes dead letters as the middleware writes them when a job fails for good."""

    broker: OutboxBroker
    db: psycopg.Connection[Any]
    schema: str

    def __post_init__(self) -> None:
        store = PostgresDeadLetterStore(database=self.broker.database, schema=self.schema)
        self.middleware = DeadLetters(store=store)

    def capture(
        self,
        *,
        queue: str,
        actor: str,
        fails: Any,
        arg: Any,
        sent_mins_ago: int,
        failed_mins_ago: int,
        attempts: int,
        options: dict[str, Any] | None = None,
    ) -> int:
        message: Message[Any] = Message(
            queue_name=queue,
            actor_name=actor,
            args=(arg,),
            kwargs={},
            options={"retries": attempts, **(options or {})},
            message_timestamp=int((time.time() - sent_mins_ago * 60) * 1000),
        )
        proxy = MessageProxy(message)
        # Raised and caught inside the app module, so the traceback holds its frames only.
        error = shop_tasks.run(fails, arg)
        # The decision ClassifiedRetries stores on the message before it lets the job die.
        decision = classify(error)
        outcome = "exhausted" if decision.retry else "fail"
        proxy.options["retry_decision"] = decision_record(decision, outcome, attempts, 4)
        proxy.stuff_exception(error)
        proxy.fail()
        # What the middleware's before-hook records on a real delivery: the actor ran, after
        # attempts - 1 retries.
        setattr(proxy, _RAN_ATTR, True)
        setattr(proxy, _PRIOR_ATTR, attempts - 1)
        stored = self.middleware.capture(self.broker, proxy)
        assert stored is not None, "the seed could not write a dead letter"
        # Fixed ages, so the pages read the same on every run.
        self.db.execute(
            sql.SQL(
                "UPDATE {} SET last_failed_at = now() - make_interval(mins => %s), "
                "first_failed_at = now() - make_interval(mins => %s) WHERE id = %s"
            ).format(sql.Identifier(self.schema, "dead_letters")),
            (failed_mins_ago, failed_mins_ago + 2 * (attempts - 1), stored.id),
        )
        return stored.id


def seed(broker: OutboxBroker, db: psycopg.Connection[Any], *, schema: str, base: str) -> Seeded:
    """Write the browser tests' data into ``schema`` (migrated); queue names start with ``base``."""
    payments, emails, reports = f"{base}_payments", f"{base}_emails", f"{base}_reports"
    writer = _Writer(broker, db, schema)

    # Payments: four declined cards (permanent: one attempt each); the first was sent ten days
    # ago, past the 7-day replay limit, so a replay refuses it unless forced.
    card = [
        writer.capture(
            queue=payments,
            actor="charge_card",
            fails=shop_tasks.charge_card,
            arg=1000 + n,
            sent_mins_ago=sent,
            failed_mins_ago=failed,
            attempts=1,
        )
        for n, (sent, failed) in enumerate(((10 * DAY_MIN, 10 * DAY_MIN - 1), (13, 12), (20, 19), (27, 26)))
    ]
    # E-mails: a missing template, with the trace context the Tracing middleware propagates.
    mail = [
        writer.capture(
            queue=emails,
            actor="send_welcome_email",
            fails=shop_tasks.send_welcome_email,
            arg=user,
            sent_mins_ago=failed + 10,
            failed_mins_ago=failed,
            attempts=3,
            options={"trace_context": {"traceparent": TRACEPARENT}},
        )
        for user, failed in ((7, 33), (8, 40))
    ]
    # Reports: one timeout after every retry the budget allowed.
    writer.capture(
        queue=reports,
        actor="build_report",
        fails=shop_tasks.build_report,
        arg="2026-12-01",
        sent_mins_ago=200,
        failed_mins_ago=47,
        attempts=5,
    )
    table = sql.Identifier(schema, "dead_letters")
    rows = db.execute(
        sql.SQL(
            "SELECT queue_name, fingerprint, array_agg(id ORDER BY id) FROM {} "
            "GROUP BY queue_name, fingerprint ORDER BY count(*) DESC"
        ).format(table)
    ).fetchall()
    groups = {str(fp): list(ids) for _, fp, ids in rows}
    fingerprints = {str(queue): str(fp) for queue, fp, _ in rows}
    assert [len(ids) for ids in groups.values()] == [4, 2, 1], f"the seed expected three groups, got {groups}"

    # The outbox: a backlog on payments and e-mails, and one poison row the relay gave up on.
    @dramatiq.actor(broker=broker, queue_name=payments, actor_name="capture_payment")
    def capture_payment(order_id: int) -> None:  # pragma: no cover - never runs
        pass

    @dramatiq.actor(broker=broker, queue_name=emails, actor_name="send_receipt")
    def send_receipt(order_id: int) -> None:  # pragma: no cover - never runs
        pass

    with broker.transaction():
        waiting = [capture_payment.send(order) for order in range(3)]
        send_receipt.send(1)
        poison = send_receipt.send(2)
    outbox = sql.Identifier(schema, "outbox")
    db.execute(
        sql.SQL("UPDATE {} SET created_at = now() - interval '9 minutes' WHERE published_at IS NULL").format(outbox)
    )
    poison_row = db.execute(
        sql.SQL(
            "UPDATE {} SET attempts = 10, last_error = %s, available_at = now() + interval '1 day' "
            "WHERE message_id = %s RETURNING id"
        ).format(outbox),
        (POISON_ERROR, poison.message_id),
    ).fetchone()
    assert poison_row is not None

    # A job the relay published whose second attempt failed: the failure record ClassifiedRetries
    # writes, its retry due in four minutes.
    @dramatiq.actor(broker=broker, queue_name=emails, actor_name="send_invoice")
    def send_invoice(order_id: int) -> None:  # pragma: no cover - never runs
        pass

    invoice = send_invoice.send_with_options(args=(1042,), trace_context={"traceparent": TRACEPARENT})
    db.execute(
        sql.SQL("UPDATE {} SET published_at = now() - interval '6 minutes' WHERE message_id = %s").format(outbox),
        (invoice.message_id,),
    )
    decision = {"attempt": 2, "max_retries": 5, "outcome": "retry", "reason": "transient", "delay_ms": 4 * 60_000}
    failed = shop_tasks.run(shop_tasks.send_invoice, 1042)
    assert record_failure(broker, MessageProxy(invoice), failed, decision), "the seed could not record a failure"

    # Schedules: a nightly cron job and a frequent interval one, both synced, neither fired yet.
    registry = Registry()
    schedule("nightly-report", actor="build_report", queue_name=reports, cron="0 3 * * *", registry=registry)
    schedule("refresh-rates", actor="refresh_rates", queue_name=payments, every_ms=15 * 60_000, registry=registry)
    scheduler = Scheduler(database=broker.database, schema=schema, registry=registry)
    scheduler.sync()
    scheduler.close()

    return Seeded(
        schema=schema,
        payments=payments,
        emails=emails,
        reports=reports,
        groups=groups,
        fingerprints=fingerprints,
        too_old=[card[0]],
        detail_id=mail[0],
        outbox_backlog={payments: 3, emails: 2},
        poison_id=int(poison_row[0]),
        schedules=("nightly-report", "refresh-rates"),
        waiting_id=waiting[0].message_id,
        retrying_id=invoice.message_id,
    )
