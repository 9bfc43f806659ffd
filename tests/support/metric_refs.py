"""Which metric names the deploy files use, and which of them an exposition lacks.

Used twice: against `Metrics`'s own exposition (tests/deploy/test_monitoring.py) and against a scrape of a
live server (`missing_metrics(scrape_text)`), so a renamed metric breaks a test, not a dashboard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "textgen.json"
RULES = REPO / "deploy" / "prometheus" / "textgen-rules.yml"
HPA = REPO / "deploy" / "k8s" / "base" / "hpa.yaml"
ADAPTER = REPO / "deploy" / "k8s" / "prometheus-adapter" / "values.yaml"

# PromQL identifiers: metric names, recording-rule names (with colons), functions, keywords, label names.
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
# What the exposition's own collectors and the service publish; other identifiers (sum, rate, job, le,
# $__rate_interval, up) are PromQL or Prometheus's own.
_EXPOSED_PREFIXES = ("textgen_", "process_", "python_")


def exposed_names(exposition: str) -> set[str]:
    """Every family and sample name in a text exposition (`rate(x_total)` and `x_bucket` both resolve)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def _identifiers(text: str) -> set[str]:
    # Label values ("$job", "OK|CANCELLED") are not names: drop quoted strings first.
    return set(_IDENTIFIER.findall(_QUOTED.sub('""', text)))


def metric_names(text: str) -> set[str]:
    """Names of exposed metrics that a PromQL expression (or any text) refers to."""
    return {i for i in _identifiers(text) if i.startswith(_EXPOSED_PREFIXES) and ":" not in i}


def recording_names(text: str) -> set[str]:
    """Recording-rule names (level:metric:operations) that a PromQL expression refers to."""
    return {i for i in _identifiers(text) if ":" in i}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # panels folded inside collapsed rows


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", []) if "expr" in t]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def rules(path: Path = RULES) -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


# autoscaling/v2 metric types that name a metric (Resource types name a resource, cpu or memory).
_HPA_METRIC_SOURCES = {"Pods": "pods", "Object": "object", "External": "external"}


def hpa_metric_names(path: Path = HPA) -> set[str]:
    """Metric names the HorizontalPodAutoscaler asks the metrics APIs for."""
    spec = yaml.safe_load(path.read_text())["spec"]
    return {
        m[_HPA_METRIC_SOURCES[m["type"]]]["metric"]["name"]
        for m in spec["metrics"]
        if m["type"] in _HPA_METRIC_SOURCES
    }


def adapter_rules(path: Path = ADAPTER) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["rules"]["custom"]


def references() -> dict[str, set[str]]:
    """Exposed metric names each deploy file uses, by file (relative to the repository)."""
    adapter_queries = [q for rule in adapter_rules() for q in (rule["seriesQuery"], rule["metricsQuery"])]
    found = {
        DASHBOARD: set().union(*map(metric_names, dashboard_exprs())),
        RULES: set().union(*(metric_names(rule["expr"]) for rule in rules())),
        # The HPA's names are served by the adapter under the Prometheus metric's own name.
        HPA: hpa_metric_names(),
        ADAPTER: set().union(*map(metric_names, adapter_queries)),
    }
    return {str(path.relative_to(REPO)): names for path, names in found.items()}


def missing_metrics(exposition: str) -> dict[str, set[str]]:
    """Names each deploy file uses that `exposition` does not contain; empty when all exist."""
    exposed = exposed_names(exposition)
    missing = {source: names - exposed for source, names in references().items()}
    return {source: names for source, names in missing.items() if names}


def promtool_input(exposition: str) -> str:
    """The exposition less the inference gateway's metrics under vLLM's names (serve.api.metrics's
    GATEWAY_ALIASES and LORA_REQUESTS_INFO): they carry ':', which promtool's lint keeps for recording rules;
    everything else must pass it."""
    from serve.api.metrics import GATEWAY_ALIASES, LORA_REQUESTS_INFO

    def alias(line: str) -> bool:  # a sample, or its family's # HELP / # TYPE line
        words = line.split()
        name = words[2] if line.startswith("# ") and len(words) > 2 else line.split("{")[0].split(" ")[0]
        return name in GATEWAY_ALIASES or name == LORA_REQUESTS_INFO

    return "".join(line for line in exposition.splitlines(keepends=True) if not alias(line))
