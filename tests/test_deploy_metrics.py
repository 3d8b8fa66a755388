"""deploy/ (the Grafana dashboard, the Prometheus alert rules) against what the app serves: after a
small scripted run on real processes (the API server and a worker sharing a multiprocess metrics
directory, as bin/run starts them; jobs through a sim executor, so histograms have samples), every
metric that deploy/ queries is a series on the live /metrics, with the labels its selectors and
groupings name. And the files themselves: the dashboard imports with a datasource input; the
rules and the dashboard's queries parse (promtool), the alerts fire on the series they are for
(promtool's rule tests), the live exposition passes `promtool check metrics`, and a real
Prometheus run with the example config scrapes the app, evaluates the rules without error and
answers every dashboard query with series."""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from quotas.models import QuotaPolicy
from tests.conftest import chat_body
from tests.credentials import token_for
from tests.processes import ROOT, free_port, wait_until

DASHBOARD = ROOT / "deploy/grafana/telemachus.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
ALERT_TESTS = ROOT / "deploy/prometheus/alerts_test.yml"

# PromQL words that are not metric names: aggregation and binary keywords, modifiers.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
KEYWORDS |= {"inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\{[^}]*\})?(\s*\()?")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
# Histogram and counter samples are queried by their series names; the family is the name without.
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}


@dataclass
class Use:
    """A metric as one PromQL expression uses it: label matchers and the labels it groups by."""

    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)


def metric_uses(expr: str) -> list[Use]:
    """The metrics a PromQL expression reads. Range selectors (and Grafana's variables in them) are
    set aside; an identifier followed by `(` is a function (or an aggregation), one in a grouping
    clause a label, a keyword or a number's exponent nothing, the rest metric names, each with its
    `{...}` matchers (whose quoted values are not read as names)."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # [5m], [$__rate_interval], subqueries' [1h:1m]
    groupings = {label.strip() for _, labels in GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    expr = GROUPING.sub(" ", expr)
    uses = []
    for name, braces, call in IDENTIFIER.findall(expr):
        if call or name.lower() in KEYWORDS:
            continue
        uses.append(Use(name, MATCHER.findall(braces or ""), groupings))
    return uses


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def as_promql(expr: str) -> str:
    """A dashboard query as plain PromQL: Grafana's variables replaced by values."""
    return expr.replace("$__rate_interval", "5m").replace("$team", ".*")


def test_the_extractor_finds_names_labels_and_only_those():
    uses = metric_uses(
        'histogram_quantile(0.95, max by (team, le) (rate(telemachus_job_wait_seconds_bucket{team=~"$team"}'
        "[$__rate_interval]))) > 1e3 and on (team) time() - up offset 5m"
    )
    assert [(u.name, u.matchers) for u in uses] == [
        ("telemachus_job_wait_seconds_bucket", [("team", "=~", "$team")]),
        ("up", []),
    ]
    assert uses[0].grouping == {"team", "le"}
    assert {u.name for e in dashboard_exprs() + alert_exprs() for u in metric_uses(e)} >= {
        "telemachus_queue_depth",
        "telemachus_job_wait_seconds_bucket",
        "telemachus_executor_breaker",
        "telemachus_worker_heartbeat_timestamp_seconds",
        "telemachus_budget_limit",
        "telemachus_http_responses_total",
    }


def test_the_dashboard_imports_with_a_prometheus_datasource_input():
    dashboard = json.loads(DASHBOARD.read_text())
    (source,) = dashboard["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["type"] == "datasource" and source["pluginId"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
    titles = " / ".join(p["title"] for p in panels)
    for topic in (
        "Queue depth",
        "Slots in use vs cap",
        "p50 / p95",
        "Tokens",
        "outcomes",
        "Breaker",
        "5xx",
        "heartbeat",
    ):
        assert topic in titles


# --- the live run ----------------------------------------------------------------------------


def http(url: str, token: str, body: dict | None = None) -> tuple[bytes, str]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=40) as response:
        return response.read(), response.headers["Content-Type"]


