"""One order, one trace: a request, the outbox, the relay, a failed charge, its retry and the receipt.

Run with ``python examples/tracing_console.py`` (local Postgres and RabbitMQ, or DATABASE_URL /
RABBITMQ_URL).  It needs the OpenTelemetry SDK, which a plain install of dramatiq-reliable does
not bring (``pip install opentelemetry-sdk``; it exits with status 2 saying so when missing).  It configures the OpenTelemetry SDK with a console exporter, places an order
in a request span (the order row and the ``charge`` message commit together), runs a worker
with the in-process relay, lets the first charge fail with a timeout so ``ClassifiedRetries``
retries it, and sends the receipt from the successful attempt.  Then it prints that one trace
as an indented tree, and the metrics the run recorded.

The SDK's ``ConsoleSpanExporter`` prints each span as it ends, one line each (``--json`` for the
exporter's full JSON); ``--svg PATH`` draws the trace as a waterfall (``docs/img/trace.svg``
was drawn this way).
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import threading
from collections.abc import Sequence

import dramatiq
import psycopg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

try:  # the SDK exports spans; dramatiq-reliable itself needs only opentelemetry-api
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
except ImportError:
    print("this example needs the OpenTelemetry SDK: pip install opentelemetry-sdk", file=sys.stderr)
    sys.exit(2)

from dramatiq_reliable import ClassifiedRetries, OutboxBroker, Tracing, WorkerRelay, build_middleware, migrate

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
RABBITMQ_URL = os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SCHEMA = "dramatiq_reliable_tracing_demo"

# -- OpenTelemetry: what an application configures once at start-up --------------------------------

resource = Resource.create({"service.name": "orders-demo"})
tracer_provider = TracerProvider(resource=resource)
collected = InMemorySpanExporter()  # to print the tree at the end
tracer_provider.add_span_processor(SimpleSpanProcessor(collected))
metric_reader = InMemoryMetricReader()
meter_provider = MeterProvider(resource=resource, metric_readers=[metric_reader])
trace.set_tracer_provider(tracer_provider)


def one_line(span: ReadableSpan) -> str:
    """The console exporter's format here: kind, name, duration, status (``--json`` for everything)."""
    duration_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
    return f"  span ended: {span.kind.name:<8} {span.name:<32} {duration_ms:8.1f} ms  {span.status.status_code.name}\n"


# -- the broker: Tracing first, ClassifiedRetries last ------------------------------------------------

# health_cache_ms=0: the metrics printed at the end are read then, not at the shutdown flush.
tracing = Tracing(tracer_provider=tracer_provider, meter_provider=meter_provider, health_cache_ms=0)
middleware = build_middleware(
    retries=ClassifiedRetries(min_backoff=300, max_backoff=600),
    middleware=[tracing, WorkerRelay(poll_interval_ms=100)],  # the relay runs inside the worker
)

migrate(DATABASE_URL, schema=SCHEMA)
broker = OutboxBroker(url=RABBITMQ_URL, database=DATABASE_URL, schema=SCHEMA, middleware=middleware)
dramatiq.set_broker(broker)

app_tracer = tracer_provider.get_tracer("orders-demo")
charges: list[int] = []
receipt_sent = threading.Event()


@dramatiq.actor(queue_name="demo_payments", max_retries=3)
def charge(order_id: int) -> None:
    """The payment gateway times out once; the retry succeeds and the receipt goes out."""
    charges.append(order_id)
    with app_tracer.start_as_current_span("POST payment-gateway/charges", kind=SpanKind.CLIENT):
        if len(charges) == 1:
            raise TimeoutError("payment gateway timed out after 5s")
    send_receipt.send(order_id)


@dramatiq.actor(queue_name="demo_receipts")
def send_receipt(order_id: int) -> None:
    receipt_sent.set()


def place_order(order_id: int) -> int:
    """The web request: the order row and its charge message commit together."""
    with app_tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request:
        with broker.transaction() as conn:
            conn.execute("INSERT INTO demo_traced_orders (id) VALUES (%s)", (order_id,))
            charge.send(order_id)
        return request.get_span_context().trace_id


