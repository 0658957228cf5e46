"""Every metric the alerting rules (deploy/prometheus/rules.yml) and the Grafana dashboard
(deploy/grafana/tollgate.json) name is on the /metrics of the process that must expose it
(issue 29, item 5): the distributed mode as deploy/ runs it, every part a real process — an edge
(`tollgate api`, /metrics behind the metrics token), the relay and a Kafka worker with
`--metrics-port` — over PostgreSQL and the Kafka-protocol broker. A few requests make the
labelled series exist (a metric declared with no sample is nothing a rule can match); then the
three scrapes are read, and a name in the rules or the dashboard that none of them has fails
the test. The names that are not Tollgate's own are listed with where they come from."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import (
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    poll,
    spawn,
    wait_http,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka]

RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "tollgate.json"
METRICS_TOKEN = "metrics-token-for-the-test"

# Series the rules and the dashboard read that no Tollgate process exposes, and from where.
EXTERNAL = {
    "up": "Prometheus's own: 1 when the scrape of a target succeeded",
    "kube_pod_status_ready": "kube-state-metrics: the kubelet's readiness probe (GET /readyz) "
    "of each edge pod; the edge has no readiness metric of its own",
}
# PromQL words an identifier regex also finds.
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers once strings, label matchers,
    ranges and grouping clauses are removed, functions (a name before `(`) and keywords left
    out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", e))
    return {n for n in found if n.lower() not in KEYWORDS and not n.startswith("$")}


def test_metric_names_finds_what_a_query_selects() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate(tollgate_billing_lag_seconds_bucket[5m])))"
        ' > 10 and on (job) up{job="a"} == 0 or max by (fold) (tollgate_dead_letters) > 1e3'
        ' unless absent(foo_total{x=~"a|b"}) or vector(0) or time() - bar_seconds offset 5m'
    )
    assert metric_names(expr) == {
        "tollgate_billing_lag_seconds_bucket", "up", "tollgate_dead_letters", "foo_total",
        "bar_seconds",
    }  # fmt: skip


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    def walk(panels: list[dict[str, Any]]) -> list[str]:
        found = []
        for panel in panels:
            found += [t["expr"] for t in panel.get("targets", [])]
            found += walk(panel.get("panels", []))
        return found

    return walk(json.loads(DASHBOARD.read_text())["panels"])


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def exposed(text: str) -> set[str]:
    """The sample names of a scrape (what PromQL selects: `_total`, `_bucket` ...)."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_of_the_rules_and_the_dashboard_is_exposed(
    postgres_url: str, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    named_by_rules = set().union(*map(metric_names, rule_exprs()))
    named_by_dashboard = set().union(*map(metric_names, dashboard_exprs()))
    assert len(named_by_rules) > 10 and len(named_by_dashboard) > 10

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env |= {
        "TOLLGATE_DATA_DIR": str(tmp_path / "data"),
        "TOLLGATE_KAFKA_BOOTSTRAP": kafka_broker.bootstrap,
        "TOLLGATE_KAFKA_TOPIC": kafka_topic,
        "TOLLGATE_METRICS_TOKEN": METRICS_TOKEN,
    }
    port, relay_port, worker_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    edge = spawn(
        [*TOLLGATE, "api", "--port", str(port), "--database-url", postgres_url,
         "--simulated-replicas", "1", "--sim-speed", "20"],
        tmp_path / "edge.log", env=env,
    )  # fmt: skip
    relay = worker = None
    try:
        wait_http(f"{base}/healthz", edge, tmp_path / "edge.log", timeout=90)
        relay = spawn(
            [*TOLLGATE, "relay", "--database-url", postgres_url, "--metrics-port",
             str(relay_port)],
            tmp_path / "relay.log", env=env,
        )  # fmt: skip
        worker = spawn(
            [*TOLLGATE, "worker", "--database-url", postgres_url, "--metrics-port",
             str(worker_port)],
            tmp_path / "worker.log", env=env,
        )  # fmt: skip
        poll("the edge ready", lambda: httpx.get(f"{base}/readyz").status_code == 200,
             timeout=90, every=0.5)  # fmt: skip
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        for i in range(3):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}],
                    "max_tokens": 8}  # fmt: skip
            r = httpx.post(f"{base}/v1/chat/completions", headers=auth(keys["demo-standard"]),
                           json=body, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
        # A refusal, so the refusal counters have a series.
        bad = httpx.post(f"{base}/v1/chat/completions", headers=auth(keys["demo-standard"]),
                         json={"model": MODEL, "messages": []}, timeout=30)  # fmt: skip
        assert bad.status_code == 400, bad.text

        def scrape(url: str, token: str | None = None) -> str:
            headers = auth(token) if token else {}
            r = httpx.get(url, headers=headers, timeout=10)
            assert r.status_code == 200, (url, r.status_code, r.text[:300])
            return r.text

        # The edge's /metrics answers the token only (as Prometheus scrapes it, prometheus.yml).
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 401
        scrapes = {
            "edge": lambda: scrape(f"{base}/metrics", METRICS_TOKEN),
            "relay": lambda: scrape(f"http://127.0.0.1:{relay_port}/metrics"),
            "worker": lambda: scrape(f"http://127.0.0.1:{worker_port}/metrics"),
        }
        # Billed (the worker's billing-lag histogram has its bills) and the reconciliation ran.
        poll("the worker billed the 3 requests and reconciled",
             lambda: "tollgate_billing_lag_seconds_count 3.0" in scrapes["worker"]()
             and "tollgate_reconciliation_last_run_timestamp_seconds 0.0"
             not in scrapes["worker"](), timeout=60, every=0.5)  # fmt: skip
        by_process = {name: exposed(read()) for name, read in scrapes.items()}
        # The resident memory of each process (deploy/README.md sizes the requests with it).
        rss_mib = {
            name: rss_kib(proc.pid) // 1024
            for name, proc in (("edge", edge), ("relay", relay), ("worker", worker))
            if proc is not None
        }
    finally:
        for proc in (worker, relay):
            if proc is not None:
                _stop_process(proc, grace=10)
        _stop_process(edge, grace=10)

    everywhere = set().union(*by_process.values())
    for source, names in (("rules.yml", named_by_rules), ("tollgate.json", named_by_dashboard)):
        missing = sorted(n for n in names if n not in everywhere and n not in EXTERNAL)
        assert not missing, (
            f"{source} names metrics no Tollgate process exposes: {missing}\n"
            + "\n".join(f"{p}: {sorted(n for n in v if n.startswith('tollgate_'))}"
                        for p, v in by_process.items())
        )  # fmt: skip
    # The pipeline's own figures come from the pipeline's processes.
    assert "tollgate_relay_lag_events" in by_process["relay"]
    assert "tollgate_consumer_lag_messages" in by_process["worker"]
    assert "tollgate_billing_lag_seconds_bucket" in by_process["worker"]
    assert "tollgate_reconciliation_last_run_timestamp_seconds" in by_process["worker"]
    for name in (
        "tollgate_requests_admitted_total",
        "tollgate_goodput_ratio",
        "tollgate_replica_kv_occupancy",
        "tollgate_unbilled_terminal_oldest_age_seconds",
    ):
        assert name in by_process["edge"], name  # fmt: skip
    print(
        "RSS MiB",
        rss_mib,
        {p: len(v) for p, v in by_process.items()},
        "external:",
        sorted(n for n in named_by_rules | named_by_dashboard if n in EXTERNAL),
    )
