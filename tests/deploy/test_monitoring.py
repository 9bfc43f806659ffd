"""Operator-facing monitoring files: Prometheus rules (promtool), the Grafana dashboard, and that every metric
they name exists in what `serve.api.metrics.Metrics` exposes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from metric_refs import (
    ADAPTER,
    DASHBOARD,
    REPO,
    RULES,
    adapter_rules,
    dashboard_exprs,
    exposed_names,
    hpa_metric_names,
    metric_names,
    missing_metrics,
    recording_names,
    references,
    rules,
)

from serve.api.metrics import Metrics

RULE_TESTS = REPO / "deploy" / "prometheus" / "tests" / "textgen-rules.test.yml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
# Grafana's variables, replaced by values that keep each expression valid PromQL for promtool.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool absent: install Debian's prometheus package (.ci/system-deps.sh does in CI)")
    return path


def run_promtool(*args: str) -> None:
    result = subprocess.run([promtool(), *args], capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def exposition() -> str:
    """What a server that has seen a little of everything exposes: each hook called once."""
    m = Metrics()  # with the standard collectors, as the server has
    m.on_admitted(0.002)
    m.on_first_token(0.05)
    m.on_token(0.012)
    m.on_finished("eos", 7, 9, 4)
    m.on_step("decode", 3, 0.0, 0.01)
    m.set_load(running=3, kv_used=3, kv_capacity=8)
    m.watch_waiting(lambda: 1)
    m.on_request_done("Generate", "OK", 0.4)
    m.set_ready(True)
    m.set_model_info("demo", "float32", "none", "CPUExecutionProvider")
    return m.exposition()


def test_rules_pass_promtool_check() -> None:
    run_promtool("check", "rules", str(RULES))


def test_rules_pass_their_unit_tests() -> None:
    run_promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_has_a_unit_test() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == tested


def test_alerts_have_severity_and_summary() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheusrule_carries_the_rules_file() -> None:
    """The Kubernetes PrometheusRule is generated from the rules file; regenerate it when this fails."""
    generator = REPO / "deploy" / "prometheus" / "to_prometheusrule.py"
    result = subprocess.run(
        [sys.executable, str(generator), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wrapped = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert wrapped["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_dashboard_is_valid_json_with_unique_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {panel["title"] for panel in dashboard["panels"]}
    asked_for = {"Throughput", "Time to first token", "Inter-token latency", "Queue", "Batch size"}
    assert asked_for | {"Padding ratio", "Errors by code"} <= titles


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query as a recording rule's expression."""
    # A query variable's label_values(selector, label) is Grafana's; its selector is PromQL.
    exprs = [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", e) for e in dashboard_exprs()]
    for variable, value in GRAFANA_VARIABLES.items():
        exprs = [e.replace(variable, value) for e in exprs]
    assert not [e for e in exprs if re.search(r"\$(?![a-z_]*\")", e)], (
        "a Grafana variable outside a label value"
    )
    group = {
        "name": "dashboard",
        "rules": [{"record": f"dashboard:query:{i}", "expr": e} for i, e in enumerate(exprs)],
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    run_promtool("check", "rules", str(path))


def test_recording_rules_used_are_defined() -> None:
    defined = {rule["record"] for rule in rules() if "record" in rule}
    used = set().union(*(recording_names(rule["expr"]) for rule in rules()))
    used |= set().union(*map(recording_names, dashboard_exprs()))
    assert used <= defined


def test_reference_extraction() -> None:
    expr = 'sum by (code) (rate(textgen_requests_total{job="$job", code!="textgen_x"}[$__rate_interval]))'
    assert metric_names(expr) == {"textgen_requests_total"}
    assert recording_names("job:textgen_requests:rate5m / job:x:y") == {
        "job:textgen_requests:rate5m",
        "job:x:y",
    }
    assert metric_names("job:textgen_requests:rate5m > process_open_fds") == {"process_open_fds"}


def test_hpa_metric_is_served_by_the_adapter_rule() -> None:
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert hpa_metric_names() == {"textgen_requests_waiting"}
    assert hpa_metric_names() <= served


def test_every_referenced_metric_exists(exposition: str) -> None:
    refs = references()
    assert set(refs) == {
        str(p.relative_to(REPO)) for p in (DASHBOARD, RULES, ADAPTER, REPO / "deploy/k8s/base/hpa.yaml")
    }
    assert all(refs.values()), "a deploy file names no metric: the extraction is broken"
    assert missing_metrics(exposition) == {}


def test_a_missing_metric_is_reported(exposition: str) -> None:
    without_queue = "\n".join(
        line for line in exposition.splitlines() if "textgen_requests_waiting" not in line
    )
    assert "textgen_requests_waiting" not in exposed_names(without_queue + "\n")
    missing = missing_metrics(without_queue + "\n")
    assert missing["deploy/k8s/base/hpa.yaml"] == {"textgen_requests_waiting"}
