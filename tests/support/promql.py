"""What the shipped monitoring files (vmlend/data/monitoring) ask of Prometheus: the PromQL
expressions of the alert rules and of the Grafana dashboard, the metric names they use, and
the names the agent exports. No tests here (tests/unit/data/test_monitoring.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.support.paths import REPO

MONITORING = REPO / "vmlend" / "data" / "monitoring"
RULES = MONITORING / "vmlend-alerts.yml"
DASHBOARD = MONITORING / "vmlend-dashboard.json"
RULE_TESTS = REPO / "tests" / "data" / "monitoring" / "vmlend-alerts.test.yml"

#: Grafana's built-in variables the dashboard uses inside PromQL, and what stands in for each
#: where the expression is checked by promtool (a range selector must hold a duration).
GRAFANA_BUILTINS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
#: Words of PromQL that are no metric name.
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(
    r"(?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?[a-z]*)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?"
)


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are no function, aggregation,
    keyword, label (in ``{...}``, ``by (...)``, ``on (...)``...) or duration."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for m in _TOKEN.finditer(text):
        name = m["name"]
        if name and not m["call"] and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def rule_groups() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert isinstance(groups, list)
    return groups


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(board: dict[str, Any]) -> dict[str, str]:
    """Every PromQL expression of the dashboard by where it is: each panel target's, and the
    series selector inside each variable's ``label_values(SELECTOR, LABEL)``."""
    out = {}
    for panel in panels(board):
        for target in panel.get("targets", []):
            out[f"panel {panel['id']} ({panel['title']}) {target['refId']}"] = target["expr"]
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
        assert m, f"variable {var['name']}: {query!r} is not label_values(SELECTOR, LABEL)"
        out[f"variable {var['name']}"] = m[1]
    return out


def as_checkable(expr: str) -> str:
    """``expr`` with Grafana's built-in variables replaced by what promtool can parse."""
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(name, value)
    return expr


def recording_rules(exprs: dict[str, str]) -> str:
    """A rule file with one recording rule per expression: ``promtool check rules`` parses
    each (Prometheus has no command that checks a bare expression)."""
    rules = [
        {"record": f"vmlend_dashboard:expr_{i}", "expr": as_checkable(expr)}
        for i, expr in enumerate(exprs.values())
    ]
    return yaml.safe_dump({"groups": [{"name": "vmlend-dashboard", "rules": rules}]})


def exported_names(text: str) -> set[str]:
    """The series names a Prometheus text exposition has: each sample's, and those its
    ``# TYPE`` lines promise (a histogram's ``_bucket``, ``_sum`` and ``_count``)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            parts = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names |= {name + part for part in parts}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