# -- printing ---------------------------------------------------------------------------------------


def trace_tree(spans: Sequence[ReadableSpan]) -> list[tuple[int, ReadableSpan]]:
    """(depth, span) in the order a trace viewer shows them: parents first, siblings by start."""
    by_id = {span.context.span_id: span for span in spans}
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in spans:
        parent = span.parent.span_id if span.parent and span.parent.span_id in by_id else None
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[int, ReadableSpan]] = []

    def walk(parent: int | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            ordered.append((depth, span))
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    return ordered


def describe(span: ReadableSpan) -> str:
    attributes = span.attributes or {}
    notes = []
    if "dramatiq.message.attempt" in attributes:
        notes.append(f"attempt {attributes['dramatiq.message.attempt']}")
    if span.status.status_code is StatusCode.ERROR:
        notes.append(f"ERROR {attributes.get('error.type', '')}".rstrip())
    if "dramatiq_reliable.retry.outcome" in attributes:
        outcome = attributes["dramatiq_reliable.retry.outcome"]
        why = f"{attributes.get('dramatiq_reliable.retry.category')}/{attributes.get('dramatiq_reliable.retry.reason')}"
        delay = attributes.get("dramatiq_reliable.retry.delay_ms")
        notes.append(f"retry in {delay} ms ({why})" if outcome == "retry" else f"gave up: {outcome} ({why})")
    roles = [str(link.attributes.get("dramatiq_reliable.link.role")) for link in span.links if link.attributes]
    if "previous_attempt" in roles:
        notes.append("linked to the previous attempt")
    return "; ".join(notes)


def print_tree(spans: Sequence[ReadableSpan]) -> None:
    start = min(span.start_time or 0 for span in spans)
    for depth, span in trace_tree(spans):
        offset = ((span.start_time or 0) - start) / 1e6
        duration = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        label = f"{'  ' * depth}{span.kind.name:<8} {span.name}"
        notes = describe(span)
        print(f"  {label:<58} +{offset:7.1f} ms {duration:7.1f} ms" + (f"  [{notes}]" if notes else ""))


_COLOURS = {
    SpanKind.SERVER: "#7f7f7f",
    SpanKind.PRODUCER: "#1f77b4",
    SpanKind.CLIENT: "#17becf",
    SpanKind.CONSUMER: "#2ca02c",
    SpanKind.INTERNAL: "#bcbd22",
}


def write_svg(spans: Sequence[ReadableSpan], path: str) -> None:
    """A waterfall of the trace: one row per span, bars on a shared time axis, errors in red."""
    rows = trace_tree(spans)
    start = min(span.start_time or 0 for span in spans)
    end = max(span.end_time or 0 for span in spans)
    total_ms = max((end - start) / 1e6, 1.0)
    label_w, bar_w, row_h, top = 430, 620, 24, 46
    width, height = label_w + bar_w + 30, top + row_h * len(rows) + 40
    y_of = {span.context.span_id: top + i * row_h for i, (_, span) in enumerate(rows)}
    end_x = {span.context.span_id: label_w + bar_w * ((span.end_time or 0) - start) / 1e6 / total_ms for span in spans}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">One order, one trace ({len(rows)} spans, '
        f"{total_ms:.0f} ms) — drawn from examples/tracing_console.py</text>",
    ]
    for tick in range(0, 6):
        x = label_w + bar_w * tick / 5
        out.append(f'<line x1="{x:.1f}" y1="{top - 8}" x2="{x:.1f}" y2="{height - 30}" stroke="#eee"/>')
        out.append(
            f'<text x="{x:.1f}" y="{top - 12}" text-anchor="middle" fill="#666">{total_ms * tick / 5:.0f} ms</text>'
        )
    for depth, span in rows:
        y = y_of[span.context.span_id]
        x0 = label_w + bar_w * ((span.start_time or 0) - start) / 1e6 / total_ms
        w = max(bar_w * ((span.end_time or 0) - (span.start_time or 0)) / 1e6 / total_ms, 2.0)
        error = span.status.status_code is StatusCode.ERROR
        colour = "#d62728" if error else _COLOURS.get(span.kind, "#999")
        name = html.escape(("  " * depth) + span.name)
        out.append(f'<text x="10" y="{y + 15}" xml:space="preserve">{name}</text>')
        out.append(
            f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end" fill="#888">{span.kind.name.lower()}</text>'
        )
        out.append(f'<rect x="{x0:.1f}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" rx="2" fill="{colour}"/>')
        note = html.escape(describe(span))
        if note:
            anchor, tx = ("end", x0 - 4) if x0 > label_w + bar_w / 2 else ("start", x0 + w + 4)
            out.append(
                f'<text x="{tx:.1f}" y="{y + 15}" text-anchor="{anchor}" fill="#444" font-size="10">{note}</text>'
            )
        for link in span.links:
            if link.attributes and link.attributes.get("dramatiq_reliable.link.role") == "previous_attempt":
                prior = y_of.get(link.context.span_id)
                if prior is not None:
                    # From the end of the failed attempt, along the gap under its row (clear of the
                    # labels), down to this attempt.
                    px, gap, cy = end_x[link.context.span_id] - 1, prior + row_h, y + row_h / 2
                    out.append(
                        f'<path d="M{px:.1f},{prior + row_h - 4:.1f} L{px:.1f},{gap:.1f} L{x0 - 3:.1f},{gap:.1f} '
                        f'L{x0 - 3:.1f},{cy:.1f} L{x0:.1f},{cy:.1f}" '
                        'stroke="#d62728" stroke-dasharray="3,3" fill="none"/>'
                    )
    legend = [
        ("server", "#7f7f7f"),
        ("producer", "#1f77b4"),
        ("client", "#17becf"),
        ("consumer", "#2ca02c"),
        ("error", "#d62728"),
    ]
    for i, (text, colour) in enumerate(legend):
        x = 10 + i * 110
        out.append(f'<rect x="{x}" y="{height - 22}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 18}" y="{height - 12}">{text}</text>')
    out.append(
        f'<text x="{10 + 5 * 110}" y="{height - 12}" fill="#d62728">- - - link to the previous attempt</text></svg>'
    )
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(out) + "\n")


