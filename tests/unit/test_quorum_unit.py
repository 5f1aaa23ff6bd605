"""Queue settings: which queues are quorum, their arguments, and what is refused.  Needs no service."""

from __future__ import annotations

import types
from typing import Any

import pytest

from dramatiq_reliable import ConfigurationError, OutboxBroker
from dramatiq_reliable.outbox.delivery_limit import over_limit
from dramatiq_reliable.outbox.queues import BACKSTOP_MARGIN, QueueSettings, mismatch


def test_classic_queues_get_exactly_dramatiqs_arguments():
    settings = QueueSettings(max_priority=5)
    assert settings.arguments("q") == {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "q.XQ",
        "x-max-priority": 5,
    }
    assert settings.arguments("q.DQ") == settings.arguments("q")
    assert settings.arguments("q.XQ") == {"x-message-ttl": 86_400_000 * 7}
    assert settings.limit_of("q") is None


def test_quorum_queues_get_the_type_a_delivery_limit_backstop_and_safe_dead_lettering():
    settings = QueueSettings(queue_type="quorum", delivery_limit=7)
    main = settings.arguments("q")
    assert main["x-queue-type"] == "quorum"
    assert main["x-delivery-limit"] == 7 + BACKSTOP_MARGIN
    assert main["x-dead-letter-routing-key"] == "q.XQ"
    assert (main["x-dead-letter-strategy"], main["x-overflow"]) == ("at-least-once", "reject-publish")
    # Delayed messages wait unacked in worker memory: a consumer restart must not count against them.
    assert "x-delivery-limit" not in settings.arguments("q.DQ")
    assert settings.arguments("q.DQ")["x-queue-type"] == "quorum"
    assert settings.arguments("q.XQ")["x-queue-type"] == "quorum"
    assert (settings.limit_of("q"), settings.limit_of("q.DQ")) == (7, None)
    assert "x-delivery-limit" not in QueueSettings(queue_type="quorum", delivery_limit=None).arguments("q")


def test_queue_types_override_the_default_per_queue():
    settings = QueueSettings(queue_types={"emails": "quorum"})
    assert (settings.type_of("emails"), settings.type_of("emails.DQ"), settings.type_of("other")) == (
        "quorum",
        "quorum",
        "classic",
    )
    assert QueueSettings(queue_type="quorum", queue_types={"old": "classic"}).type_of("old") == "classic"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"queue_type": "qourum"}, "queue_type must be 'classic' or 'quorum', got 'qourum'"),
        ({"queue_types": {"emails": "stream"}}, "queue_types['emails'] must be"),
        ({"queue_types": ["emails"]}, "queue_types must map queue names"),
        ({"delivery_limit": 0}, "delivery_limit"),
        ({"delivery_limit": True}, "delivery_limit"),
    ],
)
def test_bad_settings_are_refused_naming_the_option(options, named):
    with pytest.raises(ConfigurationError, match=named.replace("[", r"\[").replace("]", r"\]")):
        QueueSettings(**options)


@pytest.mark.parametrize("options", [{"queue_type": "quorum"}, {"queue_types": {"emails": "quorum"}}])
def test_max_priority_with_quorum_queues_is_refused_at_construction(options):
    with pytest.raises(ConfigurationError, match="quorum queues have no priorities") as caught:
        OutboxBroker(url="amqp://localhost", database="postgresql://nowhere/x", max_priority=5, **options)
    assert "drop max_priority" in str(caught.value)


def test_the_mismatch_error_names_the_queue_both_types_and_the_move():
    text = (
        "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received the value "
        "'quorum' of type 'longstr' but current is none"
    )
    message = str(mismatch("q", "x-queue-type", "quorum", text))
    assert "queue 'q' exists in RabbitMQ as a classic queue but this broker declares it quorum" in message
    assert "queue_types={'q': 'classic'}" in message and "production-topology.md" in message
    # RabbitMQ may name another quorum-only argument first: still a classic queue.
    text = text.replace("x-queue-type", "x-overflow").replace("'quorum'", "'reject-publish'")
    assert "as a classic queue" in str(mismatch("q", "x-overflow", "quorum", text))
    # The other way round: a classic declaration of a quorum queue.
    back = "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received none but current is the value 'quorum'"
    assert "as a quorum queue but this broker declares it classic" in str(
        mismatch("q", "x-queue-type", "classic", back)
    )
    other = "inequivalent arg 'x-delivery-limit' for queue 'q': received the value 25 but current is the value 15"
    assert "with another 'x-delivery-limit'" in str(mismatch("q", "x-delivery-limit", "quorum", other))


