"""deploy/: the Grafana dashboard, the alert rules and the Kubernetes manifests name what we export.

Every PromQL expression (dashboard targets and variables, alert rules, the KEDA query) is parsed
for its metric names and label matchers, which must be the ones the endpoint's collector
actually yields, read from a full reading; the Kubernetes grace periods must exceed the
shutdown timeouts they wrap.  No service needed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dramatiq_reliable.flow import KeyState
from dramatiq_reliable.health import Health, QueueHealth
from dramatiq_reliable.prometheus import METRIC_NAMES, HealthCollector

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dramatiq-reliable.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
KEDA = DEPLOY / "kubernetes" / "keda-scaledobject.yaml"
MANIFEST = DEPLOY / "kubernetes" / "dramatiq.yaml"

# PromQL words that are not metric names: operators, modifiers and aggregation clauses.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


class _Monitor:
    database = "postgresql://"
    rabbitmq = "amqp://"

    def __init__(self, reading: Health) -> None:
        self.reading = reading

    def get(self) -> Health:
        return self.reading


def _exported() -> dict[str, set[str]]:
    """Metric name -> label names, as the collector yields them for a reading with every number known."""
    full = QueueHealth(
        queue="orders",
        **{
            name: 1
            for name in (
                "depth",
                "delayed",
                "xq",
                "consumers",
                "outbox_backlog",
                "outbox_scheduled",
                "dead_letters",
                "retries_waiting",
            )
        },
        outbox_oldest_age_s=1.0,
        queue_oldest_age_s=1.0,
    )
    key = KeyState("k", "api", 1.0, 1, 1, None, None, None, None, None, 0, 0)
    reading = Health(queues=(full,), collected_at=time.time(), rate_limits=(key,), relay_last_publish_age_s=1.0)
    exported: dict[str, set[str]] = {}
    for family in HealthCollector(_Monitor(reading)).collect():
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


EXPORTED = _exported()


def test_metric_names_lists_exactly_what_the_collector_yields() -> None:
    assert set(EXPORTED) == METRIC_NAMES


def _metrics_in(expr: str) -> dict[str, set[str]]:
    """The metric names of a PromQL expression, each with the label names its matchers use."""
    matchers: dict[str, set[str]] = {}
    for name, inside in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        matchers.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", inside))
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)  # label matchers, ranges
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", bare)  # grouping labels
    names = {
        token
        for token, call in re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\()?", bare)
        if not call and token not in _KEYWORDS
    }
    return {name: matchers.get(name, set()) for name in names}


def _check(expr: str, where: str) -> None:
    found = _metrics_in(expr)
    assert found, f"{where}: {expr!r} names no metric"
    for name, labels in found.items():
        assert name in EXPORTED, f"{where}: {expr!r} names {name!r}, which the endpoint does not export"
        unknown = labels - EXPORTED[name]
        assert not unknown, f"{where}: {expr!r} matches {name!r} on {unknown}, labels it does not have"


def test_the_parser_catches_a_wrong_name_or_label() -> None:
    assert _metrics_in('sum by (queue) (rate(x_total{a="b"}[5m])) > on(queue) y') == {"x_total": {"a"}, "y": set()}
    with pytest.raises(AssertionError, match="does not export"):
        _check("dramatiq_reliable_queue_depthh > 1", "test")
    with pytest.raises(AssertionError, match="labels it does not have"):
        _check('dramatiq_reliable_queue_depth{key="x"}', "test")


def _dashboard_queries(node: Any) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for field in ("expr", "query", "definition"):
            value = node.get(field)
            if isinstance(value, str) and ("(" in value or "_" in value) and node.get("type") != "datasource":
                yield field, value
        for value in node.values():
            yield from _dashboard_queries(value)
    elif isinstance(node, list):
        for value in node:
            yield from _dashboard_queries(value)


def test_the_dashboard_queries_name_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = list(_dashboard_queries(dashboard))
    assert len(queries) >= 10
    for field, query in queries:
        _check(re.sub(r"^label_values\((.*), *\w+\)$", r"\1", query), f"dashboard {field}")
    shown = set().union(*(_metrics_in(q) for _, q in queries))
    wanted = {
        "queue_depth",
        "queue_oldest_age_seconds",
        "dead_letters",
        "outbox_backlog",
        "outbox_oldest_age_seconds",
        "retries_waiting",
        "rate_limited_keys",
        "desired_workers",
        "relay_last_publish_age_seconds",
    }
    assert {f"dramatiq_reliable_{name}" for name in wanted} <= shown
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_the_alert_rules_cover_the_four_alerts_on_exported_metrics() -> None:
    rules = [rule for group in yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]
    for rule in rules:
        _check(rule["expr"], f"alert {rule['alert']}")
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
    alerted = set().union(*(_metrics_in(rule["expr"]) for rule in rules))
    four = {"queue_depth", "queue_oldest_age_seconds", "dead_letters", "outbox_oldest_age_seconds"}
    assert {f"dramatiq_reliable_{name}" for name in four} <= alerted


def _documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text(encoding="utf-8")) if document]


def _deployment(name: str) -> dict[str, Any]:
    (found,) = [doc for doc in _documents(MANIFEST) if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name]
    return found


def _option(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def test_the_keda_scaled_object_scales_the_workers_on_desired_workers() -> None:
    (scaled,) = _documents(KEDA)
    assert scaled["kind"] == "ScaledObject"
    worker = _deployment(scaled["spec"]["scaleTargetRef"]["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert set(_metrics_in(trigger["metadata"]["query"])) == {"dramatiq_reliable_desired_workers"}
    _check(trigger["metadata"]["query"], "KEDA query")
    # desired worker processes / processes per pod = pods
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert trigger["metadata"]["threshold"] == _option(container["command"], "--processes")


def test_the_grace_periods_exceed_the_shutdown_timeouts() -> None:
    worker = _deployment("dramatiq-worker")["spec"]["template"]["spec"]
    (container,) = worker["containers"]
    shutdown_ms = int(_option(container["command"], "--worker-shutdown-timeout"))
    worker_relay_ms = 30_000  # a WorkerRelay's batch in hand, stopped first (docs/production.md)
    assert worker["terminationGracePeriodSeconds"] * 1000 > shutdown_ms + worker_relay_ms
    relay = _deployment("dramatiq-relay")["spec"]["template"]["spec"]
    confirm_timeout_ms = 30_000  # the relay's publish waits at most this on SIGTERM
    assert relay["terminationGracePeriodSeconds"] * 1000 > confirm_timeout_ms


def test_the_metrics_deployment_listens_where_its_service_and_probe_look() -> None:
    (container,) = _deployment("dramatiq-metrics")["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["dramatiq-reliable", "metrics"]
    port = int(_option(command, "--port"))
    assert _option(command, "--host") == "0.0.0.0"
    assert container["ports"] == [{"name": "metrics", "containerPort": port}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    (service,) = [doc for doc in _documents(MANIFEST) if doc["kind"] == "Service"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    # the command line parses: every option exists with a valid value
    from dramatiq_reliable.cli import build_parser

    args = build_parser().parse_args(command[1:])
    assert (args.port, args.worker_rate, args.target_wait) == (port, 2.0, 60_000)
