"""Tracing: one OpenTelemetry trace per job, from the request through the outbox, the relay and every retry.

The :class:`Tracing` middleware follows the OpenTelemetry messaging conventions and uses only
``opentelemetry-api``: without an SDK configured every call is a no-op, so libraries can add
it unconditionally and applications decide what is exported.

Spans (kind, name, when):

* ``PRODUCER  create <queue>``: ``send()`` writing the outbox row, in the caller's trace.  Its
  context is the message's *creation context*, stored in ``message.options["trace_context"]``
  (RabbitMQ carries only the JSON body here, so the options are the envelope).  It is set only
  when absent: a retry, Dramatiq's delay-queue hop and a pipeline's re-enqueue of the same
  message keep the original one, so every attempt lands in the same trace.
* ``CLIENT    send <queue>``: the relay publishing the row to RabbitMQ (one span per message,
  child of and linked to the creation context, timed by the batch), and the worker's consumer
  thread moving a due delayed message from ``<queue>.DQ`` to ``<queue>``.
* ``CONSUMER  process <queue>``: one per processing attempt, child of the creation context,
  linked to it and to the previous attempt's span (``options["trace_previous_attempt"]``).
  It records the outcome: error status and ``error.type`` on failure, the retry decision
  (outcome, category, reason, attempt, delay) as attributes and a ``retry.scheduled`` /
  ``retry.gave_up`` event, ``dead_lettered`` when the message failed for good, and every
  event the other middleware emit while it runs (``idempotency.duplicate``, ...).
* ``INTERNAL  dead_letter.stored`` (and any other event emitted right after the attempt, in
  the ack/nack hooks): a short child of the attempt's span.

A replayed dead letter (``options["replay_of"]``) starts a new trace whose first ``process``
span links to the original creation context (``options["trace_origin"]`` afterwards) and to
the last failed attempt.

Metrics: the conventions' ``messaging.client.sent.messages``,
``messaging.client.consumed.messages``, ``messaging.process.duration`` and
``messaging.client.operation.duration``, plus retries, dead letters, duplicates and gauges of
the outbox backlog and its oldest row, pending dead letters and RabbitMQ queue depth (read
through a cached :class:`~dramatiq_reliable.health.HealthMonitor`).

The modules, one concept each: :mod:`.semconv` (every name written), :mod:`.propagation` (the
trace context in ``message.options``), :mod:`.spans` (enqueue and processing spans),
:mod:`.bridge` (events onto spans), :mod:`.relay` (relay publish spans), :mod:`.metrics`
(instruments and health gauges) and :mod:`.middleware` (the ``Tracing`` class).
``docs/tracing.md`` has the tables.
"""

from __future__ import annotations

from .middleware import Tracing
from .propagation import PREVIOUS_ATTEMPT_KEY, TRACE_CONTEXT_KEY, TRACE_ORIGIN_KEY, TRACE_REPLAY_KEY

__all__ = [
    "PREVIOUS_ATTEMPT_KEY",
    "TRACE_CONTEXT_KEY",
    "TRACE_ORIGIN_KEY",
    "TRACE_REPLAY_KEY",
    "Tracing",
]