def test_over_limit_reads_the_quorum_delivery_count():
    def props(headers):
        return types.SimpleNamespace(headers=headers)

    assert over_limit(props({"x-delivery-count": 3}), 3) == 3
    assert over_limit(props({"x-delivery-count": 2}), 3) is None
    assert over_limit(props(None), 3) is None  # classic queues send no count
    assert over_limit(props({"x-delivery-count": 9}), None) is None
    assert over_limit(props({"x-delivery-count": True}), 1) is None


def test_several_urls_spread_connections_over_the_nodes_in_rotation():
    broker = OutboxBroker(url="amqp://a:5672;amqp://b:5672;amqp://c:5672", database="postgresql://nowhere/x")
    firsts = set()
    for _ in range(60):
        hosts = [p.host for p in broker.parameters]
        assert hosts in (["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"])  # the rest stay in order
        firsts.add(hosts[0])
    assert firsts == {"a", "b", "c"}
    single = OutboxBroker(url="amqp://a:5672", database="postgresql://nowhere/x")
    assert single.parameters.host == "a"


class _Consumer:
    """What screen() needs of a consumer: its broker's hooks, known tags, nack and _nack."""

    def __init__(self) -> None:
        self.known_tags: set[int] = set()
        self.hooks: list[tuple[str, str]] = []
        self.nacked: list[Any] = []
        self.raw_nacked: list[int] = []
        self.broker = types.SimpleNamespace(
            emit_before=lambda name, message: self.hooks.append(("before", name)),
            emit_after=lambda name, message: self.hooks.append(("after", name)),
        )

    def nack(self, message: Any) -> None:
        self.nacked.append(message)

    def _nack(self, tag: int) -> None:
        self.raw_nacked.append(tag)


def test_screen_fails_and_nacks_a_delivery_at_the_limit_through_the_nack_hooks_and_passes_the_rest():
    from dramatiq import Message

    from dramatiq_reliable import DeliveryLimitReached
    from dramatiq_reliable.outbox.delivery_limit import screen

    body = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}).encode()

    def delivery(tag: int, count: int | None) -> tuple[Any, Any, bytes]:
        headers = {"x-delivery-count": count} if count is not None else None
        return types.SimpleNamespace(delivery_tag=tag, redelivered=True), types.SimpleNamespace(headers=headers), body

    consumer = _Consumer()
    stream = [delivery(1, 0), delivery(2, 3), (None, None, None), delivery(3, None), delivery(4, 2)]
    out = list(screen(consumer, iter(stream), 3, "q"))
    assert [d[0].delivery_tag if d[0] else None for d in out] == [1, None, None, 3, 4]
    (nacked,) = consumer.nacked
    assert nacked.failed and isinstance(nacked._exception, DeliveryLimitReached)
    assert nacked._exception.deliveries == 3 and "delivery_limit=3" in str(nacked._exception)
    assert consumer.hooks == [("before", "nack"), ("after", "nack")]
    assert consumer.known_tags == {2}
    # A body that is not a message goes to .XQ as Dramatiq does with it.
    bad = _Consumer()
    list(
        screen(bad, iter([(types.SimpleNamespace(delivery_tag=7, redelivered=True), delivery(7, 5)[1], b"{")]), 3, "q")
    )
    assert (bad.raw_nacked, bad.nacked) == ([7], [])


def test_a_relay_from_the_broker_declares_as_the_broker_does():
    from dramatiq_reliable import Relay

    broker = OutboxBroker(
        url="amqp://a:5672",
        database="postgresql://nowhere/x",
        queue_type="quorum",
        queue_types={"old": "classic"},
        delivery_limit=7,
    )
    relay = Relay.from_broker(broker)
    assert relay.publisher._declarer.queue_settings == broker.queue_settings
    handmade = Relay(rabbitmq_url="amqp://a:5672", database="postgresql://nowhere/x", queue_type="quorum")
    assert handmade.publisher._declarer.queue_settings.arguments("q")["x-queue-type"] == "quorum"
