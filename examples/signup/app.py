"""The application of the story: a signup, its three follow-up jobs, and the ledger.

A signup saves the account and sends three messages **in one transaction**: a welcome email
(the mail provider), a payment customer (the payment API) and a message to the team chat (a
table standing in for Slack).  Payloads carry the account's id, never its data: a job loads
what it needs when it runs, so a replay after a fix sees the fixed row.

Each job is idempotent in the way that fits its effect:

* the two external calls run in ``record`` mode (the key is looked up before and recorded
  after the call) and send the provider a deterministic ``Idempotency-Key``
  (``external_key()``), the same on every retry and redelivery;
* the chat message is a database write, so it runs in ``transactional`` mode: its key commits
  in the job's own transaction, together with the row.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import dramatiq
from psycopg import sql
from story import Story

from dramatiq_reliable import OutboxBroker, external_key, job_connection

_TABLES = """
CREATE TABLE {schema}.accounts (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    email  text NOT NULL UNIQUE,
    name   text NOT NULL,
    clicks integer NOT NULL DEFAULT 1,
    payment_customer_id text
);
CREATE TABLE {schema}.team_chat (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id bigint NOT NULL REFERENCES {schema}.accounts (id),
    text       text NOT NULL
);
"""


@dataclass(frozen=True)
class LedgerRow:
    account_id: int
    name: str
    clicks: int
    emails: int
    customers: int
    chat_messages: int

    @property
    def one_effect_each(self) -> bool:
        return self.emails == self.customers == self.chat_messages == 1


class SignupApp:
    """The app's handler and actors, declared on ``broker`` (its middleware already set)."""

    def __init__(
        self, broker: OutboxBroker, *, schema: str, queue_prefix: str, mail_url: str, payments_url: str, story: Story
    ) -> None:
        self.broker = broker
        self.schema = schema
        self.mail_url = mail_url
        self.payments_url = payments_url
        self.story = story
        self.queue_names = [f"{queue_prefix}_mail", f"{queue_prefix}_payments", f"{queue_prefix}_chat"]
        mail_queue, payments_queue, chat_queue = self.queue_names
        self.send_welcome_email = dramatiq.actor(
            self._send_welcome_email,
            actor_name="send_welcome_email",
            queue_name=mail_queue,
            broker=broker,
            idempotency="record",
            idempotency_key=lambda account_id: f"welcome-{account_id}",
        )
        self.create_payment_customer = dramatiq.actor(
            self._create_payment_customer,
            actor_name="create_payment_customer",
            queue_name=payments_queue,
            broker=broker,
            idempotency="record",
            idempotency_key=lambda account_id: f"customer-{account_id}",
        )
        self.post_to_team_chat = dramatiq.actor(
            self._post_to_team_chat,
            actor_name="post_to_team_chat",
            queue_name=chat_queue,
            broker=broker,
            idempotency="transactional",
            idempotency_key=lambda account_id: f"chat-{account_id}",
        )

    def q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(schema=sql.Identifier(self.schema))

    def create_tables(self) -> None:
        with self.broker.database.connection() as conn, conn.transaction():
            conn.execute(self.q(_TABLES))

    # -- the request handler ----------------------------------------------------------------------

    def signup(self, name: str, email: str, *, click: str = "") -> list[str]:
        """Save the account and send its three jobs, in one transaction; return the message ids.

        A second click finds the account (the upsert counts the click) and, as naive handlers
        do, sends the three jobs again: their idempotency keys make the repeat harmless.
        """
        with self.broker.transaction() as conn:
            row = conn.execute(
                self.q(
                    "INSERT INTO {schema}.accounts (email, name) VALUES (%(email)s, %(name)s) "
                    "ON CONFLICT (email) DO UPDATE SET clicks = accounts.clicks + 1 RETURNING id"
                ),
                {"email": email, "name": name},
            ).fetchone()
            assert row is not None
            account_id = int(row[0])
            sent = []
            for actor, what in (
                (self.send_welcome_email, "welcome email"),
                (self.create_payment_customer, "payment customer"),
                (self.post_to_team_chat, "chat message"),
            ):
                message = actor.send(account_id)  # an outbox row in this transaction
                self.story.track(message.message_id, f"{name}'s {what}{click}")
                sent.append(message.message_id)
        return sent

    # -- the jobs -----------------------------------------------------------------------------------

    def _account(self, account_id: int) -> tuple[str, str]:
        with self.broker.database.connection() as conn:
            row = conn.execute(
                self.q("SELECT name, email FROM {schema}.accounts WHERE id = %(id)s"), {"id": account_id}
            ).fetchone()
        if row is None:
            raise LookupError(f"account {account_id} does not exist")
        return str(row[0]), str(row[1])

    def _send_welcome_email(self, account_id: int) -> None:
        _, email = self._account(account_id)
        _post(
            f"{self.mail_url}/send",
            {"to": email, "template": "welcome", "account_id": account_id},
            key=external_key("welcome-email"),
        )

    def _create_payment_customer(self, account_id: int) -> None:
        _, email = self._account(account_id)
        customer = _post(
            f"{self.payments_url}/v1/customers",
            {"account_id": account_id, "email": email},
            key=external_key("payment-customer"),
        )
        with self.broker.database.connection() as conn:
            conn.execute(
                self.q("UPDATE {schema}.accounts SET payment_customer_id = %(customer)s WHERE id = %(id)s"),
                {"customer": customer["id"], "id": account_id},
            )

    def _post_to_team_chat(self, account_id: int) -> None:
        name, _ = self._account(account_id)
        # The job's own transaction: this row and the idempotency key commit together.
        job_connection().execute(
            self.q("INSERT INTO {schema}.team_chat (account_id, text) VALUES (%(id)s, %(text)s)"),
            {"id": account_id, "text": f"{name} just signed up"},
        )
        self.story.say("team chat", f"{name} just signed up (a row written in the job's own transaction)")

    # -- the proof -------------------------------------------------------------------------------------

    def ledger(self, *, sent_emails: list[dict[str, Any]], customers: list[dict[str, Any]]) -> list[LedgerRow]:
        """Per account: the clicks, and the effects the providers and the chat table really saw."""
        with self.broker.database.connection() as conn:
            accounts = conn.execute(self.q("SELECT id, name, clicks FROM {schema}.accounts ORDER BY id")).fetchall()
            chat = dict(
                conn.execute(
                    self.q("SELECT account_id, count(*) FROM {schema}.team_chat GROUP BY account_id")
                ).fetchall()
            )
        return [
            LedgerRow(
                account_id=int(account_id),
                name=str(name),
                clicks=int(clicks),
                emails=sum(1 for mail in sent_emails if mail.get("account_id") == account_id),
                customers=sum(1 for customer in customers if customer.get("account_id") == account_id),
                chat_messages=int(chat.get(account_id, 0)),
            )
            for account_id, name, clicks in accounts
        ]


def _post(url: str, body: dict[str, Any], *, key: str) -> Any:
    """POST JSON with an Idempotency-Key.  An HTTP error is raised as urllib's ``HTTPError``,
    whose ``code`` and ``headers`` (``Retry-After``) ``ClassifiedRetries`` reads."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read() or b"null")
