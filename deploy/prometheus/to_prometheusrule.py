"""Write deploy/k8s/base/prometheusrule.yaml from deploy/prometheus/textgen-rules.yml.

The rules file is the one source (promtool checks and unit-tests it); the Prometheus Operator wants the same
groups wrapped in a PrometheusRule object. tests/deploy/test_monitoring.py fails when the two differ.
Run: python deploy/prometheus/to_prometheusrule.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "textgen-rules.yml"
TARGET = HERE.parent / "k8s" / "base" / "prometheusrule.yaml"
HEADER = "# Generated from deploy/prometheus/textgen-rules.yml by to_prometheusrule.py: edit that file.\n"


def prometheus_rule(rules_path: Path = RULES) -> dict[str, Any]:
    groups = yaml.safe_load(rules_path.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "textgen"},
        "spec": {"groups": groups},
    }


def render(rules_path: Path = RULES) -> str:
    return HEADER + yaml.safe_dump(prometheus_rule(rules_path), sort_keys=False, width=1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if the file is stale instead of writing it"
    )
    args = parser.parse_args()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != render():
            sys.exit(f"{TARGET} is stale: run python deploy/prometheus/to_prometheusrule.py")
        return
    TARGET.write_text(render())
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
