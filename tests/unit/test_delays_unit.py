"""Delays kept in Postgres: the row a delayed send writes and the relay's wait for the next due row (no network)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dramatiq.common import current_millis, dq_name
from dramatiq.message import Message

from dramatiq_reliable import OutboxBroker, Relay

_NOWHERE_AMQP = "amqp://127.0.0.1:1"
_NOWHERE_PG = "postgresql://127.0.0.1:1/x"


@pytest.fixture
def outbox_broker() -> Iterator[OutboxBroker]:
    broker = OutboxBroker(url=_NOWHERE_AMQP, database=_NOWHERE_PG)  # both opened lazily: never here
    yield broker
    broker.database.close()


def _message(queue_name: str = "orders", **options: Any) -> Message[Any]:
    return Message(queue_name=queue_name, actor_name="charge", args=(42,), kwargs={}, options=options)


def test_a_delayed_row_goes_to_the_queue_itself_due_at_its_eta_with_no_eta_in_its_body(outbox_broker):
    """The relay publishes it when due to the queue the workers run at once: nothing waits in a worker."""
    eta = current_millis() + 60_000
    delayed = _message(dq_name("orders"), eta=eta, trace_context={"traceparent": "00-ab"})
    row = outbox_broker._row(delayed, "orders", delayed.encode())
    assert row["queue_name"] == "orders"
    assert row["eta_ms"] == eta
    published = Message.decode(row["body"])
    assert published.queue_name == "orders" and "eta" not in published.options
    assert published.options["trace_context"] == {"traceparent": "00-ab"}
    assert published.message_id == delayed.message_id
    # What send() returned and the enqueue hooks saw keeps Dramatiq's delayed form.
    assert delayed.queue_name == "orders.DQ" and delayed.options["eta"] == eta


def test_a_message_sent_with_an_eta_option_also_waits_in_the_outbox(outbox_broker):
    """An ``eta`` given as an option, without ``delay=``, is a due time like any other."""
    eta = current_millis() + 5_000
    message = _message(eta=eta)
    row = outbox_broker._row(message, "orders", message.encode())
    assert (row["queue_name"], row["eta_ms"]) == ("orders", eta)
    assert "eta" not in Message.decode(row["body"]).options


def test_an_undelayed_row_is_the_message_as_sent(outbox_broker):
    message = _message()
    body = message.encode()
    row = outbox_broker._row(message, "orders", body)
    assert (row["queue_name"], row["eta_ms"], row["body"]) == ("orders", None, body)


def _relay(poll_interval_ms: int) -> Relay:
    relay = Relay(rabbitmq_url=_NOWHERE_AMQP, database=_NOWHERE_PG, poll_interval_ms=poll_interval_ms)
    relay.reaper.if_due = lambda: 0  # no lease to reap: these tests are about the wait alone
    return relay


def test_an_idle_relay_wakes_when_the_next_row_falls_due_not_a_poll_interval_later(monkeypatch):
    """A probe that says a row is due in 0.3 s cuts the next sleep to 0.3 s (the ceiling is 10 s)."""
    relay = _relay(poll_interval_ms=10_000)
    sleeps: list[float] = []
    probes = iter([0.3, 0.0])
    monkeypatch.setattr(relay, "_sleep", lambda delay_s: sleeps.append(delay_s) and False)
    monkeypatch.setattr(relay, "_probe", lambda: next(probes))
    relay._wait(60)  # long idle: the backoff is at its 10 s ceiling
    assert 5.0 <= sleeps[0] <= 10.0
    assert sleeps[1:] == [0.3]


def test_a_row_due_at_once_never_makes_the_relay_spin(monkeypatch):
    """A due time already past (a row another relay holds) still sleeps at least the first idle step."""
    relay = _relay(poll_interval_ms=250)
    sleeps: list[float] = []
    probes = iter([0.0000001, 0.0])
    monkeypatch.setattr(relay, "_sleep", lambda delay_s: sleeps.append(delay_s) and False)
    monkeypatch.setattr(relay, "_probe", lambda: next(probes))
    relay._wait(0)
    assert sleeps[1] == 0.001  # wake.FIRST_IDLE_S, never a zero sleep


def test_with_no_row_waiting_the_relay_keeps_its_idle_backoff(monkeypatch):
    relay = _relay(poll_interval_ms=250)
    sleeps: list[float] = []
    probes = iter([None, None, 0.0])
    monkeypatch.setattr(relay, "_sleep", lambda delay_s: sleeps.append(delay_s) and False)
    monkeypatch.setattr(relay, "_probe", lambda: next(probes))
    assert relay._wait(60) == 63
    assert len(sleeps) == 3 and all(0.125 <= delay <= 0.25 for delay in sleeps)


def test_a_long_backoff_on_an_outbox_broker_is_no_consumer_timeout_warning(caplog):
    """The retry waits in Postgres, not unacked in a worker: RabbitMQ's consumer_timeout does not apply."""
    import logging

    import dramatiq

    from dramatiq_reliable import ClassifiedRetries, build_middleware

    broker = OutboxBroker(
        url=_NOWHERE_AMQP, database=_NOWHERE_PG, middleware=build_middleware(retries=ClassifiedRetries())
    )
    try:
        with caplog.at_level(logging.WARNING, logger="dramatiq_reliable.retries"):
            dramatiq.actor(broker=broker, actor_name="slow_retries", max_backoff=7_200_000)(lambda: None)
        assert "consumer_timeout" not in caplog.text
    finally:
        broker.database.close()