def print_metrics() -> None:
    data = metric_reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else []:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    shown = value if value is not None else f"count={point.count} sum={point.sum:.3f}"
                    labels = ", ".join(
                        f"{k.removeprefix('messaging.').removeprefix('dramatiq_reliable.')}={v}"
                        for k, v in sorted(point.attributes.items())
                        if k != "messaging.system"
                    )
                    print(f"  {metric.name:<42} {shown!s:<26} {labels}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print spans as the console exporter's full JSON")
    parser.add_argument("--svg", metavar="PATH", help="draw the trace as an SVG waterfall")
    args = parser.parse_args(argv)
    console = ConsoleSpanExporter() if args.json else ConsoleSpanExporter(formatter=one_line)
    tracer_provider.add_span_processor(SimpleSpanProcessor(console))

    with psycopg.connect(DATABASE_URL, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS demo_traced_orders")
        conn.execute("CREATE TABLE demo_traced_orders (id int PRIMARY KEY)")
    broker.flush_all()
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        print("placing order 1: the order row and its charge message commit in one transaction")
        trace_id = place_order(1)
        if not receipt_sent.wait(30):
            print("demo failed: the receipt did not go out within 30s", file=sys.stderr)
            return 1
        worker.stop()  # Tracing flushes the providers at worker shutdown
        spans = [s for s in collected.get_finished_spans() if s.context.trace_id == trace_id]
        print(f"\ntrace {trace_id:032x}: {len(spans)} spans\n")
        print_tree(spans)
        print("\nmetrics recorded by this run (the gauges read Postgres and RabbitMQ now):\n")
        print_metrics()
        if args.svg:
            write_svg(spans, args.svg)
            print(f"\nwaterfall written to {args.svg}")
    finally:
        worker.stop()
        tracing.close()
        broker.close()
        meter_provider.shutdown()
        tracer_provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
