"""The alerting rules and the dashboard of deploy/ (issue 29, item 5), checked with Prometheus's
own promtool (Debian's `prometheus` package; `./dev test` installs it): the rules load, their
unit tests (deploy/prometheus/rules_test.yml) pass, every alert is shown firing by one of them,
and the unit tests catch a rule made wrong; every dashboard query is valid PromQL; the example
Prometheus configuration loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "tollgate.json"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is required: `apt-get install prometheus` (./dev test installs it)")
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_rules_load() -> None:
    done = promtool("check", "rules", "rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout


def test_the_rules_unit_tests_pass() -> None:
    done = promtool("test", "rules", "rules_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_shown_firing_and_says_how_urgent_it_is() -> None:
    tests = yaml.safe_load((PROMETHEUS / "rules_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for group in tests
        for case in group.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    names = [str(rule["alert"]) for rule in alerts()]
    assert len(names) == len(set(names))
    assert sorted(set(names) - fired) == []
    for rule in alerts():
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]  # type: ignore[index]
        assert rule["annotations"]["summary"], rule["alert"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("max(tollgate_unbilled_terminal_oldest_age_seconds) > 300",
         "max(tollgate_unbilled_terminal_oldest_age_seconds) > 3000"),
        ('retry_budget"}[5m])) or vector(0))', 'retry_budget"}[5m])))'),
        ("max by (fold) (tollgate_dead_letters) > 0", "sum(tollgate_dead_letters) > 0"),
    ],
)  # fmt: skip
def test_the_unit_tests_catch_a_wrong_rule(tmp_path: Path, before: str, after: str) -> None:
    """A threshold too high, a sum emptied by a missing series, a label lost: each fails."""
    rules = (PROMETHEUS / "rules.yml").read_text()
    assert before in rules
    (tmp_path / "rules.yml").write_text(rules.replace(before, after))
    shutil.copy(PROMETHEUS / "rules_test.yml", tmp_path / "rules_test.yml")
    done = promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert done.returncode != 0, done.stdout
    assert "FAILED" in done.stdout + done.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and len(targets) > 20
    # Grafana's variable is a duration when it reaches Prometheus; each query checked as a
    # recording rule's expression.
    rules = [
        {"record": f"dashboard:query{i}", "expr": t["expr"].replace("$__rate_interval", "5m")}
        for i, t in enumerate(targets)
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]})
    )
    done = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # And the check is real: a broken query is refused.
    rules[0]["expr"] = "sum(rate(tollgate_requests_admitted_total[5m])"
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]})
    )
    assert promtool("check", "rules", "queries.yml", cwd=tmp_path).returncode != 0


def test_the_example_prometheus_configuration_loads(tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes service discovery: the jobs are checked
    with static targets in its place (authorization, relabelling, the rule file)."""
    config = (PROMETHEUS / "prometheus.yml").read_text()
    static = re.sub(
        r"kubernetes_sd_configs:\n(\s+)- role: endpoints\n\s+namespaces:\n\s+names: \[tollgate\]",
        r"static_configs:\n\1- targets: ['tollgate:9400']",
        config,
    )
    assert static.count("static_configs") == 3
    (tmp_path / "prometheus.yml").write_text(static)
    shutil.copy(PROMETHEUS / "rules.yml", tmp_path / "rules.yml")
    (tmp_path / "tollgate-metrics-token").write_text("token")
    checked = static.replace(
        "/etc/prometheus/secrets/tollgate-metrics-token", str(tmp_path / "tollgate-metrics-token")
    )
    (tmp_path / "prometheus.yml").write_text(checked)
    done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
