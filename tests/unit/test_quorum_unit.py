"""Queue settings: which queues are quorum, their arguments, and what is refused.  Needs no service."""

from __future__ import annotations

import types

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
