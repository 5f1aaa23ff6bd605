"""The signup story of "Background jobs done right", run for real: ``make demo``.

A user signs up; the account and three follow-up jobs (a welcome email, a payment customer, a
team-chat message) commit in one transaction.  Then everything the article warns about
happens, in order, and the run says what each part of dramatiq-reliable did about it: the
double click, a mail provider outage (503, then 429 with Retry-After), a payment API that loses
its answer, the relay stopped in the middle of a deploy, a 400 that fails fast into the dead
letters, a fix and a replay.  The closing ledger counts what the providers really received:
one effect per signup.

    python examples/signup [--broker auto|rabbitmq|postgres] [--mail-outage 503,429] [--keep] [-v]

Uses DATABASE_URL and RABBITMQ_URL.  Without DATABASE_URL it uses the local Postgres at
127.0.0.1:5432 if one answers, else starts an embedded one (data in .dramatiq-reliable/postgres).
Without RABBITMQ_URL and no RabbitMQ at the default URL it runs on PostgresBroker (no relay).  Everything it creates is
its own: a Postgres schema named ``signup_demo_<random>`` and queues named the same way,
dropped and deleted at the end (``--keep`` keeps the schema to look around).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import secrets
import sys
import time

import dramatiq
import psycopg
from app import SignupApp
from broker import answers, make_transport
from dramatiq.middleware import AgeLimit, ShutdownNotifications, TimeLimit
from providers import FakeMailProvider, FakePaymentApi
from psycopg import sql
from story import Narrator, Story

from dramatiq_reliable import ClassifiedRetries, DeadLetters, Idempotency, build_middleware, events
from dramatiq_reliable.cli import main as cli

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def _statuses(text: str) -> list[int]:
    try:
        statuses = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of HTTP statuses, e.g. 503,429") from None
    if any(not 200 <= status <= 599 for status in statuses):
        raise argparse.ArgumentTypeError(f"{text!r}: statuses are between 200 and 599")
    return statuses


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mail-outage",
        type=_statuses,
        default=[503, 429],
        metavar="STATUSES",
        help="what the mail provider answers Grace before it recovers (default: 503,429)",
    )
    parser.add_argument(
        "--retry-after",
        type=int,
        default=2,
        metavar="SECONDS",
        help="the Retry-After of the provider's 429 (default: 2)",
    )
    parser.add_argument(
        "--broker",
        choices=("auto", "rabbitmq", "postgres"),
        default="auto",
        help="OutboxBroker on RabbitMQ, or PostgresBroker; auto: RabbitMQ if RABBITMQ_URL is set or one "
        "answers at the default URL (default: auto)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the demo's schema at the end, to look around")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the package's and Dramatiq's logs too")
    return parser.parse_args(argv)


def run_cli(story: Story, *argv: str) -> int:
    """Run a ``dramatiq-reliable`` command in this process and show its output in the story."""
    story.say("you", "$ dramatiq-reliable " + " ".join(argv[:-4]))  # the --schema/--database-url tail unsaid
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(list(argv))
    story.block(out.getvalue())
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="   %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # The story says in words what these log (and Dramatiq's failure logs carry tracebacks).
        for name in ("dramatiq", "dramatiq_reliable.events", "pika"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    with contextlib.ExitStack() as servers:
        database_url, postgres_line = choose_postgres(servers)
        rabbitmq_url = choose_rabbitmq(args.broker)
        return run(args, database_url, rabbitmq_url, postgres_line)


def choose_postgres(servers: contextlib.ExitStack) -> tuple[str, str]:
    """DATABASE_URL if set; else the local server if it answers; else an embedded one, stopped at exit."""
    if "DATABASE_URL" in os.environ:
        return os.environ["DATABASE_URL"], "Postgres from DATABASE_URL"
    if answers("127.0.0.1", 5432):
        return DATABASE_URL, "DATABASE_URL unset: using the local Postgres answering at 127.0.0.1:5432"
    from dramatiq_reliable.embedded import EmbeddedPostgres

    print("DATABASE_URL unset and no Postgres at 127.0.0.1:5432: starting an embedded one ...", flush=True)
    url = servers.enter_context(EmbeddedPostgres())
    return url, "DATABASE_URL unset: using an embedded Postgres (data in .dramatiq-reliable/postgres)"


def choose_rabbitmq(choice: str) -> str | None:
    """The RabbitMQ URL for an OutboxBroker, or None for a PostgresBroker."""
    url = os.environ.get("RABBITMQ_URL", RABBITMQ_URL)
    if choice == "postgres":
        return None
    if choice == "rabbitmq" or "RABBITMQ_URL" in os.environ:
        return url
    return url if answers("127.0.0.1", 5672) else None


def run(args: argparse.Namespace, database_url: str, rabbitmq_url: str | None, postgres_line: str) -> int:
    run_id = secrets.token_hex(3)
    schema = f"signup_demo_{run_id}"
    story = Story()
    started = time.monotonic()

    mail = FakeMailProvider(
        retry_after_s=args.retry_after,
        on_answer=lambda to, status: story.say(
            "mail provider", f"{status} for {to}" + (": welcome email delivered" if status == 200 else "")
        ),
    )
    payments = FakePaymentApi(
        on_answer=lambda email, status, replay: story.say(
            "payment API",
            f"{status} for {email}"
            + (": same key, same data, the first answer again (no second customer)" if replay else "")
            + (": customer created, but the answer was lost on the way back" if status == 503 else "")
            + (": customer created" if status == 200 and not replay else ""),
        ),
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone():
            raise SystemExit(f"schema {schema!r} already exists; run the demo again (it picks a new name)")

    transport = make_transport(
        database_url=database_url,
        rabbitmq_url=rabbitmq_url,
        schema=schema,
        middleware=build_middleware(
            middleware=[
                Narrator(story),
                AgeLimit(),
                TimeLimit(),
                ShutdownNotifications(),
                Idempotency(),
                DeadLetters(),
            ],
            retries=ClassifiedRetries(max_retries=5, min_backoff=300, max_backoff=3000),
        ),
    )
    broker = transport.broker
    relay = transport.has_relay
    story.relay = relay
    via = "outbox" if relay else "queue"
    dramatiq.set_broker(broker)
    app = SignupApp(
        broker,
        schema=schema,
        queue_prefix=f"signup_demo_{run_id}",
        mail_url=mail.url,
        payments_url=payments.url,
        story=story,
    )
    worker: dramatiq.Worker | None = None
    events.subscribe(story.on_event)
    try:
        app.create_tables()
        mail.start()
        payments.start()
        print("dramatiq-reliable demo: the signup story of 'Background jobs done right'")
        kind = "OutboxBroker + RabbitMQ" if relay else "PostgresBroker (no RabbitMQ, no relay)"
        print(f"   runs on   {kind}; {postgres_line}")
        for line in transport.description:
            print(f"   {line}")
        print(f"   fakes     mail provider {mail.url}, payment API {payments.url} (in this process)")
        print(f"   queues    {', '.join(app.queue_names)} (deleted at the end)")

        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
        worker.start()
        transport.start_relay()

        # 1 -------------------------------------------------------------------------------------
        story.chapter(
            1,
            "Ada signs up.",
            f"One transaction saves her account and writes three {via} rows: nothing is sent before the commit.",
            "After the commit the relay forwards the rows to RabbitMQ and the worker runs the jobs."
            if relay
            else "After the commit the worker claims the rows from Postgres and runs the jobs.",
        )
        ada = app.signup("Ada", "ada@example.com")
        story.say("app", f"committed: account 'Ada' and 3 {via} rows, in one transaction")
        story.wait_settled(ada, "Ada's three jobs")

        # 2 -------------------------------------------------------------------------------------
        story.chapter(
            2,
            "The double click.",
            "Ada's page was slow, so she clicked again. The handler finds her account and, as",
            "naive handlers do, sends the three jobs again. Each job has an idempotency key.",
        )
        again = app.signup("Ada", "ada@example.com", click=" (second click)")
        story.say("app", f"committed: Ada's click counted, 3 more {via} rows")
        story.wait_settled(again, "the second click's jobs")

        # 3 -------------------------------------------------------------------------------------
        outage = ", ".join(str(status) for status in args.mail_outage) or "nothing"
        story.chapter(
            3,
            "The mail provider has a bad minute.",
            f"Grace signs up; the provider answers {outage} before it recovers. ClassifiedRetries",
            f"reads the status (and Retry-After) and retries with backoff; each retry is an {via} row.",
        )
        mail.answer_next(*args.mail_outage)
        grace = app.signup("Grace", "grace@example.com")
        story.wait_settled(grace, "Grace's welcome email to get through")

        # 4 -------------------------------------------------------------------------------------
        story.chapter(
            4,
            "The payment API loses an answer.",
            "For Edsger, the API creates the customer but the answer never arrives: a 503. The",
            "retry sends the same Idempotency-Key (external_key()), so the API returns the same customer.",
        )
        payments.lose_next_answers(1)
        edsger = app.signup("Edsger", "edsger@example.com")
        story.wait_settled(edsger, "Edsger's payment customer")

        # 5 -------------------------------------------------------------------------------------
        if not relay:
            story.chapter(
                5,
                "A deploy, with no relay to stop.",
                "With PostgresBroker the send is the queue row, committed with the account: there is no",
                "relay and no RabbitMQ to restart. Alan and Barbara sign up; the worker claims their rows.",
            )
            waiting = app.signup("Alan", "alan@example.com") + app.signup("Barbara", "barbara@example.com")
            story.say("app", "committed: 2 accounts and 6 queue rows")
            story.wait_settled(waiting, "Alan's and Barbara's jobs")
        else:
            story.chapter(
                5,
                "A deploy stops the relay.",
                "Alan and Barbara sign up while no relay runs: their accounts commit and the messages",
                "wait in the outbox, in Postgres. Nothing is lost; the restarted relay forwards them.",
            )
            transport.stop_relay()
            story.say("relay", "stopped (finished the batch in hand, as on SIGTERM)")
            waiting = app.signup("Alan", "alan@example.com") + app.signup("Barbara", "barbara@example.com")
            story.say("app", "committed: 2 accounts and 6 outbox rows; RabbitMQ has not seen them")
            run_cli(story, "outbox", "stats", "--schema", schema, "--database-url", database_url)
            transport.start_relay()
            story.say("relay", "started again")
            story.wait_settled(waiting, "Alan's and Barbara's jobs")

        # 6 -------------------------------------------------------------------------------------
        story.chapter(
            6,
            "A 400 fails fast.",
            "Linus types 'linus@example'. The provider answers 400: no retry can fix bad input, so",
            "the job fails at once and DeadLetters keeps it in Postgres, with its error and attempts.",
        )
        linus = app.signup("Linus", "linus@example")
        story.wait_settled(linus, "Linus's jobs")
        run_cli(story, "dead-letters", "list", "--schema", schema, "--database-url", database_url)

        # 7 -------------------------------------------------------------------------------------
        story.chapter(
            7,
            "The fix, and the replay.",
            "Support corrects the address. The job carries Linus's id, not his address, so a replay",
            f"sends to the fixed one. The replay goes through the {via}, like any other send.",
        )
        with broker.transaction() as conn:
            conn.execute(
                sql.SQL("UPDATE {}.accounts SET email = 'linus@example.com' WHERE name = 'Linus'").format(
                    sql.Identifier(schema)
                )
            )
        story.say("support", "UPDATE accounts SET email = 'linus@example.com' WHERE name = 'Linus'")
        dead = [message_id for message_id in linus if story.settled.get(message_id) == "dead"]
        story.forget(dead)
        ids = [str(story.dead_letters[message_id]) for message_id in dead]
        run_cli(
            story,
            "dead-letters",
            "replay",
            *ids,
            "--to",
            via,
            "--yes",
            "--schema",
            schema,
            "--database-url",
            database_url,
        )
        story.wait_settled(dead, "the replayed welcome email")

        story.chapter(8, "What each part did, counted from the events it emitted.")
        for line in story.summary():
            story.line(line)
        # The ledger ----------------------------------------------------------------------------
        story.chapter(9, "The ledger.", "What the providers and the chat table received, per account:")
        rows = app.ledger(sent_emails=mail.sent, customers=payments.customers)
        story.block(
            "\n".join(
                [f"{'account':<10}{'clicks':>7}{'emails':>8}{'customers':>11}{'chat':>6}"]
                + [f"{r.name:<10}{r.clicks:>7}{r.emails:>8}{r.customers:>11}{r.chat_messages:>6}" for r in rows]
            )
        )
        clicks = sum(r.clicks for r in rows)
        emails = sum(r.emails for r in rows)
        customers = sum(r.customers for r in rows)
        chats = sum(r.chat_messages for r in rows)
        ok = all(r.one_effect_each for r in rows)
        verdict = "one effect per signup" if ok else "NOT one effect per signup"
        print(
            f"\nledger: {len(rows)} signups from {clicks} clicks: {emails} welcome emails, "
            f"{customers} payment customers, {chats} chat messages: {verdict} "
            f"({time.monotonic() - started:.0f}s)"
        )
        return 0 if ok else 1
    finally:
        events.unsubscribe(story.on_event)
        if worker is not None:
            worker.stop()
        transport.stop_relay()
        with contextlib.suppress(Exception):
            transport.delete_queues(app.queue_names)
        broker.close()
        mail.stop()
        payments.stop()
        if not args.keep:
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        else:
            print(f"kept schema {schema!r}: drop it with DROP SCHEMA {schema} CASCADE")


if __name__ == "__main__":
    sys.exit(main())