@dataclass
class Live:
    base: str
    operator_token: str
    scrape: str


def live_app(processes, tmp_path, make_user, make_team, make_executor) -> Live:
    """Daphne and a worker after a worker ran three jobs through a sim executor, then, with the
    team capped at one slot, one slow job running and one queued behind it; a budget set; one 502
    (an executor sync that cannot reach its server). Daphne and the worker share one
    multiprocess directory, as bin/run starts them. With the API server's /metrics at the end."""
    alice, operator = make_user("alice"), make_user("operator", is_superuser=True)
    make_team("deploy", {alice: "member"})
    make_executor("deploy-sim", models=["m"], max_concurrency=2, meta={"latency_ms": 20})
    make_executor("deploy-slow", models=["slow"], max_concurrency=2, meta={"latency_ms": 60_000})
    QuotaPolicy.objects.create(scope="team", subject="deploy", dimension="ai.tokens", limit=100_000, window="day")
    alice_token, operator_token = (token_for(user) for user in (alice, operator))
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    base = processes.api_server(PROMETHEUS_MULTIPROC_DIR=str(multiproc))
    processes.worker("deploy-worker", PROMETHEUS_MULTIPROC_DIR=str(multiproc))

    def submit(model: str) -> dict:
        return json.loads(http(f"{base}/api/jobs/", alice_token, chat_body("deploy", model=model))[0])

    def status(job: dict) -> str:
        return json.loads(http(f"{base}/api/jobs/{job['id']}/", alice_token)[0])["status"]

    for job in [submit("m") for _ in range(3)]:
        done = json.loads(http(f"{base}/api/jobs/{job['id']}/wait/?timeout=30", alice_token)[0])
        assert done["status"] == "done", done
    QuotaPolicy.objects.create(scope="team", subject="deploy", dimension="ai.concurrency", limit=1)
    slow = submit("slow")
    wait_until(lambda: status(slow) == "running", timeout=30, what="the slow job to start")
    waiting = submit("m")
    time.sleep(0.5)
    assert status(waiting) == "queued"
    unreachable = make_executor("deploy-gone", kind="local-model", endpoint=f"http://127.0.0.1:{free_port()}/v1")
    try:
        http(f"{base}/api/executors/{unreachable.pk}/sync/", operator_token, {})
    except urllib.error.HTTPError as exc:
        assert exc.code == 502
    # The worker's heartbeat reaches the API server's scrape through the shared directory.
    wait_until(
        lambda: b"telemachus_worker_heartbeat_timestamp_seconds{" in http(f"{base}/metrics", operator_token)[0],
        timeout=30,
        what="the worker's heartbeat on the API server's /metrics",
    )
    body, content_type = http(f"{base}/metrics", operator_token)
    assert content_type.startswith("text/plain; version=")
    return Live(base, operator_token, body.decode())


