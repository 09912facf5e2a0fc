"""The monitoring files vmlend ships (vmlend/data/monitoring): the Prometheus alert rules pass
``promtool check rules`` and their unit tests (``promtool test rules``), every expression of
the Grafana dashboard parses, and every metric either uses is one the agent exports."""

from __future__ import annotations

import pytest

from tests.support import promtool
from tests.support.paths import REPO
from tests.support.promql import (
    DASHBOARD,
    RULE_TESTS,
    RULES,
    alert_rules,
    dashboard,
    dashboard_exprs,
    exported_names,
    metric_names,
    panels,
    recording_rules,
)
from tests.support.simfabric import make_fabric
from vmlend.agent.metrics import AgentMetrics


class Lease:
    def age(self) -> float:
        return 1.0

    def paused_count(self) -> int:
        return 0


class Recovered:
    outcome = "paused"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Every series name a fully fed agent exports: lease, ledger, a hook call, a recovery."""
    fabric = make_fabric(tmp_path_factory.mktemp("metrics") / "state.db")
    try:
        m = AgentMetrics()
        m.follow(lease=Lease(), ttl=10, open_fabric=lambda: fabric)
        m.observe_hook("prepare", 0.02)
        m.recovered([Recovered()])
        return exported_names(m.render())
    finally:
        fabric.close()


def test_the_rules_pass_promtool_check_rules():
    r = promtool.run("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_the_rules_pass_their_unit_tests():
    r = promtool.run("test", "rules", RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_each_alert_has_a_unit_test_that_sees_it_fire():
    tested = RULE_TESTS.read_text()
    for rule in alert_rules():
        assert f"alertname: {rule['alert']}\n        exp_alerts:\n          - " in tested, rule


def test_the_rule_tests_fail_on_a_rule_that_never_fires(tmp_path):
    """The unit tests are not vacuous: with one alert's threshold out of reach they fail."""
    broken = tmp_path / "vmlend" / "data" / "monitoring"
    broken.mkdir(parents=True)
    text = RULES.read_text().replace("expr: vmlend_paused_vms > 0", "expr: vmlend_paused_vms > 99")
    assert text != RULES.read_text()
    (broken / RULES.name).write_text(text)
    tests = tmp_path / "tests" / "data" / "monitoring"
    tests.mkdir(parents=True)
    (tests / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    r = promtool.run("test", "rules", tests / RULE_TESTS.name)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "alertname: VmlendVmsPaused" in out, out


def test_every_dashboard_expression_parses(tmp_path):
    exprs = dashboard_exprs(dashboard())
    assert len(exprs) >= 20
    rules = tmp_path / "dashboard-exprs.yml"
    rules.write_text(recording_rules(exprs))
    r = promtool.run("check", "rules", rules)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout


def test_a_dashboard_expression_that_does_not_parse_is_caught(tmp_path):
    rules = tmp_path / "bad.yml"
    rules.write_text(recording_rules({"x": "sum by (op) (rate(vmlend_hook_calls_total[5m])"}))
    r = promtool.run("check", "rules", rules)
    assert r.returncode != 0


def test_every_metric_a_rule_or_panel_uses_is_one_the_agent_exports(exported):
    used = {f"alert {r['alert']}": r["expr"] for r in alert_rules()}
    used |= dashboard_exprs(dashboard())
    unknown = {
        where: sorted(metric_names(expr) - exported)
        for where, expr in used.items()
        if metric_names(expr) - exported
    }
    assert unknown == {}
    # and they cover what an operator watches: lease, pauses, the adapters, fences, the hook
    everything = set().union(*map(metric_names, used.values()))
    for name in (
        "vmlend_lease_renew_failures_total",
        "vmlend_paused_vms",
        "vmlend_adapter_lut_entries_used",
        "vmlend_adapter_window_bytes_used",
        "vmlend_fences_pending",
        "vmlend_hook_call_duration_seconds_bucket",
    ):
        assert name in everything


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("vmlend_paused_vms > 0", {"vmlend_paused_vms"}),
        (
            'histogram_quantile(0.99, sum by (le, op) (rate(a_bucket{op="x",le=~"1"}[5m])))',
            {"a_bucket"},
        ),
        ("max without (instance) (a) / on (adapter) group_left (node) (b > 0) > 0.9", {"a", "b"}),
        ("increase(c_total[1h]) > 0 or (c_total unless c_total offset 1h)", {"c_total"}),
        ('time() - d{job=~"$job"} and bool 1e3', {"d"}),
        ('label_join(e, "dst", ",", "a", "b")', {"e"}),
    ],
)
def test_the_metric_names_of_an_expression_are_found(expr, names):
    assert metric_names(expr) == names


def test_a_name_the_agent_does_not_export_is_caught(exported):
    assert metric_names("rate(vmlend_hook_calls[5m])") - exported == {"vmlend_hook_calls"}
    assert "vmlend_hook_calls_total" in exported
    assert {"process_open_fds", "vmlend_hook_call_duration_seconds_count"} <= exported


def test_the_dashboard_is_laid_out_and_asks_its_data_source_variable():
    board = dashboard()
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        cells = {(x, y) for x in xs for y in ys}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "job", "instance"]


def test_the_files_are_package_data_and_documented():
    cfg = (REPO / "setup.cfg").read_text()
    assert "data/**/*.yml" in cfg and "data/**/*.json" in cfg
    guide = (REPO / "docs" / "monitoring.md").read_text()
    for rule in alert_rules():
        assert f"`{rule['alert']}`" in guide, rule["alert"]
    assert DASHBOARD.name in guide and RULES.name in guide
