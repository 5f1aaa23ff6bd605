"""Names: every span, attribute, event and metric name the tracing package writes, in one place.

The first block spells names from the OpenTelemetry semantic conventions (messaging, error and
HTTP); the ``opentelemetry-semantic-conventions`` package is not a runtime dependency, and a
unit test checks these against it.  The second block holds ours: Dramatiq's concepts under
``dramatiq.``, this package's under ``dramatiq_reliable.``.  Dashboards, alerts and tests that
read the telemetry can import them from here rather than repeat the strings.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ATTRIBUTE_VALUE_MAX_CHARS",
    "DEAD_LETTERED",
    "DEAD_LETTERED_EVENT",
    "DRAMATIQ_ACTOR_NAME",
    "DRAMATIQ_MESSAGE_ATTEMPT",
    "DRAMATIQ_MESSAGE_DELAY_MS",
    "DRAMATIQ_MESSAGE_SKIPPED",
    "DUPLICATE",
    "DUPLICATE_EVENT",
    "ERROR_TYPE",
    "ERROR_TYPE_OTHER",
    "HTTP_RESPONSE_STATUS_CODE",
    "LINK_ROLE",
    "LINK_ROLE_CREATION",
    "LINK_ROLE_ORIGIN",
    "LINK_ROLE_PREVIOUS_ATTEMPT",
    "LINK_ROLE_WORKFLOW_CHILD",
    "MESSAGING_BATCH_MESSAGE_COUNT",
    "MESSAGING_DESTINATION_NAME",
    "MESSAGING_MESSAGE_BODY_SIZE",
    "MESSAGING_MESSAGE_ID",
    "MESSAGING_OPERATION_NAME",
    "MESSAGING_OPERATION_TYPE",
    "MESSAGING_RABBITMQ_ROUTING_KEY",
    "MESSAGING_SYSTEM",
    "METRIC_CLIENT_CONSUMED_MESSAGES",
    "METRIC_CLIENT_OPERATION_DURATION",
    "METRIC_CLIENT_SENT_MESSAGES",
    "METRIC_DEAD_LETTERED",
    "METRIC_DEAD_LETTERS_PENDING",
    "METRIC_DUPLICATES_SKIPPED",
    "METRIC_OUTBOX_BACKLOG",
    "METRIC_OUTBOX_OLDEST_AGE",
    "METRIC_OUTBOX_SCHEDULED",
    "METRIC_PROCESS_DURATION",
    "METRIC_QUEUE_DEPTH",
    "METRIC_QUEUE_DESIRED_WORKERS",
    "METRIC_QUEUE_OLDEST_AGE",
    "METRIC_RATE_LIMIT_PAUSED",
    "METRIC_RATE_LIMIT_WAITING",
    "METRIC_RELAY_LAST_PUBLISH_AGE",
    "METRIC_RETRIES",
    "METRIC_SINGLETON_HELD",
    "OPERATION_CREATE",
    "OPERATION_PROCESS",
    "OPERATION_SEND",
    "QUEUE_KIND",
    "RATE_LIMIT_KEY",
    "RELAY_BATCH_EVENT",
    "REPLAY_COUNT",
    "RETRY_ATTEMPT",
    "RETRY_CATEGORY",
    "RETRY_DELAY_MS",
    "RETRY_EVENT_PREFIX",
    "RETRY_GAVE_UP_EVENT",
    "RETRY_OUTCOME",
    "RETRY_REASON",
    "RETRY_SCHEDULED_EVENT",
    "SINGLETON_HELD",
    "SINGLETON_HELD_EVENT",
    "SYSTEM_DRAMATIQ",
    "SYSTEM_POSTGRESQL",
    "SYSTEM_RABBITMQ",
    "span_name",
]

# -- OpenTelemetry semantic conventions -------------------------------------------------------------

MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_DESTINATION_NAME: Final = "messaging.destination.name"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
MESSAGING_MESSAGE_BODY_SIZE: Final = "messaging.message.body.size"
MESSAGING_BATCH_MESSAGE_COUNT: Final = "messaging.batch.message_count"
MESSAGING_RABBITMQ_ROUTING_KEY: Final = "messaging.rabbitmq.destination.routing_key"
ERROR_TYPE: Final = "error.type"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"

#: ``messaging.system`` values: RabbitMQ's own, and ours for any other Dramatiq broker.
SYSTEM_RABBITMQ: Final = "rabbitmq"
SYSTEM_DRAMATIQ: Final = "dramatiq"
#: The Postgres queue table, as a place holding messages (the queue-depth gauge).
SYSTEM_POSTGRESQL: Final = "postgresql"
#: ``messaging.operation.type`` (and ``.name``) values; an outbox insert *creates*, a publish *sends*.
OPERATION_CREATE: Final = "create"
OPERATION_SEND: Final = "send"
OPERATION_PROCESS: Final = "process"
#: The conventions' ``error.type`` for an error that has no better name.
ERROR_TYPE_OTHER: Final = "_OTHER"

METRIC_CLIENT_SENT_MESSAGES: Final = "messaging.client.sent.messages"
METRIC_CLIENT_CONSUMED_MESSAGES: Final = "messaging.client.consumed.messages"
METRIC_PROCESS_DURATION: Final = "messaging.process.duration"
METRIC_CLIENT_OPERATION_DURATION: Final = "messaging.client.operation.duration"

# -- ours -------------------------------------------------------------------------------------------

DRAMATIQ_ACTOR_NAME: Final = "dramatiq.actor.name"
DRAMATIQ_MESSAGE_ATTEMPT: Final = "dramatiq.message.attempt"
DRAMATIQ_MESSAGE_DELAY_MS: Final = "dramatiq.message.delay_ms"
DRAMATIQ_MESSAGE_SKIPPED: Final = "dramatiq.message.skipped"
RETRY_OUTCOME: Final = "dramatiq_reliable.retry.outcome"
RETRY_CATEGORY: Final = "dramatiq_reliable.retry.category"
RETRY_REASON: Final = "dramatiq_reliable.retry.reason"
RETRY_ATTEMPT: Final = "dramatiq_reliable.retry.attempt"
RETRY_DELAY_MS: Final = "dramatiq_reliable.retry.delay_ms"
DEAD_LETTERED: Final = "dramatiq_reliable.dead_lettered"
DUPLICATE: Final = "dramatiq_reliable.idempotency.duplicate"
#: What became of a run whose singleton key was held: ``skipped``, ``postponed`` or ``buffered``.
SINGLETON_HELD: Final = "dramatiq_reliable.singleton.held"
REPLAY_COUNT: Final = "dramatiq_reliable.replay.count"
QUEUE_KIND: Final = "dramatiq_reliable.queue.kind"
RATE_LIMIT_KEY: Final = "dramatiq_reliable.rate_limit.key"
#: Why a span links to another: ``creation``, ``origin`` or ``previous_attempt``.
LINK_ROLE: Final = "dramatiq_reliable.link.role"
LINK_ROLE_CREATION: Final = "creation"
LINK_ROLE_ORIGIN: Final = "origin"
LINK_ROLE_PREVIOUS_ATTEMPT: Final = "previous_attempt"
#: A workflow step sent after a group links to the run of each of the group's children.
LINK_ROLE_WORKFLOW_CHILD: Final = "workflow_child"

METRIC_RETRIES: Final = "dramatiq_reliable.retries"
METRIC_DEAD_LETTERED: Final = "dramatiq_reliable.dead_lettered"
METRIC_DUPLICATES_SKIPPED: Final = "dramatiq_reliable.duplicates_skipped"
METRIC_SINGLETON_HELD: Final = "dramatiq_reliable.singleton_held"
METRIC_OUTBOX_BACKLOG: Final = "dramatiq_reliable.outbox.backlog"
METRIC_OUTBOX_OLDEST_AGE: Final = "dramatiq_reliable.outbox.oldest_age"
METRIC_OUTBOX_SCHEDULED: Final = "dramatiq_reliable.outbox.scheduled"
METRIC_DEAD_LETTERS_PENDING: Final = "dramatiq_reliable.dead_letters.pending"
METRIC_QUEUE_DEPTH: Final = "dramatiq_reliable.queue.depth"
#: worker processes that would clear a queue's backlog within the target wait (dramatiq_reliable.autoscale).
METRIC_QUEUE_DESIRED_WORKERS: Final = "dramatiq_reliable.queue.desired_workers"
#: how long a Postgres queue's oldest ready message has waited, by queue.
METRIC_QUEUE_OLDEST_AGE: Final = "dramatiq_reliable.queue.oldest_age"
METRIC_RATE_LIMIT_WAITING: Final = "dramatiq_reliable.rate_limit.waiting"
METRIC_RATE_LIMIT_PAUSED: Final = "dramatiq_reliable.rate_limit.paused"
#: seconds since a relay last published an outbox row (its heartbeat while messages flow).
METRIC_RELAY_LAST_PUBLISH_AGE: Final = "dramatiq_reliable.relay.last_publish_age"

# Span events.  The retry ones are ClassifiedRetries' event names, written by Tracing itself
# when Dramatiq's own Retries decided; the others are events of the package it reacts to.
RETRY_SCHEDULED_EVENT: Final = "retry.scheduled"
RETRY_GAVE_UP_EVENT: Final = "retry.gave_up"
RETRY_EVENT_PREFIX: Final = "retry."
DEAD_LETTERED_EVENT: Final = "dead_lettered"
DUPLICATE_EVENT: Final = "idempotency.duplicate"
SINGLETON_HELD_EVENT: Final = "singleton.held"
RELAY_BATCH_EVENT: Final = "outbox.batch_published"

#: Event fields are free text (error messages): span attributes copied from them are cut here.
ATTRIBUTE_VALUE_MAX_CHARS: Final = 1024


def span_name(operation: str, destination: str) -> str:
    """``"<operation> <queue>"``: the conventions' low-cardinality name (never a message id)."""
    return f"{operation} {destination}"