def served(scrape: str) -> dict[str, tuple[str, str, list]]:
    """Each series name on the scrape -> (its family, the family's type, its samples)."""
    names = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            names.setdefault(sample.name, (family.name, family.type, []))[2].append(sample)
    return names


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_metric_deploy_uses_is_served_by_a_live_app(processes, tmp_path, make_user, make_team, make_executor):
    scrape = live_app(processes, tmp_path, make_user, make_team, make_executor).scrape
    series = served(scrape)
    for expr in dashboard_exprs() + alert_exprs():
        for use in metric_uses(expr):
            assert use.name in series, f"{use.name} (in {expr!r}) is not on /metrics"
            family, kind, samples = series[use.name]
            suffix = use.name[len(family) :]
            assert suffix in SUFFIXES.get(kind, ()) + ("",), f"{use.name}: a {kind} has no {suffix} series"
            labels = set().union(*(s.labels for s in samples))
            for label, op, value in use.matchers:
                assert label in labels, f"{use.name} has no label {label!r} (in {expr!r})"
                if op == "=":
                    assert any(s.labels.get(label) == value for s in samples), (
                        f"{use.name} has no series with {label}={value!r}"
                    )
            # A grouping may name `le`, the target's labels, or labels of the other operand.
            known = labels | {"instance", "job"} | labels_in(expr, series)
            assert use.grouping <= known, f"{use.name}: grouping {use.grouping - known} (in {expr!r})"

    # And the exposition itself is clean by Prometheus's own linter.
    tool = promtool()
    checked = subprocess.run([tool, "check", "metrics"], input=scrape, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def labels_in(expr: str, series: dict) -> set[str]:
    """Labels that some metric of the expression has."""
    return set().union(
        *(set().union(*(s.labels for s in series[u.name][2])) for u in metric_uses(expr) if u.name in series)
    )


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is missing (Debian: apt-get install prometheus; .ci/run installs it)")
    return path


def test_the_rules_and_the_dashboards_queries_parse(tmp_path):
    tool = promtool()
    checked = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # promtool parses PromQL in rule files only: the dashboard's queries, as recording rules.
    rules = [{"record": f"dashboard:query{i}", "expr": as_promql(e)} for i, e in enumerate(dashboard_exprs())]
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(
        [tool, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_alert_fires_on_the_series_it_is_for():
    tested = subprocess.run(
        [promtool(), "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a test of its own that expects it to fire.
    expected = {
        alert["alertname"]
        for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for check in case.get("alert_rule_test", [])
        for alert in [check]
        if check.get("exp_alerts")
    }
    assert expected == {
        rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    }


def test_the_example_prometheus_config_is_valid(tmp_path):
    """As installed: prometheus.yml beside alerts.yml and the operator's token file."""
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(ALERTS.parent / name, tmp_path / name)
    (tmp_path / "telemachus.token").write_text("an operator's token\n")
    checked = subprocess.run(
        [promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_prometheus_scrapes_with_the_example_config_and_every_rule_and_query_evaluates(
    processes, tmp_path, make_user, make_team, make_executor
):
    """A real Prometheus (Debian's), configured by deploy/prometheus/prometheus.yml with only the
    target and intervals changed: it authenticates with the token file, the five rules load and
    evaluate without error, and every dashboard query answers with series."""
    server = shutil.which("prometheus")
    if server is None:
        pytest.skip("prometheus is missing (Debian: apt-get install prometheus)")
    live = live_app(processes, tmp_path, make_user, make_team, make_executor)
    config = yaml.safe_load((ALERTS.parent / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [urllib.parse.urlsplit(live.base).netloc]}]
    home = tmp_path / "etc-prometheus"
    home.mkdir()
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS, home / "alerts.yml")
    (home / "telemachus.token").write_text(live.operator_token + "\n")
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    prometheus = subprocess.Popen(
        [
            server,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def api(path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except OSError:
            return {}

    def query(expr: str) -> list:
        answer = api("query", query=expr)
        assert answer.get("status") == "success", (expr, answer)
        return answer["data"]["result"]

    try:
        wait_until(lambda: api("query", query="up").get("status"), timeout=60, what="prometheus to answer")
        # Three scrapes, so that rates have samples to work from.
        wait_until(lambda: query('count_over_time(up{job="telemachus"}[1m]) >= 3'), timeout=30, what="three scrapes")
        assert query('up{job="telemachus"}')[0]["value"][1] == "1", "the token file authenticates the scrape"

        def rules_evaluated() -> list:
            rules = [r for g in api("rules").get("data", {}).get("groups", []) for r in g["rules"]]
            # Evaluated: a last evaluation later than the zero time (0001-01-01T00:00:00Z).
            return rules if len(rules) == 5 and all(r["lastEvaluation"] > "2000" for r in rules) else []

        rules = wait_until(rules_evaluated, timeout=30, what="the rules to be evaluated")
        assert all(rule["health"] == "ok" for rule in rules), rules
        for expr in alert_exprs():
            query(expr)
        for expr in dashboard_exprs():
            assert query(as_promql(expr).replace("[5m]", "[1m]")), f"no series for {expr!r}"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        log.close()
